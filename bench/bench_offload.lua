-- bench/bench_offload.lua — the offload tiers' benchmarks (not tests):
--   1. tiers on and off: gpt2 (124M), bf16, one rank: tokens/s of a training
--      step with the optimizer states in memory, in host memory ("cpu"), on
--      NVMe, and with the stage-3 parameter shard on NVMe too; the ratio to
--      the run without offload, peak RSS, NVMe bytes per step.
--   2. gpt2-xl (1.5B parameters: 16 bytes per parameter of model state is
--      more than this machine's memory) for a few steps in bf16 with the
--      optimizer states on NVMe: step time, peak RSS, bytes read and written
--      per step, next to what the model states would need without offload.
--   3. overlap on the sim device: gpt2 (124M), bf16, one rank, stage 2 with
--      the optimizer on the cpu, host<->device copies paced like a link of
--      --link-gbps: step time with overlap_comm off and on, the copies' time
--      per step, how long the host waited for them, and the fraction of the
--      copy time hidden behind compute.
--   4. ZeRO-Infinity: a Llama larger than this machine's memory (--hidden,
--      --layers, ...; the default is 1.8B parameters, 30 GB of model states)
--      at stage 3, bf16, with the parameters and the optimizer states on
--      NVMe and activation checkpointing: per step the bytes read and
--      written, the step time next to what the disk alone allows at the read
--      and write rates fio measures in the same run (O_DIRECT, libaio, 1 MiB
--      blocks, queue depth 8), peak RSS; with --half-depth also the same
--      model at half the layers, whose peak RSS should be the same; with
--      --optimizer and --master the optimizer's states and master weights
--      (AdamW8bit and bf16: 8-bit m and v over bf16 master weights), and with
--      --baseline 1 the same model with AdamW's fp32 states first and the
--      ratios of NVMe bytes per step, step time and peak RSS.
--   luazero bench/bench_offload.lua [--part 1|2|3|4] [--nvme DIR] [--steps N]
-- Part 2 writes a ~19 GB swap file in --nvme (default: the build folder, on
-- the work disk) and takes a few minutes. Run it on a quiet machine.
local cjson = require("cjson")
local lz = require("luazero")
local gpt2 = require("models.gpt2")
local layout = require("luazero.zero.layout")

local bench = dofile(lz.root .. "/bench/bench_support.lua")
local flags = bench.flags("bench_offload", arg, {
  { "part", "int", 0, "1, 2, 3 or 4 (0: 1 to 3, which includes part 2's gpt2-xl with about " ..
    "19 GB of swap files)", choices = { 0, 1, 2, 3, 4 } },
  { "hidden", "int", 2560, "part 4: the Llama's hidden size" },
  { "layers", "int", 24, "part 4: layers" },
  { "heads", "int", 20, "part 4: attention heads" },
  { "kv-heads", "int", 4, "part 4: key/value heads" },
  { "intermediate", "int", 6912, "part 4: the MLP's width" },
  { "half-depth", "int", 0, "part 4: 1: also the same model at half the layers" },
  { "fio-size", "string", "4G", "part 4: fio's file size for the disk yardstick" },
  { "lr", "number", 3e-5, "part 4: AdamW's learning rate (constant; a model this size from random weights)" },
  { "optimizer", "string", "AdamW", "part 4: optimizer.type (AdamW, AdamW8bit: 8-bit m and v, ...)" },
  { "master", "string", "f32", "part 4: the master weights: f32, or bf16 (bf16_stochastic_round)",
    choices = { "f32", "bf16" } },
  { "baseline", "int", 0, "part 4: 1: first the same model with AdamW's fp32 states and master, " ..
    "then the ratios of NVMe bytes, step time and peak RSS", choices = { 0, 1 } },
  { "link-gbps", "number", 4, "part 3: the pace of the sim's host<->device copies, GB/s" },
  { "steps", "int", 3, "timed steps per run (the first step is not counted)" },
  { "omp-wait", "string", "passive", "part 4: OMP_WAIT_POLICY of the runs (passive: idle OpenMP " ..
    "threads sleep, leaving the cores to the I/O threads; active; default: libgomp's own; an " ..
    "OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment wins)",
    choices = { "passive", "active", "default" } },
  { "seq-len", "int", 64, "tokens per sequence" },
  { "micro-batch", "int", 1, "sequences per step" },
  { "nvme", "string", nil, "directory for the swap files (default: build/)" },
  { "sub-group", "int", 50000000, "zero_optimization.sub_group_size for gpt2-xl" },
  { "data", "string", nil, "corpus (default: a generated text)" },
})

local root = lz.root
local q = bench.quote
local nvme = flags.nvme or (root .. "/build")

local tmp = bench.scratch()
local data = bench.corpus(tmp, flags.data)
print(bench.machine())

local function mib(b) return b / 2 ^ 20 end

-- Runs train.lua with a config; returns the per-step records (after the
-- first) and the output.
local function train(model_flags, cfg, steps, env)
  local cfg_path = tmp .. "/cfg.json"
  local f = assert(io.open(cfg_path, "w"))
  f:write(cjson.encode(cfg))
  f:close()
  local log = tmp .. "/bench.jsonl"
  os.remove(log)
  local p = io.popen(("cd %s && %s %s scripts/train.lua %s --data %s --config %s --steps %d " ..
                      "--seq-len %d --sample 0 --eval-batches 0 --log %s 2>&1")
                     :format(q(root), env or "", q(lz.executable()), model_flags, q(data),
                             q(cfg_path), steps + 1, flags.seq_len, q(log)))
  local out = {}
  for line in p:lines() do
    out[#out + 1] = line
    io.stderr:write("  | ", line, "\n")
  end
  p:close()
  local recs = {}
  f = io.open(log)
  if not f then error("run failed:\n" .. table.concat(out, "\n"), 0) end
  for l in f:lines() do
    local r = cjson.decode(l)
    if r.step and r.step > 1 then recs[#recs + 1] = r end
  end
  f:close()
  if #recs < steps then error("run stopped early:\n" .. table.concat(out, "\n"), 0) end
  return recs
end

local median = bench.median

local function summary(recs)
  local ms, rd, wr, cp, cw = {}, {}, {}, {}, {}
  for _, r in ipairs(recs) do
    ms[#ms + 1] = r.step_ms
    rd[#rd + 1] = r.nvme_read or 0
    wr[#wr + 1] = r.nvme_written or 0
    cp[#cp + 1] = r.copy_ms or 0
    cw[#cw + 1] = r.copy_wait_ms or 0
  end
  local last = recs[#recs]
  local tokens = last.tokens / last.step
  local step_ms = median(ms)
  return { step_ms = step_ms, tokens_per_s = tokens / (step_ms / 1000), recs = recs,
           peak_rss = last.mem.peak_rss, read = median(rd), written = median(wr),
           copy_ms = median(cp), copy_wait_ms = median(cw), h2d = last.h2d, d2h = last.d2h }
end

local function zero_cfg(stage, opt, param, sub_group)
  return { train_micro_batch_size_per_gpu = flags.micro_batch, bf16 = { enabled = true },
           data_types = { grad_accum_dtype = "bf16" },
           optimizer = { type = "AdamW", params = { lr = 1e-4, weight_decay = 0.1 } },
           zero_optimization = { stage = stage, sub_group_size = sub_group,
                                 offload_optimizer = opt, offload_param = param },
           aio = { block_size = 1048576, queue_depth = 8 } }
end

-- offload_optimizer's NVMe block (its pipelines on), or offload_param's
-- (param: true; offload_param has no pipelines).
local function nvme_block(extra, param)
  local b = { device = "nvme", nvme_path = nvme, buffer_count = 4 }
  if not param then b.pipeline_read, b.pipeline_write = true, true end
  for k, v in pairs(extra or {}) do b[k] = v end
  return b
end

if flags.part == 0 or flags.part == 1 then
  print("== 1. gpt2 (124M), bf16, one rank: a training step with each tier on and off")
  local sub = 10000000
  local runs = {
    { "stage 2, states in memory", zero_cfg(2, nil, nil, sub) },
    { "stage 2, optimizer on cpu", zero_cfg(2, { device = "cpu" }, nil, sub) },
    { "stage 2, optimizer on nvme", zero_cfg(2, nvme_block(), nil, sub) },
    { "stage 3, states in memory", zero_cfg(3, nil, nil, sub) },
    { "stage 3, optimizer + params on nvme", zero_cfg(3, nvme_block(), nvme_block(nil, true), sub) },
  }
  local base = {}
  print(("%-38s %10s %10s %8s %10s %12s %12s"):format("run", "tok/s", "step ms", "vs off",
                                                      "peak RSS", "read/step", "written/step"))
  for _, r in ipairs(runs) do
    local s = summary(train("--model gpt2", r[2], flags.steps))
    local stage = r[2].zero_optimization.stage
    base[stage] = base[stage] or s.tokens_per_s
    print(("%-38s %10.1f %10.0f %7.2fx %7.0f MiB %8.0f MiB %8.0f MiB")
          :format(r[1], s.tokens_per_s, s.step_ms, s.tokens_per_s / base[stage],
                  mib(s.peak_rss), mib(s.read), mib(s.written)))
  end
end

if flags.part == 0 or flags.part == 2 then
  print("== 2. gpt2-xl, bf16, one rank, stage 2, optimizer states on NVMe (" .. nvme .. ")")
  local m = gpt2.new(gpt2.config("gpt2-xl"))
  local n = layout.new(m.param_table, 1).full_numel
  print(("gpt2-xl: %.2fB parameters; model states without offload: %.1f GiB (16 B per " ..
         "parameter: bf16 weights and grads, fp32 master, m, v); optimizer states %.1f GiB")
        :format(m:count_params() / 1e9, 16 * n / 2 ^ 30, 12 * n / 2 ^ 30))
  local s = summary(train("--model gpt2-xl", zero_cfg(2, nvme_block(), nil, flags.sub_group),
                          flags.steps))
  print(("step %.1f s (median of %d), %.1f tokens/s, peak RSS %.2f GiB, per step %.2f GiB read " ..
         "and %.2f GiB written (%.2f and %.2f GB/s over the step)")
        :format(s.step_ms / 1000, flags.steps, s.tokens_per_s, s.peak_rss / 2 ^ 30,
                s.read / 2 ^ 30, s.written / 2 ^ 30, s.read / s.step_ms / 1e6,
                s.written / s.step_ms / 1e6))
end
if flags.part == 0 or flags.part == 3 then
  print(("== 3. overlap on the sim device: gpt2 (124M), bf16, one rank, stage 2, optimizer on " ..
         "the cpu, copies paced at %g GB/s (LZ_SIM_COPY_GBPS)"):format(flags.link_gbps))
  local env = ("LZ_SIM_COPY_GBPS=%g"):format(flags.link_gbps)
  local res = {}
  print(("%-12s %10s %12s %14s %14s %12s %12s"):format("overlap_comm", "step ms", "copies ms",
        "host waited ms", "hidden", "h2d/step", "d2h/step"))
  for _, overlap in ipairs({ false, true }) do
    local cfg = zero_cfg(2, { device = "cpu" }, nil, 10000000)
    cfg.data_types = nil
    cfg.zero_optimization.overlap_comm = overlap
    local s = summary(train("--model gpt2 --device sim", cfg, flags.steps, env))
    -- Off: every copy waits on the host. On: the host waits for what is not hidden.
    local waited = overlap and s.copy_wait_ms or s.copy_ms
    s.hidden = 1 - waited / s.copy_ms
    res[overlap] = s
    print(("%-12s %10.0f %12.0f %14.0f %13.0f%% %8.0f MiB %8.0f MiB")
          :format(tostring(overlap), s.step_ms, s.copy_ms, waited, 100 * s.hidden, mib(s.h2d),
                  mib(s.d2h)))
  end
  local off, on = res[false], res[true]
  print(("overlap on: %.0f%% of the copy time hidden behind compute (the host waited %.0f of " ..
         "%.0f ms); step %.0f -> %.0f ms, %.0f ms saved of %.0f ms of copies when serial")
        :format(100 * on.hidden, on.copy_wait_ms, on.copy_ms, off.step_ms, on.step_ms,
                off.step_ms - on.step_ms, off.copy_ms))
end

-- fio's O_DIRECT libaio rate (GB/s) in `dir` for rw = read or write.
local function fio_rate(dir, rw)
  local p = io.popen(("fio --name=lz --directory=%s --rw=%s --bs=1M --iodepth=8 --direct=1 " ..
                      "--ioengine=libaio --size=%s --numjobs=1 --output-format=json 2>/dev/null")
                     :format(q(dir), rw, flags.fio_size))
  local out = p:read("*a")
  p:close()
  os.remove(dir .. "/lz.0.0")
  local ok, r = pcall(cjson.decode, out)
  if not ok then error("fio gave no result (is fio installed?): " .. out:sub(1, 200), 0) end
  return r.jobs[1][rw].bw_bytes / 1e9
end

if flags.part == 4 then
  local function config_json(layers)
    local path = ("%s/llama-%d.json"):format(tmp, layers)
    local f = assert(io.open(path, "w"))
    f:write(cjson.encode{ architectures = { "LlamaForCausalLM" }, model_type = "llama",
                          hidden_size = flags.hidden, num_hidden_layers = layers,
                          num_attention_heads = flags.heads,
                          num_key_value_heads = flags.kv_heads,
                          intermediate_size = flags.intermediate, vocab_size = 32000,
                          max_position_embeddings = 2048, rms_norm_eps = 1e-5,
                          tie_word_embeddings = false })
    f:close()
    return path
  end
  -- libgomp reads its wait policy at start: the runs get it from here.
  local omp_env = ""
  if flags.omp_wait ~= "default" and not os.getenv("OMP_WAIT_POLICY")
     and not os.getenv("GOMP_SPINCOUNT") then
    omp_env = "OMP_WAIT_POLICY=" .. flags.omp_wait
  end
  local read_gbps, write_gbps = fio_rate(nvme, "read"), fio_rate(nvme, "write")
  print(("== 4. ZeRO-Infinity: Llama hidden %d, %d layers, stage 3, bf16, params and optimizer " ..
         "on NVMe (%s); fio here: read %.2f GB/s, write %.2f GB/s; %s")
        :format(flags.hidden, flags.layers, nvme, read_gbps, write_gbps,
                omp_env ~= "" and omp_env or "OpenMP waits as the environment says"))
  local depths = { flags.layers }
  if flags.half_depth == 1 then depths[2] = math.floor(flags.layers / 2) end
  local peaks = {}
  -- The runs: the optimizer and master asked for at each depth, after the
  -- fp32 AdamW baseline at full depth when asked for.
  local runs = {}
  if flags.baseline == 1 then runs[1] = { layers = flags.layers, type = "AdamW", master = "f32" } end
  for _, layers in ipairs(depths) do
    runs[#runs + 1] = { layers = layers, type = flags.optimizer, master = flags.master }
  end
  local done = {}
  for _, run in ipairs(runs) do
    local layers = run.layers
    local cfg = zero_cfg(3, nvme_block(), nvme_block({ buffer_count = 5, buffer_size = 200000000 }, true),
                         20000000)
    cfg.data_types = nil
    cfg.gradient_clipping = 1.0
    cfg.optimizer.type = run.type
    cfg.optimizer.params.lr = flags.lr
    cfg.optimizer.params.bf16_stochastic_round = run.master == "bf16" or nil
    print(("-- %d layers, %s, %s master"):format(layers, run.type, run.master))
    local z = cfg.zero_optimization
    z.stage3_max_live_parameters, z.stage3_prefetch_bucket_size = 200000000, 50000000
    z.overlap_comm = true
    cfg.aio = { block_size = 1048576, queue_depth = 8, thread_count = 2 }
    local path = config_json(layers)
    local s = summary(train("--model-config " .. q(path) .. " --checkpoint-activations", cfg,
                            flags.steps, omp_env))
    -- What tools/estimate predicts for the same config, beside the ledger.
    local cfg_path = tmp .. "/cfg.json"
    local p = io.popen(("cd %s && %s tools/estimate.lua --model-config %s --config %s " ..
                        "--device cpu --micro-batch %d --seq-len %d --checkpoint-activations 1 " ..
                        "--json 1 2>&1"):format(q(root), q(lz.executable()), q(path), q(cfg_path),
                                                flags.micro_batch, flags.seq_len))
    local est_out = p:read("*a")
    p:close()
    local okj, est = pcall(cjson.decode, est_out)
    local row
    for _, r in ipairs(okj and est.rows or {}) do
      if r.placement == "nvme+param" and r.stage == 3 then row = r end
    end
    if row then
      local last = s.recs[#s.recs]
      local act = last.mem.activations or 0
      print(("  tools/estimate: host %.2f GiB + activations %.2f GiB = %.2f GiB against the " ..
             "ledger's peak %.2f GiB (%.1f%%); NVMe files %.2f GiB; per step %.1f GB read, " ..
             "%.1f GB written (measured %.1f, %.1f)")
            :format(row.host.total / 2 ^ 30, act / 2 ^ 30, (row.host.total + act) / 2 ^ 30,
                    last.mem.peak_ledger / 2 ^ 30,
                    100 * ((row.host.total + act) / last.mem.peak_ledger - 1),
                    row.nvme.total / 2 ^ 30, row.nvme_read / 1e9, row.nvme_written / 1e9,
                    s.read / 1e9, s.written / 1e9))
    else
      print("  tools/estimate gave no nvme+param row: " .. est_out:sub(1, 300))
    end
    local disk_s = s.read / 1e9 / read_gbps + s.written / 1e9 / write_gbps
    local losses = {}
    for _, r in ipairs(s.recs) do losses[#losses + 1] = ("%.3f"):format(r.loss) end
    if run.type == flags.optimizer and run.master == flags.master then
      peaks[#peaks + 1] = s.peak_rss
    end
    done[#done + 1] = s
    print(("%d layers: step %.1f s (median), per step %.1f GB read and %.1f GB written " ..
           "(%.2f GB/s together); the disk alone at fio's rates: %.1f s; step / disk %.2f; " ..
           "peak RSS %.2f GiB; losses of the timed steps %s")
          :format(layers, s.step_ms / 1000, s.read / 1e9, s.written / 1e9,
                  (s.read + s.written) / s.step_ms / 1e6, disk_s, s.step_ms / 1000 / disk_s,
                  s.peak_rss / 2 ^ 30, table.concat(losses, " ")))
  end
  if flags.baseline == 1 then
    local b, l = done[1], done[2]
    print(("%s with %s master against AdamW with fp32 states and master, %d layers: NVMe bytes " ..
           "per step %.1f / %.1f GB = %.3f; step time %.1f / %.1f s = %.3f; peak RSS %.2f / %.2f GiB")
          :format(flags.optimizer, flags.master, flags.layers, (l.read + l.written) / 1e9,
                  (b.read + b.written) / 1e9, (l.read + l.written) / (b.read + b.written),
                  l.step_ms / 1000, b.step_ms / 1000, l.step_ms / b.step_ms, l.peak_rss / 2 ^ 30,
                  b.peak_rss / 2 ^ 30))
  end
  if #peaks == 2 then
    print(("peak RSS at %d layers / at %d layers: %.3f"):format(depths[1], depths[2],
                                                             peaks[1] / peaks[2]))
  end
end
bench.cleanup(tmp)
