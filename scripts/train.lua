-- scripts/train.lua — trains a GPT-2 or a Llama with the ZeRO engine, on one
-- rank or many (`luazero -n N scripts/train.lua ...`).
--   luazero scripts/train.lua --model gpt2-nano --data corpus.txt --steps 500 --log run.jsonl
--   luazero scripts/train.lua --model llama-tiny --data corpus.txt
--   luazero scripts/train.lua --model-config config.json --data corpus.txt  # Hugging Face's
--   luazero scripts/train.lua --init hf-folder --data corpus.bin  # its config.json and weights
--   luazero -n 4 scripts/train.lua --data corpus.txt --config ds_config.json --stage 3
-- Flags: luazero scripts/train.lua --help. Formats and fields: docs/training.md,
-- the engine and the configuration: docs/zero.md.
local ffi = require("ffi")
local cjson = require("cjson")
local lz = require("luazero")
local args = require("luazero.args")
local clock = require("luazero.clock")
local data = require("luazero.data")
local optim = require("luazero.optim")
local config = require("luazero.config")
local zero = require("luazero.zero")
local estimate = require("luazero.estimate")
local models = require("models.registry")
local hf = require("luazero.hf")
local monitor = require("luazero.monitor")
local restart = require("luazero.checkpoint.restart")
local due_saves = require("luazero.checkpoint.due")
local async_saves = require("luazero.checkpoint.async")

-- Rank from the launcher's environment: only rank 0 prints and logs.
local RANK = tonumber(os.getenv("RANK") or "0") or 0
local WORLD = tonumber(os.getenv("WORLD_SIZE") or "1") or 1
-- luazero -n N prefixes every line of ranks other than 0 with "[rank N] ".
local PREFIXED = os.getenv("LZ_SHM_NAME") ~= nil and os.getenv("LZ_RANK_OUTPUT") ~= "raw"

local spec = {
  { "model", "string", nil, "model size (default gpt2-nano, or --init's config.json): " .. table.concat(models.names, ", ") },
  { "model-config", "string", nil, "a Hugging Face config.json (GPT2LMHeadModel or LlamaForCausalLM) instead of --model" },
  { "init", "string", nil, "start from Hugging Face weights: a model.safetensors, or a folder (config.json, *.safetensors, model.safetensors.index.json)" },
  { "tokenizer", "string", nil, "the tokenizer.json (or Hugging Face tokenizer folder) of the data: tokenises a .jsonl --data (messages with the folder's chat template); the sample is decoded with it" },
  { "data", "string", nil, "a text file (bytes are tokens), a token file or instruction file (tools/prepare-data), or instruction examples (.jsonl)" },
  { "packing", "string", nil, "instruction data: pack (several examples per row, the default) or pad (one per row)" },
  { "val-data", "string", nil, "validation from this file (text, token file or instruction data), all of --data trains (default: the last 10% of --data)" },
  { "steps", "int", 100, "optimizer steps (0 with --init: the validation loss of the weights only)" },
  { "micro-batch", "int", nil, "sequences per micro-batch per rank (default: the config's, else the model size's, else 8)" },
  { "grad-accum", "int", nil, "micro-batches per optimizer step (default: the config's, else 1)" },
  { "seq-len", "int", nil, "tokens per sequence (default: the model's context)" },
  { "lr", "number", nil, "peak learning rate (default: the model size's)" },
  { "warmup", "int", nil, "linear warmup steps (default: 10% of --steps, at most 100)" },
  { "seed", "int", 1337, "seed of the initial weights, the batches and the sample" },
  { "dtype", "string", nil, "training precision: fp32, bf16 or fp16 (default: the config's, else fp32)" },
  { "device", "string", "cpu", "cpu, sim (a device the host cannot touch, for tests) or cuda " ..
                              "(one GPU per rank, LOCAL_RANK's)" },
  { "config", "string", nil, "a DeepSpeed configuration (ds_config.json); flags override it" },
  { "stage", "string", nil, "ZeRO stage 0..3 or auto (default: the config's, else 0)" },
  { "nvme-path", "string", nil, "--stage auto: where the swap files go when only an NVMe placement fits (default: the config's nvme_path)" },
  { "memory-budget", "string", nil, "per-rank memory: --stage auto plans for it; a step that passes it stops the run (\"2GiB\"; default: free memory, not enforced)" },
  { "lora-r", "int", nil, "LoRA adapters of rank r on --lora-targets; everything else frozen" },
  { "lora-alpha", "number", nil, "LoRA scale alpha / r (default: alpha = r)" },
  { "lora-targets", "string", nil, "modules LoRA adapts, comma-separated (default q_proj,v_proj)" },
  { "checkpoint-activations", "flag", false, "keep only each block's input; recompute its forward in backward (the config's activation_checkpointing says how)" },
  { "eval-every", "int", 0, "validation loss every N steps (0: at the end only)" },
  { "eval-batches", "int", 20, "validation batches per evaluation (at most)" },
  { "log", "string", nil, "write one JSON object per step to this file (JSON Lines)" },
  { "profile", "flag", false, "print where the steps after the first spent their time, per kernel and engine phase (luazero.profile)" },
  { "profile-json", "string", nil, "--profile, also written to this file as JSON" },
  { "sample", "int", 200, "tokens to generate at the end (0: none)" },
  { "save", "string", nil, "save checkpoints into this folder (DIR/step-NNNNNN, DIR/latest)" },
  { "save-every", "int", 0, "with --save: a checkpoint every N steps (0: at the end only)" },
  { "save-every-minutes", "number", 0, "with --save: also a checkpoint every M minutes of wall clock (rank 0's clock decides for all)" },
  { "async-save", "flag", false, "with --save: shards written by a background thread while training goes on (docs/checkpoints.md)" },
  { "keep", "int", 0, "with --save: keep the newest N checkpoints (0: all)" },
  { "save-zstd-level", "int", 3, "zstd level of checkpoint shards (1..19; higher: smaller, slower)" },
  { "resume", "string", nil, "resume from a checkpoint: a step folder, or a --save folder (its latest)" },
  { "n-layer", "int", nil, "override: transformer blocks" },
  { "n-head", "int", nil, "override: attention heads" },
  { "n-embd", "int", nil, "override: embedding width" },
  { "context", "int", nil, "override: the model's number of positions" },
  { "vocab", "int", nil, "override: vocabulary size" },
}

-- What a message gains on the user's terminal: the flag that lowers it.
local hints = {
  { "for activations failed", "the activations do not fit: lower --micro-batch or --seq-len, " ..
    "or add --checkpoint-activations" },
}

-- An error's one line: without the Lua location some messages carry, with a
-- hint where one applies.
local function one_line(msg)
  msg = tostring(msg):gsub("^[^%s:]+%.lua:%d+: ", "")
  for _, h in ipairs(hints) do
    if msg:find(h[1], 1, true) then msg = msg .. "; " .. h[2] end
  end
  return msg
end

-- An error: one line on stderr, no traceback (LZ_DEBUG=1 adds it), exit
-- status 2 (bad input) or `code`. An error every rank meets alike is shown
-- by rank 0; a rank's own (a message starting "rank R: ", from a collective
-- that failed there) by that rank. Under several ranks, another rank's error
-- that may be its alone is shown after a second unless rank 0 has stopped
-- the job by then (the launcher stops the others half a second after the
-- first rank fails).
local function fail_run(msg, code, alone)
  msg = one_line(msg)
  local own = tonumber(msg:match("^rank (%d+): "))
  if own == RANK and PREFIXED then msg = msg:gsub("^rank %d+: ", "") end
  -- one write: the launcher relays other ranks' lines between ours
  if RANK == 0 or own == RANK then
    io.stderr:write(("train: %s\n"):format(msg))
  elseif alone and WORLD > 1 and not own and not msg:find("failed on rank", 1, true) then
    require("luazero.clock").sleep(1)
    io.stderr:write(("train: %s\n"):format(msg))
  end
  -- A save in flight: its writer finished (one rank) or joined.
  local async = package.loaded["luazero.checkpoint.async"]
  local line = async and async.at_exit()
  if line and RANK == 0 then io.stderr:write(("train: %s\n"):format(line)) end
  io.stderr:flush()
  os.exit(code or 2)
end

local function user_error(msg) fail_run(msg, 2) end

local function say(...)
  if RANK == 0 then
    print(...)
    io.stdout:flush()
  end
end

-- Runs fn, turning any error it raises into a user error.
local function checked(fn, ...) return args.checked(user_error, fn, ...) end

-- Runs fn, whose errors may be one rank's alone (a collective, a rank's own
-- memory or files): exit status 1; with LZ_DEBUG=1, with their traceback.
local DEBUG = (os.getenv("LZ_DEBUG") or "0") ~= "0" and os.getenv("LZ_DEBUG") ~= ""
local function checked_rank(fn, ...)
  local res = { xpcall(fn, DEBUG and debug.traceback or tostring, ...) }
  if not res[1] then
    -- Out of device memory is the configuration's to fix, as is what the
    -- engine refuses to build ("initialize: ..."): exit 2, as bad input.
    local msg = tostring(res[2])
    local bad = msg:find("out of device memory", 1, true) or msg:find("^initialize: ")
    fail_run(res[2], bad and 2 or 1, true)
  end
  return unpack(res, 2, table.maxn(res))
end

local function positive(flags, name, min)
  local v = flags[name:gsub("-", "_")]
  if v ~= nil and v < min then
    user_error(("--%s must be >= %d (got %s)"):format(name, min, tostring(v)))
  end
end


local function mem_record()
  local m = lz.mem()
  m.peak_rss = lz.peak_rss()
  m.peak_ledger = lz.mem_total_peak()
  return m
end

-- The device side of the ledger (bytes per category now, and the peak of
-- all of them together); nil on the cpu.
local function dev_mem_record(device)
  if device == "cpu" then return nil end
  local m = lz.mem_device()
  m.peak = lz.mem_device_total_peak()
  return m
end

local function mib(b) return b / 2 ^ 20 end

-- The normalised DeepSpeed configuration: the file (or nothing) with the
-- flags on top. Without a file, config.train_defaults stand in for what
-- DeepSpeed would need from the script (micro-batch, clipping, AdamW); the
-- lr (and a micro-batch the size names) is the model size's unless given.
local function load_config(flags, world, model_cfg)
  local ov = {
    stage = flags.stage, dtype = flags.dtype, micro_batch = flags.micro_batch,
    grad_accum = flags.grad_accum, lr = flags.lr, warmup = flags.warmup,
    total_steps = flags.steps > 0 and flags.steps or nil, memory_budget = flags.memory_budget,
  }
  local td = config.train_defaults
  local source = flags.config
  if not source then
    source = {}
    ov.micro_batch = ov.micro_batch or model_cfg.micro_batch or td.micro_batch
    ov.grad_accum = ov.grad_accum or td.grad_accum
    ov.gradient_clipping = td.gradient_clipping
  end
  local cfg = config.load(source, world, ov)
  if not cfg.optimizer then
    local p = td.optimizer.params
    cfg.optimizer = { type = td.optimizer.type, decoupled_weight_decay = true, params = {
      lr = flags.lr or model_cfg.lr, betas = { p.betas[1], p.betas[2] }, eps = p.eps,
      weight_decay = p.weight_decay } }
  end
  return cfg
end

-- The learning-rate schedule that runs, and its name for the start-up
-- line: the config's scheduler, a constant lr (a config without one, as
-- DeepSpeed), or without a config file warmup + cosine
-- (config.train_defaults' warmup unless --warmup).
local function schedule_of(cfg, flags)
  local lr, td = cfg.optimizer.params.lr, config.train_defaults
  local warmup = flags.warmup or math.min(td.warmup_max, math.floor(flags.steps * td.warmup_fraction))
  if cfg.scheduler then
    return optim.schedule.lr_schedule(cfg), ("scheduler %s"):format(cfg.scheduler.type), warmup
  elseif flags.config then
    return function() return lr end, "constant", warmup
  end
  return optim.schedule.warmup_cosine(lr, warmup, flags.steps),
         ("warmup %d + cosine"):format(warmup), warmup
end

-- "auto": the lowest stage whose model states fit the per-rank budget; when
-- none does, stage 3 with the optimizer states (and the parameter shard) on
-- NVMe where that fits, in the config's nvme_path or --nvme-path.
local function resolve_stage(cfg, model, world, flags)
  local z = cfg.zero_optimization
  if z.stage ~= "auto" then
    if flags.nvme_path then
      user_error("--nvme-path is where --stage auto puts swap files when it picks NVMe; " ..
                 "without --stage auto set zero_optimization.offload_optimizer.nvme_path")
    end
    return
  end
  local budget, source = config.memory_budget(cfg, tonumber(os.getenv("LOCAL_WORLD_SIZE") or ""))
  local persistent = 0
  for _, e in ipairs(model.param_table) do
    if e.numel <= z.stage3_param_persistence_threshold then persistent = persistent + e.numel end
  end
  local device = flags.device == "cpu" and "cpu" or "cuda"
  local settings = estimate.settings_of(cfg, device)
  settings.overlap = nil -- stage 3's default unless the config says
  if z.overlap_comm_given then settings.overlap = z.overlap_comm end
  local nvme_path = z.offload_optimizer.nvme_path or z.offload_param.nvme_path or flags.nvme_path
  local counts = estimate.counts(model, world, z.stage3_param_persistence_threshold)
  local stage, why, _, placement = estimate.pick_stage(model.n_params, world, budget, cfg.dtype,
    { persistent = persistent, grads = cfg.grad_accum_dtype ~= "fp32" and "working" or nil,
      nvme = true, nvme_path = nvme_path, device = device, settings = settings, counts = counts })
  if placement then
    if not (z.offload_optimizer.nvme_path or z.offload_param.nvme_path) then
      config.check_writable_dir("--nvme-path", nvme_path)
    end
    local pl = estimate.placement_of[placement]
    for key, dev in pairs({ offload_optimizer = pl.opt, offload_param = pl.param }) do
      if dev == "nvme" then
        z[key].device = "nvme"
        z[key].nvme_path = z[key].nvme_path or nvme_path
      end
    end
    -- offload_param.buffer_size must hold the largest slice a gather reads.
    if pl.param == "nvme" then
      local slice = 0
      for _, seg in ipairs(counts.segments) do slice = math.max(slice, seg.slice) end
      z.offload_param.buffer_size = math.max(z.offload_param.buffer_size or 0, slice)
    end
  end
  config.set_stage(cfg, stage)
  say(("stage auto: %s (budget from %s)"):format(why, source))
end

-- --save DIR: everything a save will need, before step 1 (a run with
-- --save-every 0 saves only at its end): the zstd level, a folder that can be
-- created and written, free space for one checkpoint (fp32 master, Adam m
-- and v: 12 bytes a parameter). Every rank checks, so all stop alike.
local ZSTD_LEVELS = { 1, 19 }
pcall(ffi.cdef, [[
typedef struct lz_statvfs { unsigned long f_bsize, f_frsize; uint64_t f_blocks, f_bfree, f_bavail,
  f_files, f_ffree, f_favail; unsigned long f_fsid, f_flag, f_namemax; int spare[6]; } lz_statvfs;
int statvfs(const char *path, lz_statvfs *buf);
]])
local function check_save_target(flags, n_params)
  local level = flags.save_zstd_level
  if level < ZSTD_LEVELS[1] or level > ZSTD_LEVELS[2] then
    user_error(("--save-zstd-level must be %d..%d (got %d)"):format(ZSTD_LEVELS[1], ZSTD_LEVELS[2],
                                                                    level))
  end
  if not flags.save then return end
  local dir = flags.save:gsub("(.)/+$", "%1")
  -- The folders mkdir -p makes (deepest first): removed again when the
  -- folder is refused, so a refused --save leaves nothing behind.
  local made_dirs, there = {}, dir
  local function exists(p)
    local f = io.open(p, "rb")
    if f then f:close() end
    return f ~= nil
  end
  while not exists(there) do
    made_dirs[#made_dirs + 1] = there
    local up = there:match("^(.*)/[^/]*$")
    there = up and (up == "" and "/" or up) or "."
  end
  local function refuse(msg)
    for _, d in ipairs(made_dirs) do os.remove(d) end
    user_error(msg)
  end
  local made, why = lz.mkdir(dir)
  if not made then refuse(("--save %s: %s"):format(dir, (why:gsub("^checkpoint: ", "")))) end
  local probe = ("%s/.write-check-%d-%d"):format(dir, RANK, tonumber(ffi.C.getpid()))
  local f, err = io.open(probe, "wb")
  local wrote = f and f:write("x") and f:close()
  os.remove(probe)
  if not wrote then
    refuse(("--save %s: cannot write in it (%s); give a writable folder"):format(dir,
           tostring(err or "write failed")))
  end
  local st = ffi.new("lz_statvfs")
  if ffi.C.statvfs(dir, st) == 0 then
    local free = tonumber(st.f_bavail) * tonumber(st.f_frsize)
    local need = n_params * 12 + 2 ^ 20
    if free < need then
      refuse(("--save %s: %.1f MiB free, one checkpoint needs about %.1f MiB (%d parameters " ..
              "x 12 bytes); free space there or save elsewhere")
             :format(dir, free / 2 ^ 20, need / 2 ^ 20, n_params))
    end
  end
end
pcall(ffi.cdef, "int getpid(void);")

-- --resume: the checkpoint's manifest, read before anything is built; a
-- --steps below its step would run nothing; a LoRA run's flags and base
-- must be the saved ones (without --init: the recorded --init). Returns the
-- manifest (nil without --resume).
local function check_resume(flags)
  if not flags.resume then return end
  local checkpoint = require("luazero.checkpoint")
  local m = checked(function() return checkpoint.read_manifest(checkpoint.resolve(flags.resume)) end)
  if flags.steps < m.global_steps then
    user_error(("--steps %d is below the checkpoint's step %d (%s): there is nothing to run; " ..
                "give --steps %d or more (the run's total, as when it was saved)")
               :format(flags.steps, m.global_steps, flags.resume, m.global_steps + 1))
  end
  local init = checked(require("luazero.checkpoint.resume").check, flags, m, flags.resume)
  if init then
    flags.init = init
    say(("resume: the base weights from the checkpoint's --init %s%s"):format(init,
        m.init_xxh64 and (" (xxh64 " .. m.init_xxh64 .. ", as saved)") or ""))
  end
  return m
end

-- A --steps other than the saved run's stretches (or shrinks) a schedule
-- laid over --steps: said at start.
local function note_resumed_schedule(flags, cfg, m)
  if not m then return end
  local saved = type(m.extra) == "table" and tonumber(m.extra.steps)
  local sch = cfg.scheduler
  local total = sch and sch.type ~= "WarmupLR" and (sch.params or {}).total_num_steps
  local over_steps = not flags.config and "the warmup + cosine schedule" or
                     total == flags.steps and ("scheduler %s"):format(sch.type)
  if saved and saved ~= flags.steps and over_steps then
    say(("resume: --steps %d, the saved run had --steps %d: %s now spans %d steps, not %d " ..
         "(--steps %d keeps the saved run's)")
        :format(flags.steps, saved, over_steps, flags.steps, saved, saved))
  end
end

-- LZ_MEMORY_BUDGET, read once, before any work.
local function check_memory_budget_env(cfg)
  if (os.getenv("LZ_MEMORY_BUDGET") or "") ~= "" then
    checked(config.memory_budget, cfg, tonumber(os.getenv("LOCAL_WORLD_SIZE") or ""))
  end
end

-- --log FILE: one write per record, checked; a failed one is cut back to the
-- last complete record, so the file stays JSON Lines, and stops the run.
-- A restarted run (luazero --restarts) appends to it.
local function open_log(path)
  local jsonl = require("luazero.jsonl")
  local log, err = jsonl.open(path, { append = restart.count() ~= nil })
  if not log then user_error(("--log %s: cannot write it (%s)"):format(path, err)) end
  return {
    write = function(rec, what)
      local ok, werr = log:write(cjson.encode(rec) .. "\n")
      if not ok then
        fail_run(("--log %s: writing %s failed (%s); the file ends at the record before it; " ..
                  "free space there or log elsewhere"):format(path, what, werr), 1)
      end
    end,
    close = function() log:close() end,
  }
end

-- --log FILE and --profile-json FILE are emptied at start: refused when one
-- is (or lies inside) a file or folder the run reads or saves to.
local function check_log_target(flags)
  local atomic = require("luazero.io.atomic")
  for _, out in ipairs({ "log", "profile_json" }) do
    for _, f in ipairs({ "data", "val_data", "resume", "save", "init", "tokenizer", "config",
                         "model_config" }) do
      if flags[out] and flags[f] then
        checked(atomic.refuse_overlap, flags[out], "--" .. out:gsub("_", "-"), flags[f],
                "--" .. f:gsub("_", "-"))
      end
    end
  end
end

-- --lora-alpha and --lora-targets shape the adapters --lora-r adds: alone
-- they would be ignored. The targets default to q_proj,v_proj.
local function check_lora_flags(flags)
  for _, n in ipairs({ "lora-alpha", "lora-targets" }) do
    local v = flags[n:gsub("-", "_")]
    if v ~= nil and not flags.lora_r then
      user_error(("--%s %s without --lora-r does nothing: add --lora-r R (the adapters' rank) " ..
                  "or drop --%s"):format(n, v == "" and "''" or tostring(v), n))
    end
  end
  if flags.lora_alpha and flags.lora_alpha <= 0 then
    user_error(("--lora-alpha must be > 0 (got %s): the adapters' scale is alpha / r")
               :format(tostring(flags.lora_alpha)))
  end
  flags.lora_targets = flags.lora_targets or "q_proj,v_proj"
  if flags.lora_r and not flags.lora_targets:find("[^,%s]") then
    user_error(("--lora-targets '%s' names no module: give comma-separated names, e.g. " ..
                "q_proj,v_proj (Llama) or c_attn (GPT-2)"):format(flags.lora_targets))
  end
end

-- The flags, checked: nil (after printing the usage) for --help.
local function parse_flags(argv)
  local flags, usage = checked(args.parse, argv, spec)
  if not flags then
    say("usage: luazero scripts/train.lua --data FILE [flags]\n" .. usage)
    return nil
  end
  if not flags.data then
    user_error("--data is required: a text file, a token file made by tools/prepare-data, or " ..
               "instruction examples (.jsonl)")
  end
  for _, n in ipairs({ "micro-batch", "grad-accum", "seq-len", "n-layer", "n-head",
                       "n-embd", "context", "vocab" }) do
    positive(flags, n, 1)
  end
  positive(flags, "steps", flags.init and 0 or 1)
  if flags.init and flags.resume and not flags.lora_r then
    user_error(("--init %s and --resume %s: give one (--resume continues a luazero checkpoint, " ..
                "--init starts from Hugging Face weights; with --lora-r both: the base from " ..
                "--init, the adapters from --resume)"):format(flags.init, flags.resume))
  end
  for _, n in ipairs({ "warmup", "eval-every", "eval-batches", "sample", "save-every", "keep" }) do
    positive(flags, n, 0)
  end
  if flags.save_every_minutes < 0 then
    user_error(("--save-every-minutes must be >= 0 (got %g)"):format(flags.save_every_minutes))
  end
  if flags.lr and flags.lr <= 0 then user_error("--lr must be > 0 (got " .. flags.lr .. ")") end
  if flags.model and flags.model_config then
    user_error(("--model %s beside --model-config %s: the config.json defines the model; drop " ..
                "--model (or drop --model-config to train %s)")
               :format(flags.model, flags.model_config, flags.model))
  end
  check_lora_flags(flags)
  check_log_target(flags)
  local init_file = flags.init and io.open(flags.init, "rb")
  if init_file then init_file:close() end
  if flags.init and not init_file then
    user_error(("--init %s: no such file or folder; give a Hugging Face model folder or a " ..
                ".safetensors file"):format(flags.init))
  end
  if flags.device ~= "cpu" and flags.device ~= "sim" and flags.device ~= "cuda" then
    user_error(("--device must be cpu, sim or cuda (got %s)"):format(flags.device))
  end
  return flags
end

-- Everything a run needs before its first step: the model's config, the
-- ranks, the normalised configuration, the data, the metrics log, the
-- model and the engine. Returns the run (a table the steps share).
local function set_up(flags)
  local overrides = {
    n_layer = flags.n_layer, n_head = flags.n_head, n_embd = flags.n_embd,
    context = flags.context, vocab = flags.vocab,
  }
  local resumed = check_resume(flags)
  local mcfg
  -- --init FOLDER without --model / --model-config: the folder's config.json.
  local init_config = flags.init and not flags.model and not flags.model_config and
                      hf.config_path(flags.init)
  if flags.init and not flags.model and not flags.model_config and not init_config then
    user_error(("--init %s: no config.json there says which model the weights are; give " ..
                "--model NAME or --model-config config.json"):format(flags.init))
  end
  if flags.model_config or init_config then
    mcfg = checked(hf.model_config, models, flags.model_config or init_config, overrides)
  else
    mcfg = checked(models.config, flags.model or "gpt2-nano", overrides)
  end
  local tok, template
  if flags.tokenizer then
    tok, template = checked(require("luazero.data.instruct").open_tokenizer, flags.tokenizer)
    if tok:vocab_size() > mcfg.vocab then
      user_error(("--tokenizer %s: %d tokens, more than the model's vocab %d; give --vocab %d " ..
                  "or more"):format(flags.tokenizer, tok:vocab_size(), mcfg.vocab, tok:vocab_size()))
    end
  end
  local comm = checked(function() return require("luazero.comm").init() end)
  local world, rank = comm.size(), comm.rank()
  -- The device before any data is read: no GPU is an error at start.
  if flags.device ~= "cpu" then checked(lz.device_init, flags.device) end
  local cfg = checked(load_config, flags, world, mcfg)
  check_memory_budget_env(cfg)
  note_resumed_schedule(flags, cfg, resumed)
  local B, T = cfg.train_micro_batch_size_per_gpu, flags.seq_len or mcfg.context
  if T > mcfg.context then
    user_error(("--seq-len %d is longer than the model's context %d (%s); use --seq-len %d " ..
                "or less, or --context %d"):format(T, mcfg.context, mcfg.name, mcfg.context, T))
  end
  local schedule, sched, warmup = schedule_of(cfg, flags)
  local corpus = checked(data.load, flags.data, { tokenizer = tok, template = template,
                                                  max_len = T })
  local loader = checked(data.loader, corpus, { B = B, T = T, seed = flags.seed,
                                                vocab = mcfg.vocab, rank = rank, world = world,
                                                packing = flags.packing,
                                                val_fraction = flags.val_data and 0 or nil })
  -- --val-data: its windows are the validation batches; --data trains whole.
  local val_corpus = flags.val_data and checked(data.load, flags.val_data,
                                                { tokenizer = tok, template = template, max_len = T })
  local val_loader = val_corpus and
                     checked(require("luazero.held_out").loader, val_corpus,
                             { B = B, T = T, seed = flags.seed, vocab = mcfg.vocab, rank = rank,
                               world = world, packing = flags.packing }) or loader
  local model = models.new(mcfg)
  -- --init's files checked (headers, names, shapes) before anything is written.
  if flags.init then checked(hf.check, flags.init, model) end
  local log
  if flags.log and rank == 0 then log = open_log(flags.log) end
  if flags.lora_r then
    local targets = {}
    for t in flags.lora_targets:gmatch("[^,%s]+") do targets[#targets + 1] = t end
    local n = checked(require("models.lora").apply, model,
                      { r = flags.lora_r, alpha = flags.lora_alpha, targets = targets })
    say(("lora: rank %d, alpha %g on %d weights (%s); %d parameters train, the rest frozen")
        :format(flags.lora_r, flags.lora_alpha or flags.lora_r, n, table.concat(targets, ","),
                select(2, model:trainable_table())))
  end
  check_save_target(flags, model.n_params)
  checked(resolve_stage, cfg, model, world, flags)
  local note = config.unimplemented_message(cfg)
  if note then say(note) end
  if flags.checkpoint_activations then
    note = config.no_effect_message(cfg)
    if note then say(note) end
    checked(model.checkpoint_activations, model, cfg.activation_checkpointing)
  elseif cfg.activation_checkpointing_given then
    say("config: activation_checkpointing has no effect without --checkpoint-activations")
  end
  local engine = checked_rank(zero.initialize, { model = model, config = cfg, seed = flags.seed,
                                                 batch = { B, T }, lr = schedule, comm = comm,
                                                 device = flags.device,
                                                 draw_weights = not flags.init })
  optim.schedule.drive_betas(engine, cfg) -- OneCycle's cycle_momentum
  -- tensorboard, csv_monitor, wall_clock_breakdown, flops_profiler
  local mon = checked(monitor.start, { engine = engine, model = model, cfg = cfg, rank = rank,
                                       B = B, T = T })
  return {
    flags = flags, mcfg = mcfg, comm = comm, world = world, rank = rank, cfg = cfg, B = B, T = T,
    accum = cfg.gradient_accumulation_steps, lr = cfg.optimizer.params.lr, sched = sched,
    warmup = warmup, corpus = corpus, loader = loader, log = log, model = model,
    engine = engine, n_val = math.min(flags.eval_batches, val_loader.val_batches), first = 1,
    tok = tok, mon = mon, val_loader = val_loader, val_corpus = val_corpus,
  }
end

-- --init: Hugging Face weights into the engine, each rank reading its part.
local function init_from_hf(run)
  local t0 = clock.now()
  local r = checked(hf.load_into, run.engine, run.flags.init)
  -- A LoRA run records its base's checksum: a resume must adapt the same.
  run.engine:set_init_path(run.flags.init,
                           run.model.lora and checked(hf.checksum, run.flags.init) or nil)
  say(("initialized from %s: %d tensors from %d file%s in %.2f s"):format(run.flags.init,
      r.tensors, r.files, r.files == 1 and "" or "s", clock.now() - t0))
end

-- --resume: the engine's states, the batch generator, the next step.
local function resume(run)
  -- another model or optimizer is the input's fault (exit 2); reading the shards is the rank's
  checked(require("luazero.checkpoint.load").check, run.engine, run.flags.resume)
  local m = checked_rank(run.engine.load, run.engine, run.flags.resume)
  local pos = m.extra and m.extra.data
  if pos then checked(run.loader.set_position, run.loader, pos) end
  run.first = m.global_steps + 1
  say(("resumed from %s: step %d (%d optimizer steps), saved at world %d stage %d")
      :format(m.dir, m.global_steps, m.optimizer_steps, m.world_size, m.stage))
end

-- The start-up lines: model, data, activation checkpointing, the engine,
-- offload, the batch and the schedule.
local function say_start(run)
  local mcfg, loader, engine, cfg = run.mcfg, run.loader, run.engine, run.cfg
  say(("model %s: %d layers, %d heads, %d embd, context %d, vocab %d; %.2fM parameters")
      :format(mcfg.name, mcfg.n_layer, mcfg.n_head, mcfg.n_embd, mcfg.context, mcfg.vocab,
              run.model:count_params() / 1e6))
  local vc = run.val_corpus
  say(("data %s (%s): %d tokens, %d for training, %d held out%s; %s")
      :format(run.corpus.path, run.corpus.kind, run.corpus.count, loader.n_train,
              vc and vc.count or loader.n_val,
              vc and (" in --val-data %s (%s)"):format(vc.path, vc.kind) or "",
              run.n_val > 0 and ("validation on " .. run.n_val .. " batches")
              or "the held-out part is too small for one validation batch"))
  if loader.layout then say(loader.layout) end
  if run.flags.checkpoint_activations then
    local ac = cfg.activation_checkpointing
    say(("activation checkpointing: %d blocks keep their inputs (%s%s)"):format(mcfg.n_layer,
        ac.cpu_checkpointing and "cpu_checkpointing: offload memory" or "activation memory",
        ac.contiguous_memory_optimization and ", one contiguous buffer" or ""))
  end
  say(engine:describe())
  if engine.wdt == "bf16" and engine.dev == "cpu" then say("bf16 matmul: " .. lz.bf16_matmul()) end
  local where = engine:offload_summary()
  if where then say(where) end
  say(("batch %d x %d tokens, %d micro-batches per step: %d tokens per step; lr %g, " ..
       "%s, %d steps, %d threads")
      :format(run.B * run.world, run.T, run.accum, run.B * run.T * run.accum * run.world, run.lr,
              run.sched, run.flags.steps, lz.threads()))
end

-- A budget given explicitly (--memory-budget, LZ_MEMORY_BUDGET,
-- luazero.memory_budget) is held: a step whose peak RSS or ledger peak
-- passes it stops the run. Returns budget, source (nil: none held).
local function held_budget(cfg)
  if cfg.memory_budget or (os.getenv("LZ_MEMORY_BUDGET") or "") ~= "" then
    return config.memory_budget(cfg, tonumber(os.getenv("LOCAL_WORLD_SIZE") or ""))
  end
end

local function check_budget(run, step, rec)
  if not run.budget then return end
  local ledger = lz.mem_total_peak()
  local over = math.max(rec.mem.peak_rss, ledger)
  if over > run.budget then
    user_error(("step %d: rank %d's peak memory %.0f MiB (RSS %.0f MiB, ledger %.0f MiB) " ..
                "is over the memory budget %.0f MiB (%s); offload the optimizer states or " ..
                "parameters (zero_optimization.offload_optimizer / offload_param), raise " ..
                "the ZeRO stage, or raise the budget")
               :format(step, run.rank, mib(over), mib(rec.mem.peak_rss), mib(ledger),
                       mib(run.budget), run.budget_source))
  end
end

-- One optimizer step and, when due, the validation loss; returns the
-- metrics record (docs/formats.md) and the checkpointing profile.
-- Where the weights a run starts from came from, for messages.
local function starting_weights(flags)
  if flags.resume then return "the weights resumed from " .. flags.resume end
  if flags.init then return "the weights loaded from --init " .. flags.init end
  return "the weights drawn from --seed"
end

local function train_step(run, step)
  local engine, flags = run.engine, run.flags
  local tokens_per_step = run.B * run.T * run.accum * run.world
  run.comm.bytes_reset()
  lz.copy_bytes_reset()
  local wait0 = engine:copy_wait_s()
  local copy0 = flags.device == "sim" and lz.sim_copy_ns()
  local t0 = clock.now()
  local read0, written0 = engine:nvme_bytes()
  local r = checked_rank(engine.train_batch, engine, run.loader)
  local dt = clock.now() - t0
  local read1, written1 = engine:nvme_bytes()
  local rec = {
    -- JSON has no inf: an overflowed step logs grad_norm -1 (skipped true).
    step = step, loss = r.loss, lr = r.lr,
    grad_norm = r.grad_norm < math.huge and r.grad_norm or -1,
    loss_scale = r.loss_scale, skipped = r.skipped, tokens = step * tokens_per_step,
    tokens_per_s = tokens_per_step / dt, step_ms = dt * 1000, mem = mem_record(),
    dev_mem = dev_mem_record(flags.device), comm = run.comm.bytes(),
  }
  -- Bytes copied between host and device memory in the step.
  if flags.device ~= "cpu" then
    local c = lz.copy_bytes()
    rec.h2d, rec.d2h = c.h2d, c.d2h
    -- How long the host waited for copies meant to overlap, and (sim) how
    -- long the copies took.
    rec.copy_wait_ms = (engine:copy_wait_s() - wait0) * 1000
    if copy0 then rec.copy_ms = (lz.sim_copy_ns() - copy0) / 1e6 end
  end
  -- This rank's swap-file traffic in the step (offload to NVMe).
  if read1 then rec.nvme_read, rec.nvme_written = read1 - read0, written1 - written0 end
  local prof = run.model:checkpoint_profile(true)
  if prof then rec.checkpoint_ms = prof end
  if run.n_val > 0 and ((flags.eval_every > 0 and step % flags.eval_every == 0) or
                        step == flags.steps) then
    rec.val_loss = checked_rank(engine.evaluate, engine, run.val_loader, run.n_val)
    run.model:checkpoint_profile(true) -- the next step's profile counts training only
  end
  -- A skipped step's overflow is in its gradients (fp16 loss scaling); a
  -- loss that is not finite means the weights diverged: the run stops.
  -- The first step's loss is the starting weights' own, before any update.
  if step == run.first and not (math.abs(r.loss) < math.huge) then
    user_error(("step %d: the loss is %s before any update: %s give a non-finite loss; " ..
                "check those weights"):format(step, tostring(r.loss), starting_weights(flags)))
  end
  for _, l in ipairs({ { "loss", r.loss }, { "validation loss", rec.val_loss or 0 } }) do
    if not (math.abs(l[2]) < math.huge) then
      user_error(("step %d: the %s is %s: training diverged; lower --lr (it was %g)")
                 :format(step, l[1], tostring(l[2]), run.lr))
    end
  end
  return rec, r, prof
end

local function say_step(run, step, rec, r, prof)
  say(("step %5d/%d | loss %.4f%s | lr %.2e | norm %.3f | %.0f tok/s | %.0f ms | " ..
       "mem %.1f MiB, rss %.0f MiB%s%s%s")
      :format(step, run.flags.steps, r.loss,
              rec.val_loss and (" | val %.4f"):format(rec.val_loss) or "", r.lr, r.grad_norm,
              rec.tokens_per_s, rec.step_ms, mib(lz.mem_total()),
              mib(rec.mem.peak_rss), rec.time and monitor.breakdown.line(rec.time) or "",
              r.skipped and (" | skipped (overflow), loss scale %g"):format(r.loss_scale) or "",
              prof and (" | checkpointed blocks: forward %.0f ms, recompute %.0f ms, " ..
                        "backward %.0f ms"):format(prof.forward, prof.recompute, prof.backward)
              or ""))
end

-- --save: when checkpoints are due (every --save-every steps, every
-- --save-every-minutes, at the last step: luazero/checkpoint/due.lua), and
-- whether they are written in the background (--async-save:
-- luazero/checkpoint/async.lua; states on NVMe save synchronously).
local function plan_saves(run)
  local flags = run.flags
  if not flags.save then return end
  run.due = due_saves.new(run.comm, flags.save_every, flags.save_every_minutes, flags.steps)
  -- ds_config's checkpoint.writer.decoupled asks for the same.
  run.async = flags.async_save or run.cfg.checkpoint.async
  local why = run.async and async_saves.refusal(run.engine)
  if why then
    say((flags.async_save and "--async-save" or "checkpoint.writer.decoupled") ..
        ": saving synchronously: " .. why)
    run.async = false
  elseif run.async and flags.device == "cpu" then
    say(("%s: the background writer compresses on the cores the steps use (%d threads); " ..
         "on a CPU run a save then slows the steps beside it, and OMP_NUM_THREADS one below " ..
         "the cores leaves it a core (docs/checkpoints.md)")
        :format(flags.async_save and "--async-save" or "checkpoint.writer.decoupled", lz.threads()))
  end
end

local function say_async_saved(dir, t)
  if dir then say(("saved %s in the background (%.2f s from its step)"):format(dir, t.total_s)) end
end

local function save_if_due(run, step)
  local flags = run.flags
  if not flags.save then return end
  if run.async then say_async_saved(checked_rank(async_saves.poll, run.engine)) end
  if not run.due:check(step) then return end
  local extra = {
    data = run.loader:position(),
    seed = flags.seed, steps = flags.steps, warmup = run.warmup, lr = run.lr,
  }
  extra.data.batches = step * run.accum
  local opts = { zstd_level = flags.save_zstd_level, keep = flags.keep, config = run.cfg }
  local t1 = clock.now()
  if run.async then
    say_async_saved(checked_rank(async_saves.wait, run.engine)) -- one save at a time
    local dir, copy_s = checked_rank(async_saves.start, run.engine, flags.save, extra, opts)
    say(("saving %s in the background (snapshot %.2f s)"):format(dir, copy_s))
  else
    local dir = checked_rank(run.engine.save, run.engine, flags.save, extra, opts)
    say(("saved %s in %.2f s"):format(dir, clock.now() - t1))
  end
  run.due:saved()
end

-- The end of the run: the save in flight finished, its buffer freed.
local function finish_saves(run)
  if not run.async then return end
  say_async_saved(checked_rank(async_saves.wait, run.engine))
  async_saves.release(run.engine)
end

-- After the last step: the checksum (and the log's end record), a sample,
-- and either the REPL (luazero -i) or the buffers freed.
local function finish(run)
  local sum = run.engine:params_checksum()
  if run.log then
    run.log.write({ event = "end", params_checksum = sum }, "the end record")
    run.log.close()
  end
  say("params_checksum " .. sum)
  run.mon:close()
  if run.profile then
    say(run.profile:format())
    if run.flags.profile_json and run.rank == 0 then
      checked(run.profile.write_json, run.profile, run.flags.profile_json)
    end
    run.profile:detach()
  end
  local mcfg, flags = run.mcfg, run.flags
  if flags.sample > 0 then
    local prompt = { models.sample_start(mcfg) }
    local ids
    if flags.device == "cpu" and run.engine.P.params.extent == "full" and
       #prompt + flags.sample <= mcfg.context then
      -- whole parameters on the cpu: one position per token, against the
      -- key/value cache (luazero.generate)
      local new = require("luazero.generate").run(run.model, { prompt }, {
        max_new = flags.sample, temperature = 1, seed = flags.seed })[1].ids
      ids = { unpack(prompt) }
      for _, id in ipairs(new) do ids[#ids + 1] = id end
    else
      -- sharded parameters, a device, or past the context: a full forward per token
      ids = run.model:generate(prompt, flags.sample, flags.seed)
    end
    if run.tok then
      -- ids past the tokenizer's vocabulary (the model's may be larger) as <id>
      local parts = {}
      for i, id in ipairs(ids) do
        parts[i] = id < run.tok:vocab_size() and run.tok:decode({ id }) or ("<%d>"):format(id)
      end
      say("sample:\n" .. table.concat(parts))
    elseif mcfg.vocab <= 256 then
      say("sample:\n" .. data.decode_bytes(ids))
    else
      say("sample (token ids): " .. table.concat(ids, " "))
    end
  end
  if rawget(_G, "LUAZERO_INTERACTIVE") then
    -- luazero -i: the REPL looks at what the run left (shards(engine), ...).
    rawset(_G, "engine", run.engine); rawset(_G, "model", run.model)
    rawset(_G, "loader", run.loader); rawset(_G, "cfg", run.cfg)
    return
  end
  run.engine:free()
  run.loader:free()
  data.free(run.corpus)
  if run.val_corpus then
    run.val_loader:free()
    data.free(run.val_corpus)
  end
end

local function main(argv)
  local flags = parse_flags(argv)
  if not flags then return end
  local again = restart.prepare(flags, RANK) -- a restart resumes from --save's latest
  local run = set_up(flags)
  if flags.init then init_from_hf(run) end
  if flags.resume then resume(run) end
  if again and run.log then
    run.log.write(again:record(run.world, run.first), "the restart record")
  end
  say_start(run)
  run.budget, run.budget_source = held_budget(run.cfg)
  if flags.profile or flags.profile_json then
    if flags.profile_json and run.rank == 0 then -- an unwritable path fails before the steps
      local f, err = io.open(flags.profile_json, "w")
      if not f then user_error(("--profile-json: cannot write %s; give a path in a writable folder"):format(err)) end
      f:close()
    end
    run.profile = require("luazero.profile").attach(run.engine)
  end
  plan_saves(run)
  for step = run.first, flags.steps do
    run.mon:before_step(step)
    local rec, r, prof = train_step(run, step)
    checked_rank(run.mon.after_step, run.mon, rec) -- a full disk: exit 1, as --log
    say_step(run, step, rec, r, prof)
    if run.log then run.log.write(rec, ("step %d's record"):format(step)) end
    check_budget(run, step, rec)
    restart.fault_hook(run.rank, step) -- test hook: LZ_FAULT_KILL
    save_if_due(run, step)
  end
  -- No step ran (--steps 0 with --init, or a resume at its last step): the
  -- validation loss of the weights as loaded, to the last bit.
  if run.first > flags.steps and run.n_val > 0 then
    local v = checked_rank(run.engine.evaluate, run.engine, run.val_loader, run.n_val)
    if not (math.abs(v) < math.huge) then
      user_error(("the validation loss is %s: %s give a non-finite loss; check those weights")
                 :format(tostring(v), starting_weights(flags)))
    end
    say(("val_loss %.17g"):format(v))
  end
  finish_saves(run)
  finish(run)
end

main(arg)
