-- scripts/train.lua — trains a GPT-2 or a Llama with the ZeRO engine, on one
-- rank or many (`luazero -n N scripts/train.lua ...`).
--   luazero scripts/train.lua --model gpt2-nano --data corpus.txt --steps 500 --log run.jsonl
--   luazero scripts/train.lua --model llama-tiny --data corpus.txt
--   luazero scripts/train.lua --model-config config.json --data corpus.txt  # Hugging Face's
--   luazero scripts/train.lua --init hf-folder --data corpus.bin  # its config.json and weights
--   luazero -n 4 scripts/train.lua --data corpus.txt --config ds_config.json --stage 3
-- Flags: luazero scripts/train.lua --help. Formats and fields: docs/training.md,
-- the engine and the configuration: docs/zero.md.

-- The parts a run is made of, under lua/luazero/run/: how it speaks and
-- stops (exits), its flags and their checks, its inputs and outputs, its
-- configuration and --stage auto, its starting weights, the steps (loop)
-- and the checkpoints (saves).
local lz = require("luazero")
local data = require("luazero.data")
local optim = require("luazero.optim")
local config = require("luazero.config")
local zero = require("luazero.zero")
local models = require("models.registry")
local hf = require("luazero.hf")
local monitor = require("luazero.monitor")
local restart = require("luazero.checkpoint.restart")
local exits = require("luazero.run.exits")
local run_flags = require("luazero.run.flags")
local checks = require("luazero.run.checks")
local inputs = require("luazero.run.inputs")
local outputs = require("luazero.run.outputs")
local run_config = require("luazero.run.config")
local stage_auto = require("luazero.run.stage_auto")
local start = require("luazero.run.start")
local loop = require("luazero.run.loop")
local saves = require("luazero.run.saves")
local clock = require("luazero.clock")
local text = require("luazero.run.text")

local spec = {
  { "model", "string", nil, "model size (default gpt2-nano, or --init's config.json): " .. table.concat(models.names, ", ") },
  { "model-config", "string", nil, "a Hugging Face config.json (" ..
    table.concat(require("luazero.families").architectures(), ", ") .. ") instead of --model" },
  { "init", "string", nil, "start from Hugging Face weights: a model.safetensors, or a folder (config.json, *.safetensors, model.safetensors.index.json)" },
  { "tokenizer", "string", nil, "the tokenizer.json (or Hugging Face tokenizer folder) of the data: tokenises a .jsonl --data (messages with the folder's chat template); the sample is decoded with it (default for a .jsonl --data: --init's folder, when it holds one)" },
  { "chat-kwargs", "string", nil, "more variables of the --tokenizer folder's chat template for a .jsonl --data's messages: a JSON object, as apply_chat_template's keyword arguments (e.g. '{\"enable_thinking\": false}')" },
  { "data", "string", nil, "a text file (bytes are tokens), a token file or instruction file (tools/prepare-data), or instruction examples (.jsonl)",
    required = "a text file, a token file made by tools/prepare-data, or instruction examples (.jsonl)" },
  { "packing", "string", nil, "instruction data: pack (several examples per row, the default) or pad (one per row)",
    choices = { "pack", "pad" } },
  { "val-data", "string", nil, "validation from this file (text, token file or instruction data), all of --data trains (default: the last 10% of --data)" },
  { "steps", "int", 100, "optimizer steps (0 with --init: the validation loss of the weights only)",
    min = function(f) return f.init and 0 or 1 end,
    why = "0 (the validation loss of the weights alone) goes with --init" },
  { "micro-batch", "int", nil, "sequences per micro-batch per rank (default: the config's, else the model size's, else 8)",
    min = 1 },
  { "grad-accum", "int", nil, "micro-batches per optimizer step (default: the config's, else 1)",
    min = 1 },
  { "seq-len", "int", nil, "tokens per sequence (default: the model's context)",
    min = 1 },
  { "lr", "number", nil, "peak learning rate (default: the model size's)",
    over = 0 },
  { "warmup", "int", nil, "linear warmup steps (default: 10% of --steps, at most 100; 0: none)",
    min = 0 },
  { "seed", "int", 1337, "seed of the initial weights, the batches and the sample" },
  { "dtype", "string", nil, "training precision: fp32, bf16 or fp16 (default: the config's, else fp32)" },
  { "device", "string", "cpu", "cpu, sim (a device the host cannot touch, for tests) or cuda " ..
                              "(one GPU per rank, LOCAL_RANK's)",
    choices = { "cpu", "sim", "cuda" } },
  { "config", "string", nil, "a DeepSpeed configuration (ds_config.json); flags override it",
    aliases = { "deepspeed", "deepspeed_config" } },
  { "stage", "string", nil, "ZeRO stage 0..3 or auto (default: the config's, else 0)" },
  { "nvme-path", "string", nil, "--stage auto: where the swap files go when only an NVMe placement fits (default: the config's nvme_path)" },
  { "memory-budget", "string", nil, "per-rank memory: --stage auto plans for it; a step that passes it stops the run (\"2GiB\"; default: free memory, not enforced)" },
  { "lora-r", "int", nil, "LoRA adapters of rank r on --lora-targets; everything else frozen",
    arg = "R (the adapters' rank)" }, -- (its range: models/lora.lua's, "lora: r must be ...")
  { "lora-alpha", "number", nil, "LoRA scale alpha / r (default: alpha = r)",
    over = 0, why = "the adapters' scale is alpha / r", needs = "lora-r" },
  { "lora-targets", "string", nil, "modules LoRA adapts, comma-separated (default: the family's, e.g. q_proj,v_proj)",
    needs = "lora-r" },
  { "checkpoint-activations", "flag", false, "keep only each block's input; recompute its forward in backward (the config's activation_checkpointing says how)" },
  { "eval-every", "int", 0, "validation loss every N steps (0: at the end only)",
    min = 0, needs = { ok = function(f) return f.eval_batches > 0 end,
                       alone = { "--eval-batches", "0" }, with = { "--eval-batches", "5" },
                       says = "does nothing with --eval-batches 0 (no validation): give " ..
                              "--eval-batches N or drop it" } },
  { "eval-batches", "int", 20, "validation batches per evaluation (at most)",
    min = 0 },
  { "log", "string", nil, "write one JSON object per step to this file (JSON Lines)" },
  { "profile", "flag", false, "print where the steps after the first spent their time, per kernel and engine phase (luazero.profile)" },
  { "profile-json", "string", nil, "--profile, also written to this file as JSON" },
  { "sample", "int", 200, "tokens to generate at the end (0: none)",
    min = 0 },
  { "save", "string", nil, "save checkpoints into this folder (DIR/step-NNNNNN, DIR/latest)",
    arg = "DIR (the checkpoint folder)" },
  { "save-every", "int", 0, "with --save: a checkpoint every N steps (0: at the end only)",
    min = 0, needs = "save" },
  { "save-every-minutes", "number", 0, "with --save: also a checkpoint every M minutes of wall clock (rank 0's clock decides for all)",
    min = 0, needs = "save" },
  { "async-save", "flag", false, "with --save: shards written by a background thread while training goes on (docs/checkpoints.md)",
    needs = "save" },
  { "keep", "int", 0, "with --save: keep the newest N checkpoints (0: all)",
    min = 0, needs = "save" },
  { "save-zstd-level", "int", 3, "zstd level of checkpoint shards (1..19; higher: smaller, slower)",
    min = 1, max = 19, needs = "save" },
  { "resume", "string", nil, "resume from a checkpoint: a step folder, or a --save folder (its latest)" },
  { "n-layer", "int", nil, "override: transformer blocks",
    min = 1 },
  { "n-head", "int", nil, "override: attention heads",
    min = 1 },
  { "n-embd", "int", nil, "override: embedding width",
    min = 1 },
  { "context", "int", nil, "override: the model's number of positions",
    min = 1 },
  { "vocab", "int", nil, "override: vocabulary size",
    min = 1 },
}

-- What a message gains on the user's terminal: the flag that lowers it.
local hints = {
  { "for activations failed", "the activations do not fit: lower --micro-batch or --seq-len, " ..
    "or add --checkpoint-activations" },
}

-- Only rank 0 prints; an error is one line and exit status 2 (bad input)
-- or 1 (one rank's own failure). A save in flight is finished (one rank)
-- or joined before the exit.
local ex = exits.new({ script = "train", ranks = true, hints = hints, at_exit = function()
  local async = package.loaded["luazero.checkpoint.async"]
  return async and async.at_exit()
end })
local say, user_error, checked, checked_rank = ex.say, ex.user_error, ex.checked, ex.checked_rank

-- The flags, checked: nil (after printing the usage) for --help.
local function parse_flags(argv)
  local flags = run_flags.parse(ex, argv, spec, "luazero scripts/train.lua --data FILE [flags]")
  if flags then checks.train(ex, flags) end
  return flags
end

-- The model's config: --model-config, --init's config.json, or --model.
local function model_config(flags)
  local overrides = {
    n_layer = flags.n_layer, n_head = flags.n_head, n_embd = flags.n_embd,
    context = flags.context, vocab = flags.vocab,
  }
  -- --init FOLDER without --model / --model-config: the folder's config.json.
  local init_config = flags.init and not flags.model and not flags.model_config and
                      hf.config_path(flags.init)
  if flags.init and not flags.model and not flags.model_config and not init_config then
    user_error(("--init %s: no config.json there says which model the weights are; give " ..
                "--model NAME or --model-config config.json"):format(flags.init))
  end
  if flags.model_config or init_config then
    return checked(hf.model_config, models, flags.model_config or init_config, overrides)
  end
  return checked(models.config, flags.model or "gpt2-nano", overrides)
end

-- Everything a run needs before its first step: the model's config, the
-- ranks, the normalised configuration, the data, the metrics log, the
-- model and the engine. Returns the run (a table the steps share).
local function set_up(flags)
  local resumed = start.check_resume(ex, flags)
  start.keep_warmup(flags, resumed)
  local mcfg = model_config(flags)
  local tok, template
  -- (weights from a folder or a checkpoint fix the vocabulary: no --vocab helps)
  local vocab_fixed = flags.init and ("the weights in " .. flags.init) or
                      flags.resume and ("the checkpoint " .. flags.resume) or nil
  -- (instruction data from --init's folder, which holds its tokenizer: that one)
  if not flags.tokenizer and flags.init and data.is_jsonl(flags.data) and
     require("luazero.io.fs").exists(flags.init .. "/tokenizer.json") then
    flags.tokenizer = flags.init
    ex.say(("data: %s tokenised with --init's tokenizer (%s/tokenizer.json)"):format(flags.data,
           flags.init))
  end
  if flags.tokenizer then
    tok, template = inputs.tokenizer(ex, flags.tokenizer)
    inputs.check_tokenizer_vocab(ex, tok, flags.tokenizer, mcfg.vocab, vocab_fixed)
  end
  local comm = checked(function() return require("luazero.comm").init() end)
  local world, rank = comm.size(), comm.rank()
  checked(restart.check_fault, world) -- the test hook's rank and step, before any step
  -- The device before any data is read: no GPU is an error at start.
  if flags.device ~= "cpu" then checked(lz.device_init, flags.device) end
  local cfg = checked(run_config.load, flags, world, mcfg)
  -- the configuration's outputs (monitors, profiler, NVMe) beside the flags'
  checks.train_config(ex, flags, cfg)
  run_config.check_memory_budget_env(ex, cfg)
  local B, T = cfg.train_micro_batch_size_per_gpu, flags.seq_len or mcfg.context
  if T > mcfg.context then
    -- (--context cannot grow a learned position table loaded with --init)
    local fixed = flags.init and mcfg.family == "gpt2"
    user_error(("--seq-len %d is longer than the model's context %d (%s); use --seq-len %d " ..
                "or less%s"):format(T, mcfg.context, mcfg.name, mcfg.context, fixed and
                (" (its position table, from --init, holds %d positions)"):format(mcfg.context)
                or (", or --context %d"):format(T)))
  end
  -- (LongRoPE's attention scale follows the context where its config gives
  -- no factor: models/phi3.lua)
  local rs = mcfg.rope_scaling
  if flags.init and flags.context and type(rs) == "table" and rs.long_factor and
     not rs.factor and not rs.attention_factor then
    say(("model: --context %d sets LongRoPE's attention scale (from the context over " ..
         "original_max_position_embeddings): the model's numbers differ from --init's folder, " ..
         "whose context is its max_position_embeddings"):format(flags.context))
  end
  local schedule, sched, warmup = run_config.schedule(cfg, flags)
  start.note_resumed_schedule(ex, flags, cfg, resumed, sched,
                              optim.schedule.peak(cfg.scheduler, cfg.optimizer.params.lr))
  local jsonl = { tokenizer = tok, template = template, max_len = T,
                  chat_vars = flags.chat_kwargs and
                              checked(require("luazero.chat_template").kwargs, flags.chat_kwargs,
                                      "--chat-kwargs") }
  local corpus = inputs.corpus(ex, flags.data, jsonl)
  -- (the ids the model reads: --tokenizer's, or --init's folder's tokenizer)
  local init_tok = not flags.tokenizer and flags.init and
                   require("luazero.io.fs").exists(flags.init .. "/tokenizer.json") and flags.init
  local function check_ids(c)
    inputs.check_made_with(ex, c, flags.tokenizer or init_tok, tok,
                           init_tok and ("--init %s's tokenizer.json"):format(init_tok))
  end
  check_ids(corpus)
  -- which data the checkpoints' position belongs to (checked on resume)
  local fingerprint = (flags.save or flags.resume) and checked(data.fingerprint, flags.data)
  local loader = checked(data.loader, corpus, { B = B, T = T, seed = flags.seed,
                                                vocab = mcfg.vocab, vocab_fixed = vocab_fixed,
                                                rank = rank, world = world,
                                                packing = flags.packing,
                                                val_fraction = flags.val_data and 0 or nil })
  -- --val-data: its windows are the validation batches; --data trains whole.
  local val_corpus = flags.val_data and inputs.corpus(ex, flags.val_data, jsonl)
  if val_corpus then check_ids(val_corpus) end
  if val_corpus and checked(data.fingerprint, flags.val_data) == checked(data.fingerprint, flags.data) then
    say(("data: --val-data %s holds the same bytes as --data %s: the validation loss is the " ..
         "training data's (drop --val-data to hold out the last 10%% of --data)")
        :format(flags.val_data, flags.data))
  end
  local val_loader = val_corpus and
                     checked(require("luazero.held_out").loader, val_corpus,
                             { B = B, T = T, seed = flags.seed, vocab = mcfg.vocab,
                               vocab_fixed = vocab_fixed, rank = rank, world = world,
                               packing = flags.packing }) or loader
  -- The config's moe.gather: the granularity the experts are built with.
  if cfg.moe.gather and mcfg.moe_gather then mcfg.moe_gather = cfg.moe.gather end
  local model = models.new(mcfg)
  -- A moe block beside a model without MoE blocks does nothing: said so.
  if #(model.routers or {}) == 0 then
    local moe_config, keys = require("luazero.config.moe"), {}
    for _, k in ipairs({ "ep_size", "gather", "routed_only", "placement" }) do
      if cfg.moe[k] ~= nil and cfg.moe[k] ~= moe_config.defaults[k] then
        keys[#keys + 1] = "moe." .. k
      end
    end
    if #keys > 0 then
      cfg.no_effect[#cfg.no_effect + 1] = ("%s (the model %s has no mixture-of-experts blocks)")
                                          :format(table.concat(keys, ", "), mcfg.name or "given")
    end
    cfg.moe.ep_size = 1 -- (no experts to place: no expert-parallel groups)
  else
    -- each rank of an expert-parallel group holds as many of a block's experts
    for _, r in ipairs(model.routers) do
      if r.n_experts % cfg.moe.ep_size ~= 0 then
        user_error(("config: moe.ep_size %d does not divide the %d experts of %s's MoE blocks; " ..
                    "set moe.ep_size to a divisor of %d that divides the world size %d")
                   :format(cfg.moe.ep_size, r.n_experts, mcfg.name or "the model", r.n_experts,
                           world))
      end
    end
  end
  -- --init's files checked (headers, names, shapes) before anything is written.
  if flags.init then checked(hf.check, flags.init, model) end
  if flags.lora_r then
    local targets = flags.lora_targets and {} or require("models.lora").default_targets(model)
    for t in (flags.lora_targets or ""):gmatch("[^,%s]+") do targets[#targets + 1] = t end
    local n = checked(require("models.lora").apply, model,
                      { r = flags.lora_r, alpha = flags.lora_alpha, targets = targets })
    say(("lora: rank %d, alpha %g on %d weights (%s); %d parameters train, the rest frozen")
        :format(flags.lora_r, flags.lora_alpha or flags.lora_r, n, table.concat(targets, ","),
                select(2, model:trainable_table())))
  end
  outputs.check_save_target(ex, flags, model.n_params, cfg)
  -- (before --stage auto, which counts the activations it leaves)
  if flags.checkpoint_activations then
    checked(model.checkpoint_activations, model, cfg.activation_checkpointing)
  end
  checked(stage_auto.resolve, ex, cfg, model, world, flags, { B, T })
  local note = config.auto_message(cfg)
  if note then say(note) end
  note = run_config.schedule_note(cfg, flags)
  if note then say(note) end
  note = config.unimplemented_message(cfg)
  if note then say(note) end
  -- Without --checkpoint-activations one line covers the whole block.
  note = config.no_effect_message(cfg, not flags.checkpoint_activations and
                                       "activation_checkpointing." or nil)
  if note then say(note) end
  if not flags.checkpoint_activations and cfg.activation_checkpointing_given then
    say("config: activation_checkpointing has no effect without --checkpoint-activations")
  end
  -- a resumed or restarted run (luazero --restarts) appends to its log
  -- (main cuts it back to the steps before its first), opened once every
  -- input is checked (a refusal above leaves no file)
  local log = flags.log and rank == 0 and
              outputs.open_log(ex, flags.log, restart.count() ~= nil or flags.resume ~= nil)
  local engine = checked_rank(zero.initialize, { model = model, config = cfg, seed = flags.seed,
                                                 batch = { B, T }, lr = schedule, comm = comm,
                                                 device = flags.device,
                                                 draw_weights = not flags.init })
  optim.schedule.drive_betas(engine, cfg) -- OneCycle's cycle_momentum
  -- tensorboard, csv_monitor, wall_clock_breakdown, flops_profiler
  local mon = checked(monitor.start, { engine = engine, model = model, cfg = cfg, rank = rank,
                                       B = B, T = T, resumed = flags.resume ~= nil })
  return {
    ex = ex, flags = flags, mcfg = mcfg, comm = comm, world = world, rank = rank, cfg = cfg,
    B = B, T = T, accum = cfg.gradient_accumulation_steps,
    lr = optim.schedule.peak(cfg.scheduler, cfg.optimizer.params.lr),
    sched = sched, warmup = warmup, corpus = corpus, loader = loader, log = log or nil,
    model = model, engine = engine, n_val = math.min(flags.eval_batches, val_loader.val_batches),
    first = 1, tok = tok, mon = mon, val_loader = val_loader, val_corpus = val_corpus,
    data_fingerprint = fingerprint or nil,
  }
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
              or run.flags.eval_batches == 0 and "no validation (--eval-batches 0)"
              or "the held-out part is too small for one validation batch"))
  if loader.layout then say(loader.layout) end
  if run.flags.checkpoint_activations then
    local ac = cfg.activation_checkpointing
    say(("activation checkpointing: %d blocks keep their inputs (%s%s)"):format(mcfg.n_layer,
        ac.cpu_checkpointing and "cpu_checkpointing: offload memory" or "activation memory",
        ac.contiguous_memory_optimization and ", one contiguous buffer" or ""))
  end
  say(engine:describe())
  if engine.dev == "cpu" then -- (the 8-bit update's form where a state is kept in u8)
    local u8 = false
    for _, f in pairs(engine.optimizer.state_formats or {}) do u8 = u8 or f == "u8" end
    say("cpu: " .. lz.cpu_path({ adamw8bit = u8 }))
  end
  if engine.wdt == "bf16" and engine.dev == "cpu" then
    say("bf16 matmul: " .. lz.bf16_matmul() .. "; bf16 attention: " .. lz.bf16_attention())
  end
  local where = engine:offload_summary()
  if where then say(where) end
  -- A busy machine: threads that spin while they wait (OpenMP's active
  -- policy) take cores from the others' work; passive waiting gave 2-3x
  -- faster steps beside another job (docs/training.md, Progress).
  local load = tonumber((lz.read_file("/proc/loadavg") or ""):match("^(%S+)"))
  local _, cores = (lz.read_file("/proc/cpuinfo") or ""):gsub("\nprocessor%s*:", "")
  cores = cores + ((lz.read_file("/proc/cpuinfo") or ""):find("^processor") and 1 or 0)
  if load and cores and lz.threads() * run.world > 1 and load >= cores and
     not os.getenv("OMP_WAIT_POLICY") then
    say(("threads: the machine is busy (load average %.1f on %d cores); OMP_WAIT_POLICY=passive " ..
         "or fewer threads (OMP_NUM_THREADS) can make the steps faster here"):format(load, cores))
  end
  say(("batch %d x %d tokens, %d micro-batches per step: %d tokens per step; lr %g, " ..
       "%s, %d steps, %d thread%s")
      :format(run.B * run.world, run.T, run.accum, run.B * run.T * run.accum * run.world, run.lr,
              run.sched, run.flags.steps, lz.threads(), lz.threads() == 1 and "" or "s"))
end

-- After the last step: the checksum (and the log's end record), a sample,
-- and either the REPL (luazero -i) or the buffers freed.
local function finish(run)
  local sum = run.engine:params_checksum()
  if run.log then
    run.log.write({ event = "end", params_checksum = sum, wall_time = clock.unix(),
                    elapsed_s = run.started and clock.now() - run.started or 0,
                    steps = run.flags.steps, tokens = saves.tokens(run, run.flags.steps),
                    skipped_steps = run.engine.skipped_steps }, "the end record")
    run.log.close()
  end
  if run.started and run.first <= run.flags.steps then
    local skipped = run.engine.skipped_steps - (run.skipped0 or 0)
    say(("trained steps %d-%d in %s%s"):format(run.first, run.flags.steps,
                                               clock.span(clock.now() - run.started),
                                               skipped > 0 and (" (%d skipped on overflow)")
                                                               :format(skipped) or ""))
  end
  say("params_checksum " .. sum)
  run.mon:close()
  if run.profile then
    say(run.profile:format())
    if run.flags.profile_json and run.rank == 0 then
      ex.checked_write(run.profile.write_json, run.profile, run.flags.profile_json)
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
      say("sample:\n" .. text.decode(run.tok, ids))
    elseif mcfg.vocab <= 256 then
      say("sample:\n" .. data.decode_bytes(ids, true))
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
  local again = restart.prepare(flags, ex.rank) -- a restart resumes from --save's latest
  local run = set_up(flags)
  if flags.init then start.init_from_hf(ex, run) end
  if flags.resume then start.resume(ex, run) end
  if (again or flags.resume) and run.log then
    run.log.keep_before(run.first)
    run.log.write(again and again:record(run.world, run.first) or
                  { event = "resume", from = flags.resume, resumed_from_step = run.first - 1,
                    world_size = run.world }, "the resume record")
  end
  -- the monitors' files hold no step twice after a resume or a restart
  if again or flags.resume then ex.checked_write(run.mon.continue_from, run.mon, run.first, run.samples0) end
  say_start(run)
  run.budget, run.budget_source = run_config.held_budget(run.cfg)
  -- The flops profiler's step and file, before the steps: a step the run
  -- resumed past would profile nothing; an unwritable file failed there.
  local fp = run.cfg.flops_profiler
  if fp.enabled and fp.profile_step < run.first then
    ex.user_error(("config: flops_profiler.profile_step %d is before this run's first step %d " ..
                   "(it resumes after step %d), so nothing would be profiled; give a " ..
                   "profile_step from %d to %d"):format(fp.profile_step, run.first, run.first - 1,
                                                      run.first, flags.steps))
  end
  if fp.enabled and fp.output_file and run.rank == 0 then
    outputs.check_writable(ex, "flops_profiler.output_file", fp.output_file)
  end
  if flags.profile or flags.profile_json then
    if flags.profile_json and run.rank == 0 then -- an unwritable path fails before the steps
      outputs.check_writable(ex, "--profile-json", flags.profile_json)
    end
    run.profile = require("luazero.profile").attach(run.engine)
  end
  loop.run(run)
  finish(run)
end

main(arg)
