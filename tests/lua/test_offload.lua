-- test_offload.lua — the offload tiers end to end (scripts/train.lua under
-- the launcher): optimizer states in host memory and on NVMe, the stage-3
-- parameter shard on NVMe, each ending with the params_checksum of the same
-- run without offload, at world sizes 1 and 2; the swap files vanish; the
-- step reports the bytes it moved; bad offload settings name their key.
local cjson = require("cjson")
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")

local T = {}
local root = lz.root
local q = support.quote
local write_file, tmp = support.scratch()

local text = ("Now is the winter of our discontent\nMade glorious summer by this sun of York;\n")
             :rep(60)
local corpus = write_file("corpus.txt", text)
local swap_dir = tmp .. "/nvme"
os.execute("mkdir -p " .. q(swap_dir))

local model_flags = "--model gpt2-nano --n-layer 2 --n-embd 64 --n-head 4 --context 32 " ..
                    "--seq-len 16 --sample 0 --eval-batches 1 --seed 11"

-- A config: stage, and offload blocks. sub_group_size 4096 cuts the
-- optimizer states of the tiny model into several sub-groups.
local function config(stage, opt, param, extra)
  local z = { stage = stage, stage3_param_persistence_threshold = 128, overlap_comm = true,
              reduce_bucket_size = 20000, stage3_prefetch_bucket_size = 20000,
              sub_group_size = 4096 }
  if opt then z.offload_optimizer = opt end
  if param then z.offload_param = param end
  local t = { train_batch_size = 4, gradient_clipping = 1.0,
              optimizer = { type = "AdamW", params = { lr = 3e-3, weight_decay = 0.1 } },
              zero_optimization = z, aio = { block_size = 8192, queue_depth = 4 } }
  for k, v in pairs(extra or {}) do t[k] = v end
  return t
end

local count = 0
local function train(n, cfg, dtype, steps)
  count = count + 1
  local cfg_path = write_file(("cfg%d.json"):format(count), cjson.encode(cfg))
  local log = ("%s/run%d.jsonl"):format(tmp, count)
  local cmd = ("cd %s && %s %s scripts/train.lua %s --data %s --config %s --dtype %s " ..
               "--steps %d --log %s 2>&1; echo \"EXIT:$?\"")
              :format(q(root), q(lz.executable()), n > 1 and ("-n " .. n) or "", model_flags,
                      q(corpus), q(cfg_path), dtype, steps, q(log))
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  local status = tonumber(out:match("EXIT:(%d+)%s*$"))
  out = out:gsub("EXIT:%d+%s*$", "")
  local recs = {}
  if status == 0 then
    recs = support.records(log)
  end
  return { out = out, status = status, recs = recs,
           checksum = recs[#recs] and recs[#recs].params_checksum }
end

local function must(r, what)
  assert(r.status == 0, what .. " failed:\n" .. r.out)
  return r
end

local function leftovers()
  local p = io.popen("ls -A " .. q(swap_dir))
  local s = p:read("*a")
  p:close()
  return s
end

local nvme = { device = "nvme", nvme_path = swap_dir }

function T.offloaded_runs_end_with_the_checksum_of_the_run_without()
  local cases = {
    { "optimizer cpu", 1, config(1, { device = "cpu" }) },
    { "optimizer nvme", 1, config(2, nvme) },
    { "optimizer nvme, pipelined, 2 buffers", 2,
      config(2, { device = "nvme", nvme_path = swap_dir, pipeline_read = true,
                  pipeline_write = true, buffer_count = 2 }) },
    { "param nvme + optimizer nvme", 3,
      config(3, { device = "nvme", nvme_path = swap_dir, pipeline_read = true,
                  pipeline_write = true }, nvme) },
    { "param nvme + optimizer cpu", 3, config(3, { device = "cpu" }, nvme) },
    { "param cpu", 3, config(3, nil, { device = "cpu" }) },
  }
  for _, n in ipairs({ 1, 2 }) do
    for _, dtype in ipairs(n == 1 and { "fp32", "bf16" } or { "bf16" }) do
      local want = {}
      for _, c in ipairs(cases) do
        local stage = c[2]
        want[stage] = want[stage] or must(train(n, config(stage), dtype, 6),
                                          ("world %d stage %d %s"):format(n, stage, dtype)).checksum
        local r = must(train(n, c[3], dtype, 6), ("world %d %s %s"):format(n, c[1], dtype))
        assert(r.checksum == want[stage],
               ("world %d %s %s: checksum %s != %s without offload"):format(n, c[1], dtype,
                                                                           r.checksum, want[stage]))
        assert(leftovers() == "", "swap files left behind: " .. leftovers())
      end
      print(("    world %d %s: %d offload settings match stages 1-3"):format(n, dtype, #cases))
    end
  end
end

function T.the_step_reports_bytes_moved_to_and_from_nvme()
  local r = must(train(1, config(3, nvme, nvme), "bf16", 3), "nvme run")
  local last = r.recs[#r.recs - 1] -- the last step (the final record is the end event)
  assert(last.nvme_read and last.nvme_written, "no nvme byte counts in the log")
  -- Per step: every state sub-group read and written once (master, m, v:
  -- 12 bytes per element, padded to whole sub-groups of 4096), plus the
  -- working copy written and the parameter slices read for the gathers.
  assert(last.nvme_written >= 12 * 4096, "written " .. last.nvme_written)
  assert(last.nvme_read >= 12 * 4096, "read " .. last.nvme_read)
  print(("    per step: %d bytes read, %d written"):format(last.nvme_read, last.nvme_written))
end

-- With the optimizer states on NVMe (stage 2 and 3) the reduced gradients
-- go to a file of their own sub-group by sub-group and come back with the
-- states: no gradient buffer in memory (ledger grads 0), the same bits as
-- the run without offload, through gradient accumulation (sub-groups read
-- back and added into) and half gradients, and the file is written each step.
function T.gradients_spill_to_nvme_and_end_bitwise()
  local layout = require("luazero.zero.layout")
  local gpt2 = require("models.gpt2")
  local m = gpt2.new(gpt2.config("gpt2-nano", { n_layer = 2, n_embd = 64, n_head = 4, context = 32 }))
  local cases = {
    { 1, 2, "fp32", {} },
    { 1, 3, "bf16", { gradient_accumulation_steps = 2, train_batch_size = 8 } },
    { 1, 2, "bf16", { gradient_accumulation_steps = 3, train_batch_size = 12,
                      data_types = { grad_accum_dtype = "bf16" } } },
    { 2, 3, "bf16", { gradient_accumulation_steps = 2, train_batch_size = 16 } },
  }
  for _, c in ipairs(cases) do
    local n, stage, dtype, extra = c[1], c[2], c[3], c[4]
    local what = ("world %d stage %d %s accumulation %d%s"):format(n, stage, dtype,
      extra.gradient_accumulation_steps or 1, extra.data_types and " bf16 gradients" or "")
    local want = must(train(n, config(stage, nil, nil, extra), dtype, 4), what).checksum
    local r = must(train(n, config(stage, nvme, nil, extra), dtype, 4), what .. " nvme")
    assert(r.checksum == want, ("%s: checksum %s with gradients on nvme, %s without")
                               :format(what, r.checksum, want))
    local last = r.recs[#r.recs - 1]
    assert(last.mem.grads == 0, what .. ": gradients in memory: " .. last.mem.grads)
    -- Each step writes the gradient file once per micro-step and the states
    -- once (m and v; and a master of its own beside bf16 parameters).
    local shard = layout.new(m.param_table, n).shard_numel
    local accum = extra.gradient_accumulation_steps or 1
    local states = dtype == "fp32" and 8 or 12
    assert(last.nvme_written >= (states + 4 * accum) * shard,
           what .. ": written " .. last.nvme_written)
    assert(leftovers() == "", "swap files left behind: " .. leftovers())
    print(("    %s: %s, %d bytes written per step"):format(what, r.checksum, last.nvme_written))
  end
end

-- Start-up streams the drawn weights into the shards and swap files: the
-- workspace it needs is a segment or two (and a chunk of draws), never a
-- buffer the size of the model, and the weights are the stage-0 run's.
function T.start_up_streams_weights_into_nvme_without_a_model_sized_buffer()
  local zero = require("luazero.zero")
  local gpt2 = require("models.gpt2")
  local layout = require("luazero.zero.layout")
  local dims = { n_layer = 8, n_embd = 256, n_head = 4, context = 32 }
  local function engine_for(z)
    local model = gpt2.new(gpt2.config("gpt2-nano", dims))
    local cfg = { train_micro_batch_size_per_gpu = 1, bf16 = { enabled = true },
                  zero_optimization = z }
    return zero.initialize{ model = model, config = cfg, seed = 3, batch = { 1, 16 } }, model
  end
  local plain = engine_for({ stage = 0 })
  local want = plain:params_checksum()
  plain:free()
  support.settle()
  lz.mem_reset_peak()
  local before = lz.mem()
  local engine, model = engine_for({ stage = 3, sub_group_size = 65536,
                                     stage3_param_persistence_threshold = 1024,
                                     offload_optimizer = nvme, offload_param = nvme })
  local peak = lz.mem_peak().workspace - before.workspace
  local L = layout.new(model.param_table, 1)
  local largest = 0
  for _, seg in ipairs(L.segments) do largest = math.max(largest, seg.padded) end
  print(("    workspace peak %d bytes at start-up; fp32 model %d bytes, largest segment %d")
        :format(peak, 4 * L.full_numel, 4 * largest))
  -- (a chunk of draws, the segment being drawn, the ones a sub-group still reads)
  assert(peak <= 5 * 4 * largest, ("start-up workspace peak %d bytes, more than 5 segments (%d)")
                                  :format(peak, 5 * 4 * largest))
  assert(peak < 4 * L.full_numel / 4)
  assert(engine:params_checksum() == want, "streamed start-up drew other weights")
  engine:free()
  assert(leftovers() == "", "swap files left behind: " .. leftovers())
end

-- A model whose optimizer states (12 bytes per parameter: fp32 master, m,
-- v) are larger than the memory budget trains through the NVMe tier; the
-- budget holds by the ledger and by peak RSS. Without offload the same
-- budget stops the run with an error naming it.
function T.a_budget_smaller_than_the_optimizer_states_holds_through_nvme()
  local gpt2 = require("models.gpt2")
  local layout = require("luazero.zero.layout")
  local dims = { n_layer = 4, n_embd = 1024, n_head = 16, context = 64 }
  local m = gpt2.new(gpt2.config("gpt2-nano", dims))
  local states = 12 * layout.new(m.param_table, 1).shard_numel
  local budget = math.floor(0.85 * states)
  local flags = ("--model gpt2-nano --n-layer 4 --n-embd 1024 --n-head 16 --context 64 " ..
                 "--seq-len 64 --sample 0 --eval-batches 0 --memory-budget %d"):format(budget)
  local function run(opt)
    local cfg = { train_batch_size = 1, bf16 = { enabled = true },
                  data_types = { grad_accum_dtype = "bf16" },
                  zero_optimization = { stage = 2, sub_group_size = 1000000,
                                        reduce_bucket_size = 1000000, offload_optimizer = opt } }
    count = count + 1
    local cfg_path = write_file(("budget%d.json"):format(count), cjson.encode(cfg))
    local log = ("%s/budget%d.jsonl"):format(tmp, count)
    local p = io.popen(("cd %s && %s scripts/train.lua %s --data %s --config %s --steps 2 " ..
                        "--log %s 2>&1; echo \"EXIT:$?\""):format(q(root), q(lz.executable()),
                       flags, q(corpus), q(cfg_path), q(log)))
    local out = p:read("*a")
    p:close()
    local recs = {}
    local f = io.open(log)
    if f then
      for l in f:lines() do recs[#recs + 1] = cjson.decode(l) end
      f:close()
    end
    return out, tonumber(out:match("EXIT:(%d+)%s*$")), recs
  end
  local out, status, recs = run({ device = "nvme", nvme_path = swap_dir, pipeline_read = true,
                                  pipeline_write = true, buffer_count = 3 })
  assert(status == 0, out)
  local mem = recs[2].mem
  local ledger = mem.peak_ledger
  print(("    optimizer states %.0f MiB, budget %.0f MiB: peak RSS %.0f MiB, ledger %.0f MiB " ..
         "(optimizer %d, offload staging %.0f MiB), %.0f MiB read and %.0f MiB written per step")
        :format(states / 2 ^ 20, budget / 2 ^ 20, mem.peak_rss / 2 ^ 20, ledger / 2 ^ 20,
                mem.optimizer, mem.offload / 2 ^ 20, recs[2].nvme_read / 2 ^ 20,
                recs[2].nvme_written / 2 ^ 20))
  assert(mem.peak_rss <= budget and ledger <= budget)
  assert(mem.optimizer == 0)
  assert(recs[2].nvme_read >= states and recs[2].nvme_written >= states)
  assert(leftovers() == "", "swap files left behind: " .. leftovers())
  -- The same budget without offload: refused before step 1, naming the
  -- budget and the offload.
  out, status = run(nil)
  assert(status == 2, "a run without offload held a budget below its optimizer states")
  assert(out:find("MiB (--memory-budget): the run would stop at its first step",
                  1, true) and out:find("offload the optimizer states", 1, true) and
         not out:find("step +1/", 1), out)
end

-- A swap file the disk has no room for: the error gives what this
-- configuration's swap files take a rank, part by part (the sizes the
-- engine's files really have), beside the disk's free space.
function T.a_full_disk_names_what_the_swap_files_take()
  local models, zero = require("models.registry"), require("luazero.zero")
  local live = require("luazero.estimate.live")
  lz.mkdir(swap_dir)
  local cfg = models.config("gpt2-nano", { n_layer = 1, n_embd = 32, n_head = 2, context = 16 })
  local e = zero.initialize{ model = models.new(cfg), batch = { 2, 16 }, config = {
    train_micro_batch_size_per_gpu = 2, zero_optimization = { stage = 3,
      offload_optimizer = { device = "nvme", nvme_path = swap_dir },
      offload_param = { device = "nvme", nvme_path = swap_dir } } } }
  local c_err = ("swap: %s/luazero-swap-1-0-params: cannot preallocate 4096 bytes: No space " ..
                 "left on device (free space in %s or point nvme_path at a larger disk)")
                :format(swap_dir, swap_dir)
  local msg = live.allocation_error(e, nil, c_err)
  local est = e:estimate()
  local total = require("luazero.estimate").format_bytes(est.live.nvme)
  assert(msg:find("No space left on device; this configuration's swap files take " .. total ..
                  " a rank (gradients ", 1, true) and msg:find(", optimizer ", 1, true) and
         msg:find(", params ", 1, true), msg)
  assert(msg:find(", and " .. swap_dir .. " has ", 1, true) and
         msg:find(" free: free that much there for each rank on this machine, or point " ..
                  "nvme_path at a larger disk", 1, true), msg)
  assert(live.allocation_error(e, nil, "something else") == nil)
  e:free()
end

function T.bad_offload_settings_name_the_key()
  local r = train(1, config(2, nil, nvme), "fp32", 1)
  assert(r.status ~= 0)
  assert(r.out:find("zero_optimization.offload_param needs stage 3 (got stage 2)", 1, true),
         r.out)
  r = train(1, config(1, { device = "nvme", nvme_path = tmp .. "/missing" }), "fp32", 1)
  assert(r.status ~= 0)
  assert(r.out:find("zero_optimization.offload_optimizer.nvme_path: cannot create a file in " ..
                    tmp .. "/missing (No such file or directory)", 1, true), r.out)
  r = train(1, config(3, nil, { device = "nvme", nvme_path = swap_dir, buffer_size = 1000 }),
            "fp32", 1)
  assert(r.status ~= 0)
  assert(r.out:find("zero_optimization.offload_param.buffer_size 1000 is smaller than " ..
                    "transformer.wte.weight's slice of 18432 elements; raise it to at least " ..
                    "18432", 1, true), r.out)
  local cfg = config(1, nvme)
  cfg.aio.block_size = 5000
  r = train(1, cfg, "fp32", 1)
  assert(r.status ~= 0)
  assert(r.out:find("aio.block_size must be a multiple of 4096 (got 5000)", 1, true), r.out)
end

-- A tier is one store kind (zero/store/): a kind of the test's own, one
-- file (tests/fixtures/stores/toy_host.lua: host memory that counts the
-- sub-groups read and written through it), registered, trains as the
-- optimizer's tier to the host tier's checksum, reads and writes each
-- sub-group once a step, and the estimate places it; unregistered, its
-- name is unknown to the config, the estimate and the engine alike.
function T.a_store_kind_from_one_file_is_a_tier()
  local zero = require("luazero.zero")
  local config = require("luazero.config")
  local estimate = require("luazero.estimate")
  local store = require("luazero.zero.store")
  local gpt2 = require("models.gpt2")
  local data = require("luazero.data")
  local comm = require("luazero.comm").init("local")
  local cfg = gpt2.config("gpt2-nano", { n_layer = 1, n_embd = 32, n_head = 2, context = 16 })
  local function ds(device)
    return { train_micro_batch_size_per_gpu = 2, gradient_accumulation_steps = 1,
             zero_optimization = { stage = 2, offload_optimizer = { device = device } } }
  end
  local steps = 3
  local function run(device)
    local engine = zero.initialize({ model = gpt2.new(cfg), seed = 3, batch = { 2, 16 },
                                     comm = comm, config = config.load(ds(device), 1) })
    local loader = data.loader(data.load(corpus), { B = 2, T = 16, seed = 1, vocab = cfg.vocab })
    for _ = 1, steps do engine:train_batch(loader) end
    local sum, tier = engine:params_checksum(), engine:plan().optimizer.tier
    engine:free()
    return sum, tier
  end
  local counts = estimate.counts_of_params(100000, 1)
  local toy = dofile(root .. "/tests/fixtures/stores/toy_host.lua")
  store.register(toy)
  local ok, err = pcall(function()
    local want = run("cpu")
    local got, tier = run("toy_host")
    assert(tier == "toy_host", "the plan put the optimizer on " .. tostring(tier))
    assert(got == want, ("toy_host tier: checksum %s != %s on the host tier"):format(got, want))
    assert(toy.allocated > 0, "the toy store allocated nothing")
    assert(toy.reads == steps and toy.writes == steps,
           ("toy store: %d reads, %d writes in %d steps (one sub-group)"):format(toy.reads,
                                                                                 toy.writes, steps))
    local function placed(opt)
      return estimate.rank(counts, { stage = 2, opt = opt, param = "none", device = "cuda" })
    end
    local r, host = placed("toy_host"), placed("cpu")
    assert(r.host.total == host.host.total and r.device.total == host.device.total,
           "the estimate places the toy tier elsewhere than the host tier")
  end)
  store.unregister("toy_host")
  if not ok then error(err, 0) end
  local function refused(what, fn)
    local fine, msg = pcall(fn)
    assert(not fine and tostring(msg):find("toy_host", 1, true),
           what .. " accepted the unregistered tier: " .. tostring(msg))
  end
  refused("config", function() config.load(ds("toy_host"), 1) end)
  refused("estimate", function()
    estimate.rank(counts, { stage = 2, opt = "toy_host", param = "none", device = "cuda" })
  end)
  refused("engine", function()
    zero.initialize({ model = gpt2.new(cfg), seed = 3, batch = { 2, 16 }, comm = comm,
                      config = ds("toy_host") })
  end)
end

-- A prefetch leaves its parameter read in flight (stage.req), so the disk
-- works under the compute before the gather; the bytes are the file's once
-- waited on, and a stage given back before anyone waited is waited on first.
function T.a_prefetched_parameter_slice_reads_in_the_background()
  local offload = require("luazero.zero.offload")
  os.execute("mkdir -p " .. q(swap_dir))
  local n = 3 * 4096 + 100
  local ps = offload.param_shard{ n = n, dtype = "f32", tier = "nvme", nvme_path = swap_dir,
                                  buffer_count = 2 }
  local src = offload.staging(4 * 4096, "f32") -- (whole pages, aligned, as the file writes them)
  local p = require("ffi").cast("float *", src.data)
  for i = 0, n - 1 do p[i] = i end
  ps:write_all(src)
  src:free()
  local v, stage = ps:slice(4096 + 7, 5000, true)
  assert(stage.req, "an async slice returned no request in flight")
  assert(ps:can_prefetch(), "one slice of two taken: another may be prefetched")
  stage.req:wait()
  stage.req = nil
  local got = require("ffi").cast("float *", v.data)
  for _, i in ipairs({ 0, 1, 4999 }) do
    assert(got[i] == 4096 + 7 + i, ("element %d read %g, want %d"):format(i, got[i], 4096 + 7 + i))
  end
  v:free()
  ps:release(stage)
  local v2, stage2 = ps:slice(0, 10, true)
  ps:release(stage2) -- given back in flight: waited on, not left to land in its next use
  assert(stage2.req == nil, "release left the read in flight")
  local v3, stage3 = ps:slice(0, 10, false)
  assert(stage3.req == nil, "a blocking slice left a request")
  assert(require("ffi").cast("float *", v3.data)[9] == 9, "blocking slice read the wrong bytes")
  v2:free(); v3:free()
  ps:release(stage3)
  ps:free()
end

return T
