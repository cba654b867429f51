-- tools/estimate.lua — model-state memory per rank for ZeRO stages 0..3,
-- with and without offload, for a parameter count or a model name (and, for
-- a model, its activation arenas for a micro-batch); then every placement's
-- device, host and NVMe bytes per rank, with the NVMe traffic per step and
-- the disk's time for it. Run by tools/estimate; formulas in docs/zero.md,
-- "Estimating memory".
--   luazero tools/estimate.lua --params 1.5e9 --world 8
--   luazero tools/estimate.lua --model gpt2-xl --world 8 --budget 12GiB
--   luazero tools/estimate.lua --model gpt2 --micro-batch 4 --seq-len 1024
--   luazero tools/estimate.lua --model llama3-8b --world 8
--   luazero tools/estimate.lua --model-config config.json --world 8   # Hugging Face's
--   luazero tools/estimate.lua --model tinyllama-1.1b --lora-r 8 --sub-group-size 1e8 --json 1
--   luazero tools/estimate.lua --params 3e9 --measure-disk /nvme
local args = require("luazero.args")
local config = require("luazero.config")
local estimate = require("luazero.estimate")
local models = require("models.registry")
local optim = require("luazero.optim")
local formats = require("luazero.optim.formats")

local function a_model(f) return f.model ~= nil or f.model_config ~= nil end
-- The activation arenas: a batch of a model's sequences.
local ACTIVATIONS = { ok = function(f) return f.micro_batch and f.seq_len and a_model(f) end,
                      with = { "--micro-batch", "2", "--seq-len", "8", "--model", "gpt2" },
                      says = function() return "--micro-batch and --seq-len go together, with --model" end }

local spec = {
  { "params", "string", nil, "parameter count: 1.5e9, 124M, 1.5B, 350000000" },
  { "model", "string", nil, "a model name instead: " .. table.concat(models.names, ", ") },
  { "model-config", "string", nil,
    "a Hugging Face config.json instead (" ..
    table.concat(require("luazero.families").architectures(), " or ") .. ")" },
  { "world", "int", 1, "ranks (data-parallel world size N)", min = 1 },
  { "dtype", "string", "bf16", "working precision: bf16, fp16 (fp32 master + Adam) or fp32",
    choices = { "bf16", "fp16", "fp32" } },
  { "grads", "string", "fp32",
    "gradient dtype: fp32 (luazero) or working (the ZeRO paper's and DeepSpeed's)",
    choices = { "fp32", "working" } },
  { "device", "string", "cuda",
    "cuda (or sim): device and host memory apart; cpu: a CPU run, one memory (its ledger's view)",
    choices = { "cuda", "sim", "cpu" } },
  { "persistence-threshold", "number", 100000,
    "with --model: modules of at most this many elements stay whole at stage 3",
    needs = { ok = a_model, with = { "--model", "gpt2" },
              says = "goes with --model or --model-config; with --params, " ..
                                   "--persistent gives the count kept whole" } },
  { "persistent", "number", nil, "with --params: parameters kept whole at stage 3 (P; 0)",
    needs = { flag = "params", says = "goes with --params; --model counts it" } },
  { "budget", "string", nil,
    "memory per rank for stage \"auto\": 12GiB, 16GB, bytes (default LZ_MEMORY_BUDGET, " ..
    "else MemAvailable / world)" },
  { "deepspeed", "flag", false, "also print DeepSpeed's own estimator functions' figures" },
  { "micro-batch", "int", nil,
    "with --model and --seq-len: also the activation arenas for this many sequences",
    min = 1, needs = ACTIVATIONS },
  { "seq-len", "int", nil, "with --micro-batch: tokens per sequence", min = 1, needs = ACTIVATIONS },
  { "checkpoint-activations", "flag", false, "the activation arenas with activation checkpointing",
    needs = { ok = ACTIVATIONS.ok, with = ACTIVATIONS.with,
                                  says = "counts the activation arenas of --micro-batch B " ..
                                         "--seq-len L with --model: add them, or drop it" } },
  { "lora-r", "int", nil, "with --model: LoRA adapters of rank r train, the base is frozen",
    arg = "R (the adapters' rank)", needs = { ok = a_model, with = { "--model", "gpt2" },
                                              says = function()
      return "--lora-r and --lora-targets go with --model or --model-config"
    end } },
  { "lora-targets", "string", nil,
    "with --lora-r: modules adapted, comma-separated (default: the model family's)",
    needs = "lora-r" },
  { "sub-group-size", "number", nil, "zero_optimization.sub_group_size (1e9): NVMe sub-groups" },
  { "grad-accum", "int", nil, "gradient accumulation steps: NVMe reads and writes per step (1)",
    min = 1 },
  { "config", "string", nil, "a DeepSpeed config whose sub_group_size, offload buffer counts " ..
    "and sizes, buckets, overlap_comm, accumulation and optimizer the per-rank table uses" },
  { "read-gbps", "number", nil, "the disk's read speed in GB/s for the step time NVMe allows " ..
    "(1.9, assumed: measure with bench/bench-aio)", over = 0, why = "a speed in GB/s" },
  { "write-gbps", "number", nil, "the disk's write speed in GB/s (1.1, assumed)",
    over = 0, why = "a speed in GB/s" },
  { "measure-disk", "string", nil, "a directory on the disk the swap files would use: measure " ..
    "its read and write speed there first (256 MiB through the swap file's I/O, a second)" },
  { "json", "flag", false, "print the figures as one JSON object instead of tables" },
  { "moe-gather", "string", nil, "an MoE model's experts gathered per block or per expert " ..
    "(the config's moe.gather; default the model's)", choices = { "block", "expert" },
    needs = { ok = a_model, with = { "--model", "mixtral-tiny" },
              says = "goes with --model or --model-config" } },
  { "ep-size", "int", nil, "an MoE model's expert parallelism (the config's moe.ep_size; 1): " ..
    "where the plan keeps the experts in their expert-data-parallel group, a rank holds its " ..
    "E / ep_size experts of a block, and its arenas take every rank's rows", min = 1,
    needs = { ok = a_model, with = { "--model", "mixtral-tiny" },
              says = "goes with --model or --model-config" } },
  { "routed-only", "int", nil, "1: stage 3 gathers only the experts some rank routed to " ..
    "(the config's moe.routed_only; with --moe-gather expert): the NVMe reads count them, " ..
    "for uniform routing of --micro-batch x --seq-len tokens a rank", choices = { 0, 1 },
    needs = { ok = ACTIVATIONS.ok, with = ACTIVATIONS.with,
              says = "counts the experts --micro-batch B --seq-len L route to: add them" } },
  { "optimizer", "string", nil, "the optimizer.type whose states are counted, in its declared " ..
    "formats (default: the --config's optimizer, whose params may change them, e.g. bf16 " ..
    "moments; else " .. optim.registry.default.name .. "): " ..
    optim.registry.types_text(false, "or") },
  { "master", "string", nil, "the master weights' format: f32, or bf16 (bf16_stochastic_round; " ..
    "needs --dtype bf16); default: the --config's, else f32", choices = { "f32", "bf16" } },
}

local function fail(msg)
  io.stderr:write("estimate: ", tostring(msg):gsub("^estimate: ", ""):gsub("^config: ", ""), "\n")
  os.exit(2)
end

local function checked(fn, ...) return args.checked(fail, fn, ...) end

local function parse_count(text)
  local num, suffix = text:match("^%s*([%d%.eE%+%-]+)%s*([KkMmBbGgTt]?)%s*$")
  local n = tonumber(num)
  local scale = ({ [""] = 1, k = 1e3, K = 1e3, m = 1e6, M = 1e6, b = 1e9, B = 1e9, g = 1e9,
                   G = 1e9, t = 1e12, T = 1e12 })[suffix or ""]
  if not n or not scale or n * scale < 1 then
    fail(("--params '%s' is not a parameter count (e.g. 1.5e9, 124M, 1.5B)"):format(text))
  end
  if n * scale > 2 ^ 53 then
    fail(("--params '%s' is more than 2^53 (9,007,199,254,740,992) parameters, past the " ..
          "counts this estimate holds exactly; give a smaller count"):format(text))
  end
  return math.floor(n * scale + 0.5)
end

local function main(argv)
  local flags, usage = checked(args.parse, argv, spec)
  if not flags then
    print("usage: tools/estimate (--params N | --model NAME) [--world N] [flags]\n" ..
          "Prints the model-state bytes per rank (parameters, gradients, optimizer states)\n" ..
          "for ZeRO stages 0-3, without offload, with the optimizer on the CPU, and with\n" ..
          "parameters on the CPU too; then, for every placement (NVMe ones too), all the\n" ..
          "engine allocates per rank on the device, in host memory and on NVMe (staging,\n" ..
          "frozen parameters, comm buffers), the NVMe bytes read and written per step and\n" ..
          "the step time the disk allows; and the stage \"auto\" picks for a memory budget.\n" ..
          "Activations come on top. Formulas: docs/zero.md, docs/offload.md.\n\n" ..
          usage)
    return
  end
  local given = (flags.params and 1 or 0) + (flags.model and 1 or 0) +
                (flags.model_config and 1 or 0)
  if given ~= 1 then
    fail("give either --params N (e.g. 1.5e9), --model NAME (" ..
         table.concat(models.names, ", ") .. ") or --model-config config.json; --help lists " ..
         "the flags")
  end
  -- (sim keeps its memory apart from the host's, as cuda does, and is
  -- placed as the engine places it there)
  local pt = flags.persistence_threshold
  if pt < 0 or pt ~= math.floor(pt) or pt > 2 ^ 53 then
    fail(("--persistence-threshold must be a whole number of elements >= 0 (got %s)"):format(pt))
  end

  local N = flags.world
  local budget, source
  if flags.budget then
    budget = config.parse_bytes(flags.budget)
    if not budget then fail(("--budget '%s' is not bytes (e.g. 12GiB, 16GB)"):format(flags.budget)) end
    source = "--budget"
  else
    budget, source = checked(config.memory_budget, { world_size = N })
  end

  if flags.sub_group_size and not (flags.sub_group_size >= 1 and
                                   flags.sub_group_size == math.floor(flags.sub_group_size)) then
    fail(("--sub-group-size must be a whole number >= 1 (got %s)"):format(flags.sub_group_size))
  end

  local dtype = flags.dtype
  -- The engine's settings: the config's (placements and stages are the
  -- rows'), the flags on top.
  local settings = {}
  if flags.config then
    -- (the batch does not enter the model states: a file without one is
    -- read as one sequence a rank)
    local raw = checked(config.read_json, flags.config)
    local source = flags.config
    if type(raw) == "table" and raw.train_batch_size == nil and
       raw.train_micro_batch_size_per_gpu == nil then
      raw.train_micro_batch_size_per_gpu, source = flags.micro_batch or 1, raw
    end
    local cfg = checked(config.load, source, N)
    settings = estimate.settings_of(cfg, flags.device)
    settings.stage, settings.offload, settings.opt, settings.param = nil, nil, nil, nil
    settings.dtype, settings.grads = nil, nil
    settings.overlap = nil -- stage 3's default unless the config says
    if cfg.zero_optimization.overlap_comm_given then
      settings.overlap = cfg.zero_optimization.overlap_comm
    end
  end
  -- The optimizer whose states are counted: the config's, the flags on top.
  if flags.optimizer or not flags.config then
    estimate.optimizer_settings(checked(optim.new, { type = flags.optimizer }), settings)
  end
  if flags.master then settings.master_format = flags.master ~= "f32" and flags.master or nil end
  if settings.master_format == "bf16" and dtype ~= "bf16" then
    fail(("bf16 master weights are the bf16 working parameters: give --dtype bf16 (got --dtype %s)")
         :format(dtype))
  end

  local params, persistent, largest, layout, what, model, counts
  if flags.model or flags.model_config then
    -- (an MoE model's experts gathered as --moe-gather, else the config's
    -- moe.gather, else as its family builds them)
    local gather = flags.moe_gather or settings.moe_gather
    model = checked(function()
      local over = gather and { moe_gather = gather } or nil
      local m = models.new(flags.model and models.config(flags.model) or
                           models.from_hf_config(flags.model_config))
      if over and #(m.routers or {}) > 0 then
        m = models.new(flags.model and models.config(flags.model, over) or
                       models.from_hf_config(flags.model_config, over))
      end
      return m
    end)
    local m = estimate.model_params(model, flags.persistence_threshold, N)
    if flags.lora_r then
      local lora = require("models.lora")
      local targets = flags.lora_targets and {} or lora.default_targets(model)
      for t in (flags.lora_targets or ""):gmatch("[^,%s]+") do targets[#targets + 1] = t end
      checked(lora.apply, model, { r = flags.lora_r, targets = targets })
    end
    -- (block-scaled states lay each tensor out on whole blocks)
    local ep = flags.ep_size or settings.ep_size or 1
    if N % ep ~= 0 then
      fail(("--ep-size %d must divide the world size %d"):format(ep, N))
    end
    settings.ep_size = ep
    counts = checked(estimate.counts, model, N, flags.persistence_threshold,
                     formats.block_of(settings.formats), ep)
    params, persistent, largest = counts.numel, counts.persistent, m.largest_layer
    layout = { full = counts.full, shard = counts.shard }
    what = ("%s: %s parameters (%s without the vocabulary padding)%s; P = %s in " ..
            "modules of <= %s elements"):format(m.name, estimate.thousands(m.params),
            estimate.thousands(m.real), (", padded to %s, shards of %s"):format(
            estimate.thousands(layout.full), estimate.thousands(layout.shard)),
            estimate.thousands(persistent), estimate.thousands(flags.persistence_threshold))
    if flags.lora_r then
      what = ("%s with LoRA rank %d: %s parameters train (the adapters; padded to %s, shards " ..
              "of %s), %s are frozen (the base); P = %s in modules of <= %s elements"):format(
        m.name, flags.lora_r, estimate.thousands(counts.numel), estimate.thousands(layout.full),
        estimate.thousands(layout.shard), estimate.thousands(counts.frozen.numel),
        estimate.thousands(persistent), estimate.thousands(flags.persistence_threshold))
    end
  else
    params = parse_count(flags.params)
    persistent = flags.persistent or 0
    if persistent < 0 or persistent ~= math.floor(persistent) or persistent > params then
      fail(("--persistent must be a whole number from 0 to the --params count (got %s)")
           :format(flags.persistent))
    end
    what = ("%s parameters; P = %s"):format(estimate.thousands(params),
                                            estimate.thousands(persistent))
    counts = estimate.counts_of_params(params, N, persistent)
  end
  if flags.micro_batch then
    if flags.seq_len > model.cfg.context then
      fail(("--seq-len %d is longer than the model's context %d"):format(flags.seq_len,
           model.cfg.context))
    end
  end
  local disk = { read_gbps = flags.read_gbps or estimate.disk.read_gbps,
                 write_gbps = flags.write_gbps or estimate.disk.write_gbps }
  disk.assumed = not (flags.read_gbps and flags.write_gbps)
  if flags.measure_disk then
    if not require("luazero.io.fs").is_dir(flags.measure_disk) then
      fail(("--measure-disk %s: no such folder; give a folder on the disk the swap files would " ..
            "use (nvme_path)"):format(flags.measure_disk))
    end
    local rd, wr, direct = checked(estimate.measure_disk, flags.measure_disk)
    if not direct then
      fail(("--measure-disk %s: the file system refuses O_DIRECT (tmpfs?), so the page cache " ..
            "would be measured, not the disk; point it at the disk nvme_path would use")
           :format(flags.measure_disk))
    end
    disk.read_gbps = flags.read_gbps or rd
    disk.write_gbps = flags.write_gbps or wr
    disk.assumed, disk.measured = false, flags.measure_disk
  end
  settings.dtype, settings.grads, settings.device = dtype, flags.grads, flags.device
  settings.accum = flags.grad_accum or settings.accum or 1
  settings.sub_group_size = flags.sub_group_size or settings.sub_group_size
  settings.read_gbps, settings.write_gbps = disk.read_gbps, disk.write_gbps
  if flags.routed_only then settings.routed_only = flags.routed_only == 1 end
  settings.tokens = flags.micro_batch and flags.micro_batch * flags.seq_len
  local rows = estimate.rank_rows(counts, settings)
  local optimizer_text = estimate.describe_optimizer{ name = settings.optimizer,
    states = settings.states, formats = settings.formats, master_format = settings.master_format,
    dtype = dtype }
  -- As the trainer picks: the activations of one micro-batch off the budget
  -- first (where --micro-batch gives one), then in memory, else on NVMe (a
  -- path is the trainer's to give).
  local act
  if flags.micro_batch and model then
    model:checkpoint_activations(flags.checkpoint_activations)
    act = checked(estimate.activations, model, flags.micro_batch, flags.seq_len, dtype,
                  settings.ep_size)
  end
  local ok, picked, why
  if act and act.device >= budget then
    ok, why = true, ("the activations of a %d x %d micro-batch need %s per rank, more than the " ..
                     "whole budget %s: lower --micro-batch or --seq-len, or add " ..
                     "--checkpoint-activations"):format(flags.micro_batch, flags.seq_len,
                     estimate.format_bytes(act.device), estimate.format_bytes(budget))
  else
    ok, picked, why = pcall(estimate.pick_stage, params, N, budget - (act and act.device or 0),
                            dtype, { grads = flags.grads, persistent = persistent,
                                     layout = layout, nvme = true, nvme_path = "given",
                                     counts = counts, device = flags.device,
                                     settings = settings, all = true })
    if not ok then fail(picked) end
    why = why:gsub(" %(nvme_path given%)", "")
    if act then
      why = why:gsub("budget [%d.]+ %a+", function(b)
        return ("%s (what is left after %s of activations for a %d x %d micro-batch)")
               :format(b, estimate.format_bytes(act.device), flags.micro_batch, flags.seq_len)
      end, 1)
    end
  end
  if flags.json then
    print(estimate.json{ what = what, world = N, dtype = dtype, grads = flags.grads,
                         device = flags.device, counts = counts, rows = rows, disk = disk,
                         auto = why, budget = budget, optimizer = optimizer_text })
    return
  end
  print(("model states per rank for %s"):format(what))
  local gdt = flags.grads == "fp32" and "fp32" or dtype
  print(("world size N = %d; %s parameters, %s gradients; %s"):format(N, dtype, gdt,
        optimizer_text))
  -- (bf16 by default, as DeepSpeed's estimator counts mixed precision;
  -- scripts/train.lua's own default is fp32)
  local dtype_given = flags.config ~= nil
  for _, a in ipairs(arg) do dtype_given = dtype_given or a == "--dtype" or a:find("^%-%-dtype=") end
  if not dtype_given then
    print("(bf16 mixed precision, as DeepSpeed's estimator counts; scripts/train.lua trains in " ..
          "fp32 unless told: --dtype fp32 for its default)")
  end
  print()
  print(("%-5s %-9s %17s %10s %17s %10s   %s"):format("stage", "offload", "device bytes",
        "device", "cpu bytes", "cpu", "bytes/parameter (device | cpu)"))
  for _, r in ipairs(estimate.table_rows(params, N, dtype, { grads = flags.grads,
                                                         persistent = persistent,
                                                         layout = layout,
                                                         device = flags.device,
                                                         states = settings.states,
                                                         formats = settings.formats,
                                                         master_format = settings.master_format })) do
    print(("%-5d %-9s %17s %10s %17s %10s   %s"):format(r.stage, r.offload,
          estimate.thousands(r.device), ("%.2f GiB"):format(r.device / 2 ^ 30),
          estimate.thousands(r.cpu), ("%.2f GiB"):format(r.cpu / 2 ^ 30), r.formula))
  end
  print()
  print(layout and "Ψ/N: the engine's padded shard; P: kept whole at stage 3, beside the shards." or
        "Ψ parameters, N ranks, Ψ/N rounded up (padded shards), P kept whole at stage 3.")
  print(flags.device == "cpu" and
        "device and cpu are one memory here (--device cpu): cpu is what the ledger counts as offload." or
        "device: the accelerator's memory; cpu: host memory (pinned for transfers).")

  if act then
    local a = act
    print()
    print(("activations per rank for micro-batches of %d x %d tokens%s: %s bytes (%.2f GiB)%s")
          :format(flags.micro_batch, flags.seq_len,
                  flags.checkpoint_activations and ", checkpointed" or "",
                  estimate.thousands(a.device), a.device / 2 ^ 30,
                  a.offload > 0 and (", %s offload"):format(estimate.thousands(a.offload)) or ""))
  end

  -- An MoE model: its active parameters and the expert bytes its gathers read.
  local moe = model and require("luazero.estimate.moe").of(model, {
    world = N, dtype = dtype, gather = flags.moe_gather or settings.moe_gather,
    accum = settings.accum,
    ep_size = settings.ep_size,
    tokens = flags.micro_batch and flags.micro_batch * flags.seq_len,
    threshold = flags.persistence_threshold })
  if moe then
    print()
    for _, line in ipairs(require("luazero.estimate.moe").lines(moe)) do print(line) end
  end

  print()
  for _, line in ipairs(estimate.rank_table(rows, counts, disk, flags.device)) do print(line) end
  print()
  print(("stage \"auto\" (budget from %s): %s"):format(source, why))

  if flags.deepspeed then
    print()
    print("DeepSpeed's estimate_zero2/zero3_model_states_mem_needs (1 node, N GPUs, buffer " ..
          "factor 1.5; cpu per node):")
    local rows = {
      { "zero2", "none", estimate.deepspeed_zero2(params, N, 1, false) },
      { "zero2", "cpu", estimate.deepspeed_zero2(params, N, 1, true) },
    }
    if largest then
      rows[#rows + 1] = { "zero3", "none", estimate.deepspeed_zero3(params, largest, N, 1, false, false) }
      rows[#rows + 1] = { "zero3", "cpu", estimate.deepspeed_zero3(params, largest, N, 1, true, false) }
      rows[#rows + 1] = { "zero3", "cpu+param",
                          estimate.deepspeed_zero3(params, largest, N, 1, true, true) }
    else
      print("  (zero3 needs the largest layer: give --model)")
    end
    for _, r in ipairs(rows) do
      print(("  %-5s %-9s gpu %10s   cpu %10s"):format(r[1], r[2],
            ("%.2f GiB"):format(r[4] / 2 ^ 30), ("%.2f GiB"):format(r[3] / 2 ^ 30)))
    end
  end
end

main(arg)
