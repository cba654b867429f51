-- test_schedule.lua — DeepSpeed's OneCycle and LRRangeTest schedules
-- against the formulas of DeepSpeed's lr_schedules documentation, computed
-- by hand at several steps (step n runs at last_batch_iteration n - 2), the
-- betas OneCycle drives, the config's checks, and runs that train with them.
local lz = require("luazero")
local config = require("luazero.config")
local schedule = require("luazero.optim.schedule")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local T = {}

local expect_error = support.expect_error

local function close(got, want, what)
  assert(math.abs(got - want) <= 1e-15 + 1e-12 * math.abs(want),
         ("%s: %.17g, expected %.17g"):format(what, got, want))
end

local function cfg_of(sched)
  return config.load({ train_batch_size = 1, scheduler = sched }, 1)
end

-- cycle 10 steps (first 4 up, second 6 down): ratio 0.4; scale at
-- b = it + 1: x = 1 + b/10 - floor(1 + b/10), x / 0.4 while x <= 0.4, else
-- (x - 1) / (0.4 - 1); lr = min + (max - min) * scale, beta1 = max_mom -
-- (max_mom - min_mom) * scale, beta2 0.99.
local one_cycle = { type = "OneCycle", params = {
  cycle_min_lr = 0.001, cycle_max_lr = 0.01, cycle_first_step_size = 4,
  cycle_second_step_size = 6, decay_lr_rate = 0.5, decay_step_size = 2,
  cycle_min_mom = 0.85, cycle_max_mom = 0.95, decay_mom_rate = 0.1 } }

function T.one_cycle_lr()
  local lr = schedule.lr_schedule(cfg_of(one_cycle))
  close(lr(1), 0.001, "step 1 (it -1: b 0, scale 0)")
  close(lr(2), 0.00325, "step 2 (b 1: x 0.1, scale 0.25)")
  close(lr(4), 0.00775, "step 4 (b 3: scale 0.75)")
  close(lr(5), 0.01, "step 5 (b 4: x 0.4, the top)")
  close(lr(8), 0.0055, "step 8 (b 7: x 0.7, scale 0.5)")
  close(lr(11), 0.001, "step 11 (it 9, b 10: x 0, the cycle's end)")
  -- after the cycle: min / (1 + decay_lr_rate * (it - 10 + 1) / decay_step_size)
  close(lr(12), 0.001 / 1.25, "step 12 (it 10: interval 1/2)")
  close(lr(16), 0.001 / 2.25, "step 16 (it 14: interval 5/2)")
  -- cycle_second_step_size defaults to the first; no decay without a rate.
  lr = schedule.lr_schedule(cfg_of({ type = "OneCycle", params = {
    cycle_min_lr = 0.1, cycle_max_lr = 0.5, cycle_first_step_size = 5 } }))
  close(lr(4), 0.1 + 0.4 * 0.6, "step 4 (b 3 of a 5 + 5 cycle)")
  close(lr(6), 0.5, "step 6 (b 5, the top)")
  close(lr(9), 0.1 + 0.4 * 0.4, "step 9 (b 8: x 0.8, scale (0.8 - 1) / (0.5 - 1))")
  close(lr(12), 0.1, "step 12 (it 10: after the cycle, decay_step_size 0)")
  close(lr(100), 0.1, "long after")
end

function T.one_cycle_betas()
  local cfg = cfg_of(one_cycle)
  local betas = assert(schedule.betas_schedule(cfg), "cycle_momentum defaults to true")
  local function b(step, want1, what)
    local b1, b2 = betas(step)
    close(b1, want1, what)
    assert(b2 == 0.99, what .. ": beta2 " .. b2 .. ", expected 0.99")
  end
  b(1, 0.85, "step 1 (it -1: DeepSpeed sets cycle_min_mom at construction)")
  b(2, 0.925, "step 2 (scale 0.25)")
  b(5, 0.85, "step 5 (the lr's top is beta1's bottom)")
  b(8, 0.9, "step 8 (scale 0.5)")
  b(11, 0.95, "step 11 (the cycle's end)")
  -- after the cycle: max_mom * (1 + decay_mom_rate * (it - 10 + 1) / decay_step_size)
  b(12, 0.95 * 1.05, "step 12")
  b(14, 0.95 * 1.15, "step 14")
  one_cycle.params.cycle_momentum = false
  assert(schedule.betas_schedule(cfg_of(one_cycle)) == nil, "cycle_momentum false: betas alone")
  one_cycle.params.cycle_momentum = nil
  assert(schedule.betas_schedule(cfg_of({ type = "WarmupLR" })) == nil)
  -- drive_betas: each lr lookup sets the optimizer's betas first.
  local opt = require("luazero.optim").new({ type = "AdamW" })
  local engine = { optimizer = opt, lr = schedule.lr_schedule(cfg) }
  schedule.drive_betas(engine, cfg)
  close(engine.lr(2), 0.00325, "driven lr")
  close(opt.beta1, 0.925, "driven beta1")
  assert(opt.beta2 == 0.99)
end

function T.lr_range_test()
  -- min * (1 + rate * (it + 1) / step_size); staircase floors the interval.
  local p = { lr_range_test_min_lr = 1e-3, lr_range_test_step_size = 10,
              lr_range_test_step_rate = 0.5 }
  local lr = schedule.lr_schedule(cfg_of({ type = "LRRangeTest", params = p }))
  close(lr(1), 1e-3, "step 1 (it -1: interval 0)")
  close(lr(2), 1.05e-3, "step 2 (it 0: interval 0.1)")
  close(lr(12), 1.55e-3, "step 12 (it 10: interval 1.1)")
  close(lr(102), 6.05e-3, "step 102 (it 100: interval 10.1)")
  p.lr_range_test_staircase = true
  lr = schedule.lr_schedule(cfg_of({ type = "LRRangeTest", params = p }))
  close(lr(10), 1e-3, "staircase step 10 (interval floor(0.9) = 0)")
  close(lr(11), 1.5e-3, "staircase step 11 (floor(1.0) = 1)")
  close(lr(30), 2e-3, "staircase step 30 (interval floor(2.9) = 2)")
  -- DeepSpeed's defaults: min 1e-3, step size 2000, rate 1.
  lr = schedule.lr_schedule(cfg_of({ type = "LRRangeTest" }))
  close(lr(2002), 2.0005e-3, "defaults: step 2002 (it 2000: interval 2001 / 2000)")
end

function T.config_checks_their_parameters()
  local function load(sched) return function() config.load({ train_batch_size = 1,
                                                             scheduler = sched }, 1) end end
  expect_error(load({ type = "OneCycle", params = { cycle_max_lr = 0.01 } }),
               "config: scheduler.params.cycle_min_lr is required by OneCycle (a number >= 0")
  expect_error(load({ type = "OneCycle", params = { cycle_min_lr = 0, cycle_max_lr = 1,
                                                    cycle_first_step_size = 0 } }),
               "config: scheduler.params.cycle_first_step_size must be a whole number >= 1 (got 0)")
  expect_error(load({ type = "OneCycle", params = { cycle_min_lr = 0, cycle_max_lr = 1,
                                                    cycle_momentum = "yes" } }),
               'config: scheduler.params.cycle_momentum must be true or false (got "yes")')
  expect_error(load({ type = "LRRangeTest", params = { warmup_num_steps = 3 } }),
               "config: scheduler.params.warmup_num_steps is not a parameter of LRRangeTest " ..
               "(it takes lr_range_test_min_lr, lr_range_test_staircase, " ..
               "lr_range_test_step_rate, lr_range_test_step_size)")
  expect_error(load({ type = "Cyclic" }), "config: scheduler.type must be WarmupLR, " ..
               "WarmupDecayLR, WarmupCosineLR, OneCycle or LRRangeTest (got \"Cyclic\")")
  -- --steps fills only the schedulers with a total; --warmup is refused where
  -- there is no warmup.
  local cfg = config.load({ train_batch_size = 1, scheduler = { type = "LRRangeTest" } }, 1,
                          { total_steps = 50 })
  assert(cfg.scheduler.params.total_num_steps == nil)
  expect_error(function() config.load({ train_batch_size = 1, scheduler = {
                 type = "OneCycle", params = { cycle_min_lr = 0, cycle_max_lr = 1 } } }, 1,
                 { warmup = 5 }) end,
               "config: --warmup does not apply to scheduler OneCycle")
end

-- Runs train.lua with a config holding `sched`; returns the log's records
-- and the checksum.
local write_file, tmp = support.scratch()
local corpus = write_file("corpus.txt", ("Tyger Tyger, burning bright, In the forests of the " ..
                                         "night; "):rep(60))
local _, ok_train = support.trainer("--model gpt2-nano --n-layer 1 --n-embd 32 --n-head 2 " ..
                                    "--context 16 --sample 0 --eval-batches 1 --data " ..
                                    support.quote(corpus))
local function run(name, sched)
  local cjson = require("cjson")
  local cfg = write_file(name .. ".json", cjson.encode({
    train_micro_batch_size_per_gpu = 2, optimizer = { type = "AdamW", params = { lr = 1e-3 } },
    scheduler = sched }))
  local log = tmp .. "/" .. name .. ".jsonl"
  local _, sum = ok_train(1, ("--steps 6 --config %s --log %s"):format(support.quote(cfg),
                                                                       support.quote(log)))
  local recs = support.records(log)
  return recs, sum
end

function T.configs_with_them_train()
  local p = { cycle_min_lr = 1e-3, cycle_max_lr = 1e-2, cycle_first_step_size = 2 }
  local recs, with_mom = run("onecycle", { type = "OneCycle", params = p })
  local lr = schedule.lr_schedule(cfg_of({ type = "OneCycle", params = p }))
  for i = 1, 6 do close(recs[i].lr, lr(i), "logged lr at step " .. i) end
  assert(recs[3].lr == 1e-2, "the cycle's top at step 3")
  p.cycle_momentum = false
  local _, without = run("onecycle_nomom", { type = "OneCycle", params = p })
  assert(with_mom ~= without, "cycling beta1 changes the weights")
  recs = run("rangetest", { type = "LRRangeTest", params = { lr_range_test_min_lr = 1e-4,
                                                             lr_range_test_step_size = 2 } })
  for i = 1, 6 do close(recs[i].lr, 1e-4 * (1 + (i - 1) / 2), "range test lr at step " .. i) end
  assert(recs[6].loss == recs[6].loss and recs[6].loss < 10, "the run trains")
end

-- A resumed OneCycle run with cycle_momentum continues bitwise: each step's
-- betas come from its step number, not from state.
function T.one_cycle_resumes_bitwise()
  local cjson = require("cjson")
  local cfg = write_file("resume.json", cjson.encode({
    train_micro_batch_size_per_gpu = 2, optimizer = { type = "AdamW", params = { lr = 1e-3 } },
    scheduler = { type = "OneCycle", params = { cycle_min_lr = 1e-3, cycle_max_lr = 1e-2,
                                                cycle_first_step_size = 2 } } }))
  local dir = tmp .. "/resume"
  local flags = "--steps 6 --config " .. support.quote(cfg)
  local _, straight = ok_train(1, flags .. " --save " .. support.quote(dir) .. " --save-every 3")
  local _, resumed = ok_train(1, flags .. " --resume " .. support.quote(dir .. "/step-000003"))
  assert(straight == resumed, ("resumed %s, straight %s"):format(resumed, straight))
end

return T
