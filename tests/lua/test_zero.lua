-- test_zero.lua — the ZeRO engine end to end: scripts/train.lua under the
-- launcher (`luazero -n N`) on a tiny GPT-2. Stages 0-3 agree bitwise,
-- world sizes agree on the losses, the ledger and the comm counters hold
-- the bytes the layout says (docs/zero.md), --stage auto, fp16 overflow,
-- configuration errors.
local cjson = require("cjson")
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local gpt2 = require("models.gpt2")
local layout = require("luazero.zero.layout")

local T = {}
local root = lz.root

local exe = lz.executable

local q = support.quote

local write_file, tmp = support.scratch()

local text = ("To be, or not to be, that is the question:\n" ..
              "Whether 'tis nobler in the mind to suffer\n"):rep(60)
local corpus = write_file("corpus.txt", text)

-- The tiny model: 2 blocks of width 64. LayerNorms (128 elements) fall under
-- the persistence threshold of 128; every other module is partitioned.
local MODEL = { n_layer = 2, n_embd = 64, n_head = 4, context = 32 }
local THRESHOLD = 128
local model_flags = ("--model gpt2-nano --n-layer %d --n-embd %d --n-head %d --context %d " ..
                     "--seq-len 16 --sample 0 --eval-batches 1 --seed 7")
                    :format(MODEL.n_layer, MODEL.n_embd, MODEL.n_head, MODEL.context)

local function config_file(name, t) return write_file(name, cjson.encode(t)) end

local base_config = config_file("zero.json", {
  train_batch_size = 4, gradient_clipping = 1.0,
  optimizer = { type = "AdamW", params = { lr = 3e-3, betas = { 0.9, 0.95 },
                                           weight_decay = 0.1 } },
  zero_optimization = { stage3_param_persistence_threshold = THRESHOLD, overlap_comm = true,
                        reduce_bucket_size = 20000, stage3_prefetch_bucket_size = 20000 },
})

-- Runs train.lua on n ranks; returns output, exit status.
local function train(n, flags, env)
  local cmd = ("cd %s && %s %s %s scripts/train.lua %s 2>&1; echo \"EXIT:$?\"")
              :format(q(root), env or "", q(exe()), n > 1 and ("-n " .. n) or "", flags)
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  local status = tonumber(out:match("EXIT:(%d+)%s*$"))
  return out:gsub("EXIT:%d+%s*$", ""), status
end

-- Log records of a run (memoised: several tests read the same runs).
local runs = {}
local function run(n, stage, dtype, steps, extra, cfg)
  local key = table.concat({ n, stage, dtype, steps, extra or "", cfg or "" }, "|")
  if runs[key] then return runs[key] end
  local log = ("%s/run%d.jsonl"):format(tmp, #(function() local c = {} for k in pairs(runs) do c[#c + 1] = k end return c end)() + 1)
  local out, status = train(n, ("%s --data %s --config %s --stage %s --dtype %s --steps %d " ..
                                "--log %s %s"):format(model_flags, corpus, cfg or base_config, stage,
                                                      dtype, steps, log, extra or ""))
  assert(status == 0, ("world %d stage %s %s failed:\n%s"):format(n, stage, dtype, out))
  local recs = support.records(log)
  local r = { out = out, recs = recs, checksum = recs[#recs].params_checksum }
  runs[key] = r
  return r
end

local function the_layout(world)
  local m = gpt2.new(gpt2.config("gpt2-nano", MODEL))
  return layout.new(m.param_table, world), m
end

------------------------------------------------------- (a) stages agree

function T.stages_0_to_3_end_with_the_same_checksum_at_world_2_and_4()
  for _, dtype in ipairs({ "fp32", "bf16" }) do
    for _, n in ipairs({ 2, 4 }) do
      local sums = {}
      for stage = 0, 3 do sums[stage] = run(n, stage, dtype, 20).checksum end
      print(("    world %d %s: %s %s %s %s"):format(n, dtype, sums[0], sums[1], sums[2], sums[3]))
      for stage = 1, 3 do
        assert(sums[stage] == sums[0], ("world %d %s: stage %d checksum %s != stage 0's %s")
               :format(n, dtype, stage, sums[stage], sums[0]))
      end
    end
  end
end

---------------------------------------------------- (b) world sizes agree

function T.world_1_2_4_losses_agree_at_one_global_batch()
  local base = run(1, 0, "fp32", 20).recs
  for _, n in ipairs({ 2, 4 }) do
    local recs = run(n, n == 2 and 2 or 3, "fp32", 20).recs
    local worst = 0
    for i = 1, 20 do
      local a, b = base[i].loss, recs[i].loss
      worst = math.max(worst, math.abs(a - b) / math.abs(a))
      assert(recs[i].tokens == base[i].tokens, "same global batch")
    end
    print(("    world %d vs 1: largest relative loss difference %.2e"):format(n, worst))
    assert(worst < 1e-4, ("world %d: losses differ by %.2e relative"):format(n, worst))
    -- the validation batch is global too: each rank evaluates its part
    local a, b = base[20].val_loss, recs[20].val_loss
    assert(a and b and math.abs(a - b) <= 1e-4 * math.abs(a),
           ("world %d: val_loss %s, world 1's %s"):format(n, tostring(b), tostring(a)))
  end
end

------------------------------------------- (b2) gradient accumulation

-- With gradient_accumulation_steps > 1 every stage reduces each micro-step's
-- gradients and adds them, in the same order, into its fp32 gradients
-- (docs/zero.md, Determinism): stages 0-3 still agree bitwise, and world
-- sizes still agree on the losses. Global batch 4: world 2 runs micro-batch
-- 1 x accumulation 2, world 1 micro-batch 2 x accumulation 2.
function T.gradient_accumulation_keeps_stages_bitwise_equal_and_worlds_close()
  local steps, accum = 10, "--grad-accum 2"
  for _, dtype in ipairs({ "fp32", "bf16" }) do
    local sums = {}
    for stage = 0, 3 do
      local r = run(2, stage, dtype, steps, accum)
      assert(r.out:find("2 micro-batches per step", 1, true), r.out)
      sums[stage] = r.checksum
    end
    print(("    world 2 %s accumulation 2: %s %s %s %s"):format(dtype, sums[0], sums[1], sums[2],
          sums[3]))
    for stage = 1, 3 do
      assert(sums[stage] == sums[0], ("%s accumulation 2: stage %d checksum %s != stage 0's %s")
             :format(dtype, stage, sums[stage], sums[0]))
    end
  end
  -- Bytes per optimizer step: the gradient reductions (and stage 3's
  -- gathers for forward and backward) once per micro-step, the step's
  -- all-gathers once.
  local W = 2
  local L = the_layout(W)
  local full, K = L.full_numel, #L.segments + 1
  local meta, rs = (W - 1) * 8 * K, (W - 1) / W * 4 * full
  local fb, persistent = 0, 0
  for _, s in ipairs(L.segments) do
    local users = s.index == 1 and 2 or 1
    if s.numel <= THRESHOLD then persistent = persistent + s.padded
    else fb = fb + 2 * users * s.padded end
  end
  fb, persistent = (W - 1) / W * 4 * fb, (W - 1) / W * 4 * persistent
  local expect = {
    [0] = { all_reduce = 2 * 2 * rs, reduce_scatter = 0, all_gather = meta },
    [1] = { all_reduce = 0, reduce_scatter = 2 * rs, all_gather = rs + meta },
    [2] = { all_reduce = 0, reduce_scatter = 2 * rs, all_gather = rs + meta },
    [3] = { all_reduce = 0, reduce_scatter = 2 * rs, all_gather = 2 * fb + persistent + meta },
  }
  for stage = 0, 3 do
    local c = run(W, stage, "fp32", steps, accum).recs[5].comm
    for _, k in ipairs({ "all_reduce", "reduce_scatter", "all_gather" }) do
      assert(c[k] == expect[stage][k], ("accumulation 2, stage %d: %s %d bytes, expected %d")
             :format(stage, k, c[k], expect[stage][k]))
    end
  end
  local base = run(1, 0, "fp32", steps, accum).recs
  local recs = run(2, 3, "fp32", steps, accum).recs
  local worst = 0
  for i = 1, steps do
    assert(recs[i].tokens == base[i].tokens, "same global batch")
    worst = math.max(worst, math.abs(base[i].loss - recs[i].loss) / math.abs(base[i].loss))
  end
  print(("    accumulation 2, world 2 vs 1: largest relative loss difference %.2e"):format(worst))
  assert(worst < 1e-4, ("accumulation 2: losses differ by %.2e relative"):format(worst))
end

----------------------------------------------------- (c) model-state bytes

-- Padded elements of the segments kept whole (at or under the threshold).
local function persistent_elements(L)
  local n = 0
  for _, s in ipairs(L.segments) do
    if s.numel <= THRESHOLD then n = n + s.padded end
  end
  return n
end

-- bf16 working params (2 bytes), fp32 gradients (4: the kernels accumulate
-- in fp32), fp32 master + Adam m, v (12): per rank, Ψ padded per segment.
function T.model_state_bytes_match_the_layout_at_world_4_bf16()
  local W = 4
  local L = the_layout(W)
  local psi, full, shard = L.numel, L.full_numel, L.shard_numel
  local persistent = persistent_elements(L)
  local expect = {
    [1] = { formula = "2Ψ + 4Ψ + 12Ψ/N", params = 2 * full, grads = 4 * full, optimizer = 12 * shard },
    [2] = { formula = "2Ψ + (4 + 12)Ψ/N + buckets", params = 2 * full, grads = 4 * shard,
            optimizer = 12 * shard },
    [3] = { formula = "(2 + 4 + 12)Ψ/N + 2·persistent + buckets",
            params = 2 * shard + 2 * persistent, grads = 4 * shard, optimizer = 12 * shard },
  }
  print(("    Ψ = %d parameters (%d padded, shard %d); persistent %d"):format(psi, full, shard,
        persistent))
  for stage = 1, 3 do
    local mem = run(W, stage, "bf16", 20).recs[20].mem
    local e = expect[stage]
    local states = mem.params + mem.grads + mem.optimizer
    local formula = ({ 2 * psi + 4 * psi + 12 * psi / W, 2 * psi + 16 * psi / W,
                       18 * psi / W + 2 * persistent })[stage]
    print(("    stage %d: params %d (expect %d), grads %d (%d), optimizer %d (%d); " ..
           "%s = %.0f, buckets (comm) %d")
          :format(stage, mem.params, e.params, mem.grads, e.grads, mem.optimizer, e.optimizer,
                  e.formula, formula, mem.comm))
    assert(mem.params == e.params and mem.grads == e.grads and mem.optimizer == e.optimizer)
    assert(math.abs(states - formula) / formula < 0.02,
           ("stage %d: %d bytes vs formula %.0f"):format(stage, states, formula))
    if stage == 1 then assert(mem.comm == 0, "stage 1 has no buckets") end
    if stage >= 2 then
      -- Gradient staging (reduce_bucket_size in flight plus the segment being
      -- filled) and, stage 3, gathered parameters: bounded by the config.
      local bound = 4 * (20000 + 2 * L.segments[1].padded) * 2 + 2 * 2 * (20000 + full)
      assert(mem.comm > 0 and mem.comm < bound, "buckets " .. mem.comm)
    end
  end
end

-- Lion through the engine: the optimizer object the config names; stages
-- agree bitwise as with AdamW, and the ledger holds the one state Lion
-- declares (master + m: 8 bytes per shard element in bf16, AdamW 12).
local lion_config = config_file("zero_lion.json", {
  train_batch_size = 4, gradient_clipping = 1.0,
  optimizer = { type = "Lion", params = { lr = 3e-4, betas = { 0.9, 0.99 }, weight_decay = 0.1 } },
  zero_optimization = { stage3_param_persistence_threshold = THRESHOLD, overlap_comm = true,
                        reduce_bucket_size = 20000, stage3_prefetch_bucket_size = 20000 },
})

function T.lion_keeps_stages_bitwise_equal_with_one_state_at_world_2()
  local W = 2
  local L = the_layout(W)
  local sums = {}
  for stage = 0, 3 do
    local r = run(W, stage, "bf16", 6, nil, lion_config)
    sums[stage] = r.checksum
    local mem = r.recs[6].mem
    local n = stage == 0 and L.full_numel or L.shard_numel
    assert(mem.optimizer == 8 * n, ("stage %d: optimizer %d bytes, Lion keeps 8 x %d")
                                   :format(stage, mem.optimizer, n))
    assert(r.recs[6].loss < r.recs[1].loss, ("stage %d: Lion did not lower the loss"):format(stage))
  end
  for stage = 1, 3 do
    assert(sums[stage] == sums[0], ("stage %d: %s, stage 0: %s"):format(stage, sums[stage], sums[0]))
  end
  assert(sums[0] ~= run(W, 0, "bf16", 6).checksum, "Lion and AdamW ended on the same weights")
  -- Its checkpoints hold master and m; a resume continues bitwise, and a run
  -- with another optimizer is refused, naming both.
  local dir = tmp .. "/lion-ckpt"
  run(W, 3, "bf16", 3, "--save " .. q(dir), lion_config)
  local m = require("cjson").decode(io.open(dir .. "/step-000003/manifest.json"):read("*a"))
  assert(table.concat(m.states, ",") == "master,m", table.concat(m.states, ","))
  local resumed = run(W, 3, "bf16", 6, "--resume " .. q(dir), lion_config)
  assert(resumed.checksum == sums[3], ("resumed %s, uninterrupted %s"):format(resumed.checksum,
                                                                            sums[3]))
  local out, status = train(W, ("%s --data %s --config %s --stage 3 --dtype bf16 --steps 6 " ..
                                "--resume %s"):format(model_flags, corpus, base_config, q(dir)))
  assert(status ~= 0 and out:find("holds the states master, m; this run's optimizer AdamW " ..
                                  "keeps master, m, v", 1, true), out)
  print(("    Lion, stages 0-3 at world 2: %s; save at 3 + resume to 6 the same"):format(sums[0]))
end

-- Without a schedule the engine runs at its optimizer's own learning rate:
-- Lion's default when the config gives none, not AdamW's. (Lion's default
-- is set apart from AdamW's here, so that one cannot pass for the other.)
function T.the_engine_runs_at_its_own_optimizer_s_learning_rate()
  local config = require("luazero.config")
  local zero = require("luazero.zero")
  local saved = config.lion_defaults.lr
  config.lion_defaults.lr = 1e-4
  local ok, err = pcall(function()
    for _, c in ipairs({ { "Lion", nil, 1e-4 }, { "Lion", 3e-5, 3e-5 },
                         { "AdamW", nil, config.adam_defaults.lr } }) do
      local cfg = { train_micro_batch_size_per_gpu = 2,
                    optimizer = { type = c[1], params = { lr = c[2] } } }
      local engine = zero.initialize{ model = gpt2.new(gpt2.config("gpt2-nano", MODEL)),
                                      config = cfg, seed = 1, batch = { 2, 16 } }
      local lr, name = engine.lr(1), engine.optimizer.name
      engine:free()
      assert(name == c[1] and lr == c[3], ("%s, lr %s: runs at %g, wants %g")
                                          :format(c[1], tostring(c[2]), lr, c[3]))
    end
  end)
  config.lion_defaults.lr = saved
  assert(ok, err)
end

-- One engine a model: a second initialize of the same model is refused
-- (its parameters are the first engine's views), and after free it builds.
function T.a_model_serves_one_engine_at_a_time()
  local zero = require("luazero.zero")
  local m = gpt2.new(gpt2.config("gpt2-nano", MODEL))
  local opts = { model = m, seed = 1, batch = { 2, 16 }, config = { train_micro_batch_size_per_gpu = 2 } }
  local e = zero.initialize(opts)
  local ok, err = pcall(zero.initialize, opts)
  assert(not ok and tostring(err):find("initialize: this model is an engine's already", 1, true),
         tostring(err))
  e:free()
  -- (a freed engine's methods refuse in one line)
  ok, err = pcall(e.params_checksum, e)
  assert(not ok and tostring(err):find("engine:params_checksum: this engine was freed", 1, true),
         tostring(err))
  zero.initialize(opts):free()
  -- a model's config given for the model
  ok, err = pcall(zero.initialize, { model = gpt2.config("gpt2-nano", MODEL), seed = 1 })
  assert(not ok and tostring(err):find("zero.initialize: model must be a model", 1, true),
         tostring(err))
end

-- A step before the accumulation boundary does nothing (nil), as
-- DeepSpeed's engine.step(): stepping after every micro-batch is
-- train_batch's one update.
function T.a_step_before_the_accumulation_boundary_does_nothing()
  local zero, data = require("luazero.zero"), require("luazero.data")
  local sums = {}
  for _, each in ipairs({ false, true }) do
    local m = gpt2.new(gpt2.config("gpt2-nano", MODEL))
    local engine = zero.initialize{ model = m, seed = 1, batch = { 2, 16 }, config = {
      train_micro_batch_size_per_gpu = 2, gradient_accumulation_steps = 2 } }
    local loader = data.loader(data.load(corpus), { B = 2, T = 16, seed = 1, vocab = m.cfg.vocab })
    for _ = 1, 2 do
      if each then
        for k = 1, 2 do
          engine:backward(engine:forward(loader:next_batch()))
          local rec = engine:step()
          assert((rec == nil) == (k == 1), "a step at micro-batch " .. k)
        end
      else
        engine:train_batch(loader)
      end
    end
    sums[#sums + 1] = engine:params_checksum()
    engine:free()
  end
  support.eq(sums[2], sums[1], "stepping after every micro-batch")
end

-- Stage 3's prefetch is a window of stage3_prefetch_bucket_size elements
-- ahead: the parameters gathered at once stay within it and the module in
-- use (they grew by a bucket at every module, to the whole model).
function T.the_prefetch_window_slides_and_does_not_grow()
  local zero, data = require("luazero.zero"), require("luazero.data")
  local bucket = 20000
  local m = gpt2.new(gpt2.config("gpt2-nano", { n_layer = 4, n_embd = 64, n_head = 4, context = 16 }))
  local engine = zero.initialize{ model = m, seed = 1, batch = { 2, 16 }, config = {
    train_micro_batch_size_per_gpu = 2, zero_optimization = { stage = 3, overlap_comm = true,
      stage3_prefetch_bucket_size = bucket, stage3_param_persistence_threshold = 100 } } }
  local g = engine.gatherer
  local largest, total = 0, 0
  for _, seg in ipairs(g.L.segments) do
    largest, total = math.max(largest, seg.padded), total + seg.padded
  end
  local peak, gather = 0, g.gather
  g.gather = function(self, seg, async)
    gather(self, seg, async)
    peak = math.max(peak, self.live)
  end
  local loader = data.loader(data.load(corpus), { B = 2, T = 16, seed = 1, vocab = m.cfg.vocab })
  for _ = 1, 3 do engine:train_batch(loader) end
  engine:free()
  assert(total > 3 * (bucket + largest), "a model larger than the window")
  assert(peak <= bucket + 2 * largest, ("%d elements gathered at once: more than the window %d " ..
                                        "and two of the largest module's %d"):format(peak, bucket,
                                                                                    largest))
end

-- params_checksum streams the master a chunk at a time: the process's
-- resident peak grows by about one chunk (4 MiB), not by a gathered copy
-- of the 4M-element token table (16 MiB), resident or read from NVMe, and
-- the bits are the same both ways. (VmHWM, reset through clear_refs.)
local function kib(field)
  local f = io.open("/proc/self/status", "rb")
  local s = f and f:read("*a") or ""
  if f then f:close() end
  return tonumber(s:match(field .. ":%s*(%d+)"))
end

function T.the_checksum_adds_one_chunk_not_a_segment()
  local zero = require("luazero.zero")
  local sums = {}
  for _, c in ipairs({ { stage = 0 }, { stage = 2, offload_optimizer = { device = "nvme",
                                                                          nvme_path = tmp } } }) do
    -- (bf16: the fp32 master is the optimizer's, on NVMe with its states)
    local cfg = { train_micro_batch_size_per_gpu = 1, zero_optimization = c,
                  bf16 = { enabled = true } }
    local m = gpt2.new(gpt2.config("gpt2-nano", { n_layer = 1, n_embd = 1024, n_head = 4,
                                                  context = 8, vocab = 4096 }))
    local engine = zero.initialize{ model = m, config = cfg, seed = 1, batch = { 1, 8 } }
    local reset = io.open("/proc/self/clear_refs", "wb")
    if not (reset and reset:write("5") and reset:close() and kib("VmHWM")) then
      print("    (skipped the resident peak: no /proc/self/clear_refs)")
    end
    local before = kib("VmRSS")
    sums[#sums + 1] = engine:params_checksum()
    local added = (kib("VmHWM") or 0) - (before or 0)
    engine:free()
    assert(added <= 8 * 1024, ("stage %d: the checksum's peak added %d KiB"):format(c.stage, added))
  end
  support.eq(sums[2], sums[1], "the same checksum from NVMe")
end

-- data_types.grad_accum_dtype = bf16: gradients kept in the working dtype
-- (2 bytes), DeepSpeed's accounting: stage 1 4Ψ + 12Ψ/N, stage 2 2Ψ + 14Ψ/N,
-- stage 3 16Ψ/N (+ 2·persistent). The fp32 module gradients live only in
-- the staging buffers (comm) and the fp32 scratch (workspace).
local half_grads_config = config_file("zero_bf16_grads.json", {
  train_batch_size = 4, gradient_clipping = 1.0,
  optimizer = { type = "AdamW", params = { lr = 3e-3, betas = { 0.9, 0.95 },
                                           weight_decay = 0.1 } },
  zero_optimization = { stage3_param_persistence_threshold = THRESHOLD, overlap_comm = true,
                        reduce_bucket_size = 20000, stage3_prefetch_bucket_size = 20000 },
  data_types = { grad_accum_dtype = "bf16" },
})

function T.grad_accum_dtype_bf16_matches_deepspeeds_formulas_at_world_4()
  local W = 4
  local L = the_layout(W)
  local psi, full, shard = L.numel, L.full_numel, L.shard_numel
  local persistent = persistent_elements(L)
  local expect = {
    [1] = { formula = "4Ψ + 12Ψ/N", value = 4 * psi + 12 * psi / W,
            params = 2 * full, grads = 2 * full, optimizer = 12 * shard },
    [2] = { formula = "2Ψ + 14Ψ/N", value = 2 * psi + 14 * psi / W,
            params = 2 * full, grads = 2 * shard, optimizer = 12 * shard },
    [3] = { formula = "16Ψ/N + 2·persistent", value = 16 * psi / W + 2 * persistent,
            params = 2 * shard + 2 * persistent, grads = 2 * shard, optimizer = 12 * shard },
  }
  print(("    Ψ = %d parameters (%d padded, shard %d); persistent %d"):format(psi, full, shard,
        persistent))
  for stage = 1, 3 do
    local r = run(W, stage, "bf16", 20, nil, half_grads_config)
    assert(r.out:find("grads bf16", 1, true), r.out)
    local mem = r.recs[20].mem
    local e = expect[stage]
    local states = mem.params + mem.grads + mem.optimizer
    print(("    stage %d: params %d (expect %d), grads %d (%d), optimizer %d (%d); total %d, " ..
           "%s = %.0f (%.2f%%); buckets: comm %d, workspace %d")
          :format(stage, mem.params, e.params, mem.grads, e.grads, mem.optimizer, e.optimizer,
                  states, e.formula, e.value, 100 * (states - e.value) / e.value, mem.comm,
                  mem.workspace or -1))
    assert(mem.params == e.params and mem.grads == e.grads and mem.optimizer == e.optimizer)
    assert(math.abs(states - e.value) / e.value < 0.02,
           ("stage %d: %d bytes vs formula %.0f"):format(stage, states, e.value))
  end
end

function T.grad_accum_dtype_bf16_keeps_stages_bitwise_equal_at_world_2()
  for _, extra in ipairs({ "", "--grad-accum 2" }) do
    local sums = {}
    for stage = 0, 3 do sums[stage] = run(2, stage, "bf16", 20, extra, half_grads_config).checksum end
    print(("    world 2 bf16, bf16 gradients%s: %s %s %s %s"):format(
          extra == "" and "" or ", accumulation 2", sums[0], sums[1], sums[2], sums[3]))
    for stage = 1, 3 do
      assert(sums[stage] == sums[0], ("bf16 gradients%s: stage %d checksum %s != stage 0's %s")
             :format(extra, stage, sums[stage], sums[0]))
    end
    assert(sums[0] ~= run(2, 0, "bf16", 20, extra).checksum, "bf16 gradients change the result")
  end
  local out, status = train(1, ("%s --data %s --config %s --steps 1 --dtype fp32")
                               :format(model_flags, corpus, half_grads_config))
  assert(status ~= 0 and out:find("data_types.grad_accum_dtype", 1, true), out)
end

--------------------------------------------------------- (d) bytes sent

function T.bytes_sent_per_step_are_the_all_reduce_volume_and_1_5x_at_stage_3()
  for _, W in ipairs({ 2, 4 }) do
    local L = the_layout(W)
    local full = L.full_numel
    local K = #L.segments + 1
    local meta = (W - 1) * 8 * K -- loss and norm partials: all-gather of K doubles per rank
    local dp = 2 * (W - 1) / W * 4 * full -- data-parallel all-reduce of fp32 gradients
    local rs, ag = (W - 1) / W * 4 * full, (W - 1) / W * 4 * full
    -- Stage 3: each partitioned segment gathered before forward and before
    -- backward of each module that uses it (the tied embedding twice each);
    -- persistent ones gathered once after the step.
    local g3 = 0
    for _, s in ipairs(L.segments) do
      local users = s.index == 1 and 2 or 1
      g3 = g3 + (s.numel <= THRESHOLD and s.padded or 2 * users * s.padded)
    end
    g3 = (W - 1) / W * 4 * g3
    local expect = {
      [0] = { all_reduce = dp, reduce_scatter = 0, all_gather = meta },
      [1] = { all_reduce = 0, reduce_scatter = rs, all_gather = ag + meta },
      [2] = { all_reduce = 0, reduce_scatter = rs, all_gather = ag + meta },
      [3] = { all_reduce = 0, reduce_scatter = rs, all_gather = g3 + meta },
    }
    for stage = 0, 3 do
      local c = run(W, stage, "fp32", 20).recs[5].comm
      local e = expect[stage]
      local total = c.all_reduce + c.reduce_scatter + c.all_gather
      print(("    world %d stage %d: all_reduce %d, reduce_scatter %d, all_gather %d; " ..
             "%.3f x the all-reduce volume %d (+%d metadata)")
            :format(W, stage, c.all_reduce, c.reduce_scatter, c.all_gather,
                    (total - meta) / dp, dp, meta))
      for _, k in ipairs({ "all_reduce", "reduce_scatter", "all_gather" }) do
        assert(c[k] == e[k], ("world %d stage %d: %s %d bytes, expected %d")
               :format(W, stage, k, c[k], e[k]))
      end
      if stage <= 2 then assert(total - meta == dp) end
      if stage == 3 then
        local ratio = (total - meta) / dp
        assert(ratio > 1.4 and ratio < 1.8, "stage 3 about 1.5x: " .. ratio)
      end
    end
  end
end

--------------------------------------------------------------- (e) auto

function T.stage_auto_picks_0_for_a_small_model_and_refuses_a_budget_nothing_meets()
  local out, status = train(1, ("%s --data %s --steps 1 --stage auto"):format(model_flags, corpus))
  assert(status == 0, out)
  assert(out:find("stage auto: [^\n]*picked stage 0"), out)
  assert(out:find("zero stage 0,"), out)
  -- A budget the run holds is its whole memory: one the process fills
  -- before any model state (1/4 of stage 0's 16 bytes a parameter) would
  -- stop it at its first step, so it is refused before it.
  local L = the_layout(4)
  local budget = math.floor(L.numel * 16 / 4)
  out, status = train(4, ("%s --data %s --steps 1 --micro-batch 1 --stage auto --memory-budget %d")
                         :format(model_flags, corpus, budget))
  assert(status == 2 and out:find("this process holds [^\n]* already, before any model state") and
         out:find("the run would stop at its first step", 1, true) and
         not out:find("step     1", 1, true), out)
  -- One that no stage meets, with the comm buffers counted, nor NVMe beside
  -- its staging and comm buffers (a 13M-parameter model, 150 MiB): refused,
  -- naming the stage that needs the least and what shrinks those buffers.
  out, status = train(1, ("--model gpt2-nano --n-embd 512 --n-layer 4 --n-head 4 --seq-len 32 " ..
                          "--micro-batch 2 --sample 0 --data %s --steps 1 --stage auto " ..
                          "--memory-budget 150MiB --nvme-path %s"):format(corpus, tmp))
  assert(status == 2 and out:find("no stage fits (stage ", 1, true) and
         out:find("NVMe does not fit either", 1, true) and
         out:find("the run would stop at its first step over the budget it holds: raise " ..
                  "--memory-budget, add ranks, or lower zero_optimization.sub_group_size, " ..
                  "stage3_prefetch_bucket_size and reduce_bucket_size", 1, true) and
         not out:find("step     1", 1, true), out)
end

---------------------------------------------------------- (f) fp16 overflow

function T.fp16_overflow_skips_the_step_and_halves_the_scale()
  local cfg = config_file("fp16.json", {
    train_batch_size = 4, gradient_clipping = 1.0,
    fp16 = { enabled = true, initial_scale_power = 10, hysteresis = 1, loss_scale_window = 1000 },
    zero_optimization = { stage = 2 },
  })
  for _, n in ipairs({ 1, 2 }) do
    local log = tmp .. "/fp16_" .. n .. ".jsonl"
    local out, status = train(n, ("%s --data %s --config %s --steps 5 --log %s")
                                 :format(model_flags, corpus, cfg, log), "LZ_INJECT_INF_STEP=3")
    assert(status == 0, out)
    local recs = support.records(log)
    for i = 1, 5 do
      assert(recs[i].skipped == (i == 3), "only step 3 is skipped")
      local scale = i <= 3 and 1024 or 512
      assert(recs[i].loss_scale == scale,
             ("step %d: loss_scale %s, expected %d"):format(i, recs[i].loss_scale, scale))
    end
    assert(out:find("skipped (overflow), loss scale 1024, next 512", 1, true) and
           out:find("trained steps 1%-5 in .* %(1 skipped on overflow%)"), out)
    assert(recs[6].event == "end" and recs[6].skipped_steps == 1, "the end record's skipped_steps")
  end
end

-- Without fp16 no loss scale can fall: a gradient that is not finite (fp32
-- here, bf16 alike) means the run diverged. It stops with exit 2 at that
-- step, naming where its learning rate came from, the step's record
-- written (its non-finite numbers null) and no end record.
function T.a_non_finite_gradient_stops_an_fp32_run()
  local cfg = config_file("lr.json", { train_batch_size = 4, optimizer = { type = "AdamW",
                                       params = { lr = 1e-3 } } })
  for _, c in ipairs({ { "--lr 1e-3", "lower --lr (it was 0.001)" },
                       { "--config " .. cfg, "lower the learning rate (--lr, or --config " .. cfg ..
                         "'s optimizer.params.lr or the scheduler's warmup_max_lr) (it was 0.001)" } }) do
    local log = tmp .. "/diverged.jsonl"
    os.remove(log)
    local out, status = train(1, ("%s --data %s --steps 5 --log %s %s")
                                 :format(model_flags, corpus, log, c[1]), "LZ_INJECT_INF_STEP=3")
    assert(status == 2 and out:find("train: step 3: the gradient norm is inf: training diverged; " ..
                                    c[2], 1, true), out)
    local recs = support.records(log)
    assert(#recs == 3 and recs[3].diverged == true and recs[3].skipped == true and
           recs[3].grad_norm == -1, "the diverged step's record, and no end record")
  end
  -- a scheduler's warmup_max_lr is the peak where --lr is not given: named
  local sched = config_file("sched.json", { train_batch_size = 4, scheduler = { type = "WarmupLR",
                            params = { warmup_max_lr = 2e-3, warmup_num_steps = 2 } } })
  local out, status = train(1, ("%s --data %s --steps 5 --config %s")
                               :format(model_flags, corpus, sched), "LZ_INJECT_INF_STEP=3")
  assert(status == 2 and out:find("lower --lr, or --config " .. sched .. "'s scheduler.params." ..
                                  "warmup_max_lr (it was 0.002)", 1, true), out)
  -- at a fresh run's first step, before any update: the weights or the data
  out, status = train(1, ("%s --data %s --steps 5"):format(model_flags, corpus),
                      "LZ_INJECT_INF_STEP=1")
  assert(status == 2 and out:find("train: step 1: the gradient norm is inf before any update: " ..
                                  "the weights drawn from --seed and this data give non-finite " ..
                                  "gradients", 1, true), out)
end

-- The scale's steps as DeepSpeed's DynamicLossScaler.update_scale (the
-- scaler of ZeRO stages 1-3) takes them: it doubles when
-- (cur_iter - last_overflow_iter) % scale_window == 0, after window clean
-- steps; consecutive_hysteresis refills the hysteresis on every step
-- without overflow.
function T.fp16_scale_doubles_and_absorbs_as_deepspeeds_scaler()
  local Scaler = require("luazero.zero.scaler")
  local s = Scaler.new({ initial_scale_power = 16, loss_scale_window = 3, hysteresis = 1 })
  local seen = {}
  for step = 1, 10 do
    seen[step] = s.scale
    s:update(step == 5)
  end
  support.eq(table.concat(seen, " "), "65536 65536 65536 131072 131072 65536 65536 65536 131072 " ..
             "131072", "the scale used at steps 1-10, an overflow at step 5")
  for _, c in ipairs({ { false, "4 4 2 2" }, { true, "4 4 4 4" } }) do
    local h = Scaler.new({ initial_scale_power = 2, loss_scale_window = 100, hysteresis = 2,
                           consecutive_hysteresis = c[1] })
    local scales = {}
    for i, overflow in ipairs({ true, false, true, false }) do
      h:update(overflow)
      scales[i] = h.scale
    end
    support.eq(table.concat(scales, " "), c[2], "consecutive_hysteresis " .. tostring(c[1]))
  end
end

-- An overflow at the minimum scale stops the run, as DeepSpeed's
-- raise_error_at_min_scale: every rank, with the error named, no hang.
function T.fp16_overflow_at_the_minimum_scale_stops_the_run()
  local Scaler = require("luazero.zero.scaler")
  local s = Scaler.new({ initial_scale_power = 2, min_loss_scale = 2, hysteresis = 2 })
  s:update(true) -- absorbed by the hysteresis
  s:update(true) -- halves to the minimum
  assert(s.scale == 2, s.scale)
  local ok, err = pcall(s.update, s, true)
  assert(not ok and tostring(err):find("minimum loss scale (2, fp16.min_loss_scale)", 1, true),
         tostring(err))
  -- A start below the minimum is raised to it, as DeepSpeed's max(scale / 2, min).
  local low = Scaler.new({ initial_scale_power = 0, min_loss_scale = 4, hysteresis = 1 })
  low:update(true)
  assert(low.scale == 4, low.scale)
  -- A resume takes back where a dynamic scaler stood, never the config: a
  -- static run's state leaves a dynamic config's scaler as it starts.
  local dyn = Scaler.new({ initial_scale_power = 4, loss_scale_window = 2 })
  dyn:restore(Scaler.new({ loss_scale = 128 }):state())
  assert(dyn.dynamic and dyn.scale == 16 and dyn.window == 2, "static state taken")
  local saved = Scaler.new({ initial_scale_power = 8, loss_scale_window = 5, hysteresis = 3 })
  saved:update(false)
  dyn:restore(saved:state())
  assert(dyn.scale == 256 and dyn.iter == 1 and dyn.window == 2 and dyn.delayed_shift == 2,
         "the state, not the config")
  local cfg = config_file("fp16_min.json", {
    train_batch_size = 4,
    fp16 = { enabled = true, initial_scale_power = 10, hysteresis = 1, min_loss_scale = 1024 },
    zero_optimization = { stage = 2 },
  })
  local out, status = train(2, ("%s --data %s --config %s --steps 5"):format(model_flags, corpus,
                                                                             cfg),
                            "LZ_INJECT_INF_STEP=3")
  assert(status ~= 0 and out:find("overflowed at the minimum loss scale (1024", 1, true) and
         out:find("step     2", 1, true) and not out:find("step     4", 1, true), out)
end

----------------------------------------------------- (g) config errors

local function expect_config_error(n, flags, needle)
  local out, status = train(n, model_flags .. " --data " .. corpus .. " --steps 1 " .. flags)
  assert(status ~= 0, "expected a failure for " .. flags .. ":\n" .. out)
  local line
  for l in out:gmatch("[^\n]+") do
    if l:find("^train: ") then
      assert(not line, "one error line, got:\n" .. out)
      line = l
    end
  end
  assert(line and line:find(needle, 1, true), ("%q does not name %q"):format(out, needle))
  assert(not out:find("traceback", 1, true), out)
end

function T.bad_configuration_is_one_line_naming_the_key_or_file()
  expect_config_error(1, "--config " .. config_file("s4.json", {
    train_batch_size = 4, zero_optimization = { stage = 4 } }), "zero_optimization.stage")
  expect_config_error(1, "--config " .. config_file("both.json", {
    train_batch_size = 4, fp16 = { enabled = true }, bf16 = { enabled = true } }), "fp16")
  expect_config_error(1, "--config " .. config_file("bucket.json", {
    train_batch_size = 4, zero_optimization = { reduce_bucket_size = -1 } }),
    "zero_optimization.reduce_bucket_size")
  local bad = write_file("bad.json", "{ \"train_batch_size\": 4,")
  expect_config_error(1, "--config " .. bad, bad)
  expect_config_error(1, "--config " .. tmp .. "/absent.json", "absent.json")
  expect_config_error(2, "--config " .. config_file("batch.json", {
    train_batch_size = 5, train_micro_batch_size_per_gpu = 1,
    gradient_accumulation_steps = 1 }), "train_batch_size")
  expect_config_error(1, "--stage 5", "--stage")
end

return T
