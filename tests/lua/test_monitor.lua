-- test_monitor.lua — what a run reports about itself (luazero.monitor):
-- csv_monitor's files equal the --log records (DeepSpeed's layout, rank 0
-- only), the TensorBoard framing (CRC-32C, records read back), wandb refused
-- naming the offline monitors, wall_clock_breakdown's phases (each > 0, their
-- sum at most the step), and flops_profiler's totals (the model's parameters,
-- the analytic 6N + attention FLOPs bench/bench_train.lua uses).
-- tests/ref/test_tensorboard.py reads the event files with TensorBoard.
local ffi = require("ffi")
local cjson = require("cjson")
local lz = require("luazero")
local config = require("luazero.config")
local monitor = require("luazero.monitor")
local support = dofile(lz.root .. "/tests/lua/support.lua")

local T = {}
local q, eq = support.quote, support.eq
local write_file, tmp, corpus = support.scratch_corpus(
  "Because I could not stop for Death, He kindly stopped for me; ", 60)
local train, ok_train = support.trainer("--model gpt2-nano --n-layer 1 --n-embd 32 --n-head 2 " ..
                                        "--context 32 --sample 0 --eval-batches 1 --data " ..
                                        q(corpus))

local function config_file(name, t)
  return write_file(name .. ".json", cjson.encode(t))
end

local function lines_of(path)
  local out = {}
  for l in io.lines(path) do out[#out + 1] = l end
  return out
end

function T.csv_monitor_files_match_the_log()
  local out_dir = tmp .. "/csv"
  local cfg = config_file("csv", {
    train_micro_batch_size_per_gpu = 2, gradient_accumulation_steps = 2,
    wall_clock_breakdown = true, zero_optimization = { stage = 2 },
    csv_monitor = { enabled = true, output_path = out_dir, job_name = "run1" } })
  local log = tmp .. "/csv.jsonl"
  ok_train(2, ("--steps 4 --eval-every 2 --config %s --log %s"):format(q(cfg), q(log)))
  local recs = {}
  for _, r in ipairs(support.records(log)) do if r.step then recs[#recs + 1] = r end end
  eq(#recs, 4, "records")
  local batch = 2 * 2 * 2 -- micro x accum x ranks: the x axis counts samples
  local seen = 0
  for _, tag in ipairs(monitor.tags) do
    local want = {}
    for _, r in ipairs(recs) do
      local v = tag[2](r)
      if v then want[#want + 1] = { r.step * batch, v } end
    end
    local path = out_dir .. "/run1/" .. tag[1]:gsub("/", "_") .. ".csv"
    assert(support.exists(path), path .. " is missing")
    local rows = lines_of(path)
    eq(rows[1], "step," .. tag[1]:match("[^/]+$"), path .. " header")
    -- one row per step: rank 1 wrote nothing
    eq(#rows - 1, #want, path .. " rows")
    for i, w in ipairs(want) do
      local s, v = rows[i + 1]:match("^(%d+),(.+)$")
      eq(tonumber(s), w[1], path .. " step")
      -- the log holds 14 significant digits, the CSV the value exactly
      assert(math.abs(tonumber(v) - w[2]) <= 1e-12 * math.max(1, math.abs(w[2])),
             ("%s row %d: %s, the log has %.17g"):format(path, i, v, w[2]))
    end
    seen = seen + 1
  end
  eq(seen, #monitor.tags, "tags")
  eq(#lines_of(out_dir .. "/run1/Train_Samples_val_loss.csv"), 3, "val_loss rows (steps 2, 4)")
end

-- A resume from an earlier step into the same files keeps each step once:
-- the rows of the steps trained again are dropped first (they were there
-- twice, 12 and 16 after 12 and 16).
function T.csv_rows_after_a_resume_hold_each_step_once()
  local out_dir = tmp .. "/csv-resumed"
  local cfg = config_file("csv-resumed", { train_micro_batch_size_per_gpu = 2,
    csv_monitor = { enabled = true, output_path = out_dir, job_name = "j" } })
  local ck = tmp .. "/csv-ck"
  ok_train(1, ("--steps 4 --config %s --save %s --save-every 2"):format(q(cfg), q(ck)))
  ok_train(1, ("--steps 4 --config %s --resume %s"):format(q(cfg), q(ck .. "/step-000002")))
  local rows = lines_of(out_dir .. "/j/Train_Samples_train_loss.csv")
  local steps = {}
  for i = 2, #rows do steps[#steps + 1] = rows[i]:match("^(%d+),") end
  eq(table.concat(steps, ","), "2,4,6,8", "the x of each step, once")
end

-- A resume at another micro-batch into the same --log and CSV files: the
-- log keeps steps 1-2, drops 3-4 (trained again) and the end record, then
-- holds a resume record and steps 3-4 again; tokens and samples count on
-- from the checkpoint's (before: the log was emptied, tokens were step x the
-- new batch, and the CSV kept the dropped steps at the new batch's x).
function T.a_resume_at_another_batch_keeps_the_history_and_counts_on()
  local out_dir = tmp .. "/csv-batch"
  local function cfg(B)
    return config_file("csv-batch-" .. B, { train_micro_batch_size_per_gpu = B,
      csv_monitor = { enabled = true, output_path = out_dir, job_name = "j" } })
  end
  local ck, log = tmp .. "/batch-ck", tmp .. "/batch.jsonl"
  ok_train(1, ("--steps 4 --seq-len 16 --config %s --save %s --save-every 2 --log %s")
              :format(q(cfg(2)), q(ck), q(log)))
  local out = ok_train(1, ("--steps 4 --seq-len 16 --config %s --resume %s --log %s")
                          :format(q(cfg(4)), q(ck .. "/step-000002"), q(log)))
  assert(out:find("resume: 64 tokens a step (batch 4 x 16, micro-batches 1, ranks 1); the " ..
                  "saved run trained 64 tokens in 2 steps (32 a step)", 1, true), out)
  local got = {}
  for _, r in ipairs(support.records(log)) do
    got[#got + 1] = r.step and ("%d:%d:%d"):format(r.step, r.tokens, r.samples) or r.event
  end
  eq(table.concat(got, " "), "1:32:2 2:64:4 resume 3:128:8 4:192:12 end", "the log")
  local rows = lines_of(out_dir .. "/j/Train_Samples_train_loss.csv")
  local xs = {}
  for i = 2, #rows do xs[#xs + 1] = rows[i]:match("^(%d+),") end
  eq(table.concat(xs, ","), "2,4,8,12", "the CSV's x of each step, once")
end

-- The framing of every record, read back here (TensorBoard reads it in
-- tests/ref/test_tensorboard.py).
function T.tensorboard_records_read_back()
  local tb = monitor.tensorboard
  eq(("%08x"):format(tb.crc32c("123456789")), "e3069283", "CRC-32C check value")
  eq(("%08x"):format(tb.crc32c("")), "00000000", "CRC-32C of nothing")
  local dir = tmp .. "/tb"
  assert(lz.mkdir(dir))
  local w = assert(tb.open(dir, 1700000000.5))
  local scalars = { { "Train/Samples/lr", 0.25 }, { "Train/Samples/train_loss", 3.5 } }
  assert(w:scalars(8, scalars, 1700000001))
  w:close()
  local f = assert(io.open(w.path, "rb"))
  local raw = f:read("*a")
  f:close()
  assert(w.path:match("/events%.out%.tfevents%.1700000000%."), w.path)
  local pos, events = 1, {}
  while pos <= #raw do
    local n = ffi.cast("const uint64_t *", ffi.cast("const char *", raw) + pos - 1)[0]
    n = tonumber(n)
    local head, data = raw:sub(pos, pos + 7), raw:sub(pos + 12, pos + 11 + n)
    local function crc_at(p) return tonumber(ffi.cast("const uint32_t *",
                                              ffi.cast("const char *", raw) + p - 1)[0]) end
    eq(crc_at(pos + 8), tb.masked_crc(head), "length CRC")
    eq(crc_at(pos + 12 + n), tb.masked_crc(data), "data CRC")
    events[#events + 1] = data
    pos = pos + 16 + n
  end
  eq(#events, 2, "events")
  assert(events[1]:find("brain.Event:2", 1, true), "file_version first")
  assert(events[2]:find("Train/Samples/lr", 1, true) and events[2]:find("\21\0\0\128\62", 1, true),
         "the lr tag and 0.25 as a float")
  eq(events[2], tb.event(1700000001, 8, { scalars = scalars }), "the step's event")
end

function T.wandb_is_refused_naming_the_offline_monitors()
  support.expect_error(function()
    config.load({ train_batch_size = 2, wandb = { enabled = true, project = "p" } }, 1)
  end, "config: wandb.enabled: luazero does not send metrics to Weights & Biases; record them " ..
       "offline with tensorboard, csv_monitor or --log FILE (JSON Lines)")
  local cfg = config.load({ train_batch_size = 2, wandb = { enabled = false, project = "p" },
                            tensorboard = { enabled = true } }, 1)
  eq(#cfg.unimplemented, 0, "nothing reported")
  eq(monitor.folder(cfg.monitor.tensorboard), "DeepSpeedJobName", "DeepSpeed's job_name default")
  support.expect_error(function()
    config.load({ train_batch_size = 2, csv_monitor = { enabled = "yes" } }, 1)
  end, 'config: csv_monitor.enabled must be true or false (got "yes")')
  -- A folder that cannot be made: one line at start, naming the key.
  local blocker = write_file("blocker", "x")
  local cfgf = config_file("badtb", { train_micro_batch_size_per_gpu = 2,
    tensorboard = { enabled = true, output_path = blocker, job_name = "j" } })
  local out, st = train(1, ("--steps 1 --config %s"):format(q(cfgf)))
  assert(st == 2, out)
  assert(out:find("train: tensorboard: cannot make the folder " .. blocker .. "/j", 1, true), out)
  assert(out:find("point tensorboard.output_path at a writable folder", 1, true), out)
end

-- A full disk (a CSV that is /dev/full): the run stops at that step with exit
-- status 1 and one line naming the file, the step and the reason.
function T.a_failed_write_stops_the_run_naming_the_file()
  local dir = tmp .. "/full"
  assert(lz.mkdir(dir .. "/j"))
  local file = dir .. "/j/Train_Samples_train_loss.csv"
  assert(os.execute(("ln -s /dev/full %s"):format(q(file))) == 0)
  local cfgf = config_file("full", { train_micro_batch_size_per_gpu = 2,
    csv_monitor = { enabled = true, output_path = dir, job_name = "j" } })
  local out, st = train(1, ("--steps 2 --config %s"):format(q(cfgf)))
  eq(st, 1, "exit status:\n" .. out)
  assert(out:find(("train: csv_monitor: writing step 1 failed (%s: No space left on device); " ..
                   "free space there or turn csv_monitor off"):format(file), 1, true), out)
end

function T.wall_clock_breakdown_parts_are_positive_and_within_the_step()
  for _, stage in ipairs({ 0, 3 }) do
    local cfg = config_file("wcb" .. stage, { train_micro_batch_size_per_gpu = 2,
      gradient_accumulation_steps = 2, wall_clock_breakdown = true,
      zero_optimization = { stage = stage } })
    local log = ("%s/wcb%d.jsonl"):format(tmp, stage)
    local out = ok_train(1, ("--steps 3 --eval-every 1 --config %s --log %s")
                            :format(q(cfg), q(log)))
    assert(out:find("| forward %d+ backward %d+ reduce %d+ step %d+ gather %d+ ms"), out)
    for _, r in ipairs(support.records(log)) do
      if r.step then
        local sum = 0
        for _, p in ipairs(monitor.breakdown.phases) do
          local v = r.time[p]
          assert(type(v) == "number" and v > 0, ("stage %d step %d: %s %s"):format(stage, r.step, p,
                                                                                 tostring(v)))
          sum = sum + v
        end
        assert(sum <= r.step_ms, ("stage %d step %d: phases %.3f ms > step %.3f ms")
                                 :format(stage, r.step, sum, r.step_ms))
      end
    end
  end
  -- Stage 3 on 2 ranks: the gathers the module hooks make count as gather,
  -- as --profile counts them (before, they went to forward and backward and
  -- gather showed a few percent of them).
  local cfg3 = config_file("wcb-st3", { train_micro_batch_size_per_gpu = 4,
    wall_clock_breakdown = true, zero_optimization = { stage = 3, overlap_comm = false } })
  local _, ok_wide = support.trainer("--model gpt2-nano --n-layer 4 --n-embd 256 --n-head 4 " ..
                                     "--context 128 --sample 0 --eval-batches 1 --data " ..
                                     q(corpus))
  local out = ok_wide(2, ("--steps 4 --seq-len 128 --config %s --profile"):format(q(cfg3)))
  local gather = tonumber(out:match("step +4/4 |.- gather (%d+) ms"))
  local prof = tonumber(out:match("\nparameter gather +[%d.]+ +([%d.]+)")) +
               tonumber(out:match("\nparameter gather %(after the step%) +[%d.]+ +([%d.]+)"))
  assert(gather and gather >= 0.6 * prof, ("breakdown gather %s ms, profile %.2f ms\n%s")
                                             :format(tostring(gather), prof, out))
  -- Without the key: no "time" in the log.
  local log = tmp .. "/plain.jsonl"
  ok_train(1, ("--steps 1 --log %s"):format(q(log)))
  assert(support.records(log)[1].time == nil, "time logged without wall_clock_breakdown")
end

-- The profile of one step of `name` at B x T, in process.
local function profile_of(name, B, T_)
  local models = require("models.registry")
  local zero = require("luazero.zero")
  local mcfg = models.config(name, {})
  local model = models.new(mcfg)
  local cfg = config.load({ train_micro_batch_size_per_gpu = B,
                            flops_profiler = { enabled = true, profile_step = 1 } }, 1)
  local engine = zero.initialize({ model = model, config = cfg, seed = 1, batch = { B, T_ } })
  local mon = monitor.start({ engine = engine, model = model, cfg = cfg, rank = 1, B = B, T = T_ })
  local rng = require("luazero.rng")
  local batches = require("luazero.data.random").new(B, T_, mcfg.vocab, rng.new(1))
  mon:before_step(1)
  engine:train_batch(batches)
  mon:after_step({ step = 1, step_ms = 100 })
  local n = model:count_params()
  engine:free()
  batches:free()
  return assert(mon.profile, "no profile at profile_step"), n, mcfg, cfg
end

function T.flops_profiler_totals_are_the_models()
  local B, T_ = 2, 64
  local p, n, mcfg, cfg = profile_of("gpt2-nano", B, T_)
  eq(p.root.params, n, "profiled parameters")
  -- bench/bench_train.lua's FLOPs per token: forward and backward.
  local per_token = 6 * (n - mcfg.context * mcfg.n_embd) + 12 * mcfg.n_layer * mcfg.n_embd * T_
  eq(3 * p.root.flops, per_token * B * T_, "fwd+bwd FLOPs of one micro-batch")
  -- Llama: the token table is a lookup, the head a Linear of its own.
  local lp, ln, lcfg = profile_of("llama-tiny", B, 32)
  eq(lp.root.params, ln, "llama-tiny's parameters")
  local width = lcfg.n_head * (lcfg.head_dim or lcfg.n_embd / lcfg.n_head)
  eq(3 * lp.root.flops, (6 * (ln - lcfg.vocab * lcfg.n_embd) + 12 * lcfg.n_layer * width * 32) *
                        B * 32, "llama-tiny's fwd+bwd FLOPs")
  -- every module the model runs was timed; a container's time holds its children's
  local function check(node)
    assert(node.seconds > 0, node.name .. " has no time")
    local sum = 0
    for _, c in ipairs(node.children) do check(c); sum = sum + c.seconds end
    assert(node.seconds >= sum * (1 - 1e-9), node.name .. ": less time than its children")
  end
  check(p.root)
  local text = monitor.flops.report(p, cfg.flops_profiler)
  assert(text:find("fwd FLOPs per micro%-batch") and text:find("detailed profile") and
         text:find("attn %(CausalSelfAttention%)"), text)
  -- Through train.lua, into output_file at profile_step.
  local out_file = tmp .. "/flops.txt"
  local cfgf = config_file("flops", { train_micro_batch_size_per_gpu = 2,
    flops_profiler = { enabled = true, profile_step = 2, module_depth = 2, detailed = false,
                       output_file = out_file } })
  local out = ok_train(2, ("--steps 3 --config %s"):format(q(cfgf)))
  assert(out:find("flops profile of step 2 written to " .. out_file, 1, true), out)
  local f = assert(io.open(out_file))
  local report = f:read("*a")
  f:close()
  assert(report:find("profile at step 2", 1, true) and not report:find("detailed profile", 1, true)
         and report:find("depth 2:", 1, true) and not report:find("depth 3:", 1, true), report)
end

-- Refused before step 1: an output_file that cannot be written (it failed
-- at profile_step, after the steps before it), and a profile_step the run
-- resumed past (it profiled nothing, silently).
function T.flops_profiler_settings_that_would_fail_late_are_refused_first()
  local bad = config_file("flops-nodir", { train_micro_batch_size_per_gpu = 2,
    flops_profiler = { enabled = true, profile_step = 2, output_file = tmp .. "/no/dir/f.txt" } })
  local out, st = train(1, ("--steps 3 --config %s"):format(q(bad)))
  assert(st == 2 and out:find("flops_profiler.output_file: cannot write " .. tmp ..
                              "/no/dir/f.txt", 1, true) and not out:find("step +1/"), out)
  local ck = tmp .. "/flops-ck"
  ok_train(1, "--steps 2 --save " .. q(ck))
  local early = config_file("flops-early", { train_micro_batch_size_per_gpu = 2,
    flops_profiler = { enabled = true, profile_step = 1 } })
  out, st = train(1, ("--steps 4 --config %s --resume %s"):format(q(early), q(ck)))
  assert(st == 2 and out:find("config: flops_profiler.profile_step 1 is before this run's " ..
                              "first step 3 (it resumes after step 2)", 1, true), out)
end

return T
