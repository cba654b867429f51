-- config.lua — DeepSpeed's configuration (ds_config.json), accepted as is:
-- same keys, same defaults, same meaning (DESIGN.md decision 7).
--
--   local config = require("luazero.config")
--   local cfg = config.load("ds_config.json", world_size, { stage = "auto", dtype = "bf16" })
--   print(config.unimplemented_message(cfg))   -- nil when every key is implemented
--
-- Its parts: config/values.lua (checking one value), config/defaults.lua
-- (DeepSpeed's defaults), config/scheduler.lua (the scheduler block),
-- config/auto.lua ("auto" filled as the Hugging Face Trainer fills it); the
-- stage rules are zero/plan.lua's, the learning-rate schedules
-- optim/schedule.lua's.
-- Errors are Lua errors whose message is one line starting "config: ", raised
-- at level 0 (no position prefix), naming the key and the allowed values.
-- Keys luazero does not implement are collected, by full dotted name, in
-- cfg.unimplemented. The key reference is docs/configuration.md.
local cjson = require("cjson")

local values = require("luazero.config.values")
local defaults = require("luazero.config.defaults")
local auto = require("luazero.config.auto")
local monitor = require("luazero.config.monitor")
local checkpoint = require("luazero.config.checkpoint")
local moe = require("luazero.config.moe")
local scheduler = require("luazero.config.scheduler")
local Placement = require("luazero.zero.plan")
local optimizers = require("luazero.optim.registry")
local optim_schema = require("luazero.optim.schema")
local store = require("luazero.zero.store")

local M = {}

local fail, show, given, is_whole = values.fail, values.show, values.given, values.is_whole
local number_at_least, whole_at_least = values.number_at_least, values.whole_at_least
local positive_whole, boolean, block = values.positive_whole, values.boolean, values.block
local asks_for_nothing, sorted_keys = values.asks_for_nothing, values.sorted_keys
local read_json, deep_copy = values.read_json, values.deep_copy
M.show, M.read_json = show, read_json

-- DeepSpeed's defaults (config/defaults.lua): M.zero_defaults, M.fp16_defaults, ...
for k, v in pairs(defaults) do M[k] = v end

-- Top-level keys that only set how often DeepSpeed prints, or pick among
-- DeepSpeed implementations of the same optimizer: accepted, no effect.
local accepted_top = { steps_per_print = true, zero_allow_untested_optimizer = true,
                       zero_force_ds_cpu_optimizer = true }
-- zero_optimization keys set to DeepSpeed's default, which is what luazero does.
local zero_default_ok = { allgather_partitions = true, load_from_fp32_weights = true,
                          ignore_unused_parameters = true, use_multi_rank_bucket_allreduce = true,
                          memory_efficient_linear = true, override_module_apply = true }

------------------------------------------------------------------ sections

local function batch_sizes(raw, world, cfg, notes)
  local keys = { "train_batch_size", "train_micro_batch_size_per_gpu",
                 "gradient_accumulation_steps" }
  local v = {}
  for _, k in ipairs(keys) do
    if given(raw[k]) then v[k] = whole_at_least(k, raw[k], 1) end
  end
  local tb, mb, ga = v.train_batch_size, v.train_micro_batch_size_per_gpu,
                     v.gradient_accumulation_steps
  local derived
  -- DeepSpeed's rule (runtime/config.py, _set_batch_related_parameters),
  -- with its integer divisions.
  if tb and mb and ga then
    -- all three given: nothing to derive, they must agree
  elseif tb and mb then
    ga = math.floor(math.floor(tb / mb) / world)
    derived = ("gradient_accumulation_steps = train_batch_size // " ..
               "train_micro_batch_size_per_gpu // world size")
  elseif tb and ga then
    mb = math.floor(math.floor(tb / world) / ga)
    derived = ("train_micro_batch_size_per_gpu = train_batch_size // world size // " ..
               "gradient_accumulation_steps")
  elseif mb and ga then
    tb = mb * ga * world
  elseif tb then
    ga, mb = 1, math.floor(tb / world)
    derived = "gradient_accumulation_steps = 1, train_micro_batch_size_per_gpu = " ..
              "train_batch_size // world size"
  elseif mb then
    tb, ga = mb * world, 1
  else
    fail("set train_batch_size or train_micro_batch_size_per_gpu (or --micro-batch); " ..
         "DeepSpeed needs one of them")
  end
  local hint = derived and ("; " .. derived) or ""
  if notes.batch then
    hint = hint .. ("; %s %s the file"):format(notes.batch,
                                              notes.batch:find(",", 1, true) and "override" or
                                              "overrides")
  end
  if v.train_batch_size and v.train_micro_batch_size_per_gpu and v.gradient_accumulation_steps then
    -- (the three given fix the world size: a run on other ranks, a restart
    -- on fewer, needs one left out)
    hint = hint .. "; all three are given, so one world size fits: leave one out and it " ..
           "follows from the other two and the world size"
  end
  if mb < 1 or ga < 1 then
    fail("train_batch_size %d is too small for world size %d: it gives " ..
         "train_micro_batch_size_per_gpu %d, gradient_accumulation_steps %d%s",
         tb, world, mb, ga, hint)
  end
  if tb ~= mb * ga * world then
    fail("train_batch_size %d != train_micro_batch_size_per_gpu %d * " ..
         "gradient_accumulation_steps %d * world size %d (= %d)%s",
         tb, mb, ga, world, mb * ga * world, hint)
  end
  cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu = tb, mb
  cfg.gradient_accumulation_steps = ga
end

-- The optimizer block: its type from the optimizer table (DeepSpeed
-- matches its own optimizer names case-insensitively), its params against
-- that optimizer's schema (optim/schema.lua).
local function optimizer_section(raw, cfg, unimpl)
  if not given(raw) then return end
  block("optimizer", raw)
  local t = raw.type
  if type(t) ~= "string" then
    fail("optimizer.type must be %s (got %s)", optimizers.types_text(true, "or"), show(t))
  end
  local class, spelling = optimizers.find(t)
  if not class then
    fail("optimizer.type %s is not available; luazero has %s", show(t),
         optimizers.types_text(true, "and"))
  end
  for _, k in ipairs(sorted_keys(raw)) do
    if k ~= "type" and k ~= "params" then
      values.refuse_misspelt(k, { type = true, params = true }, "optimizer.")
      unimpl[#unimpl + 1] = "optimizer." .. k
    end
  end
  local p = given(raw.params) and block("optimizer.params", raw.params) or {}
  local params, extra = optim_schema.read(class, p, "optimizer.params.", spelling,
                                          function(k) unimpl[#unimpl + 1] = k end)
  cfg.optimizer = { type = spelling, params = params }
  for k, v in pairs(extra) do cfg.optimizer[k] = v end
end

local fp16_keys = { enabled = true, consecutive_hysteresis = true, loss_scale = true,
                    initial_scale_power = true, loss_scale_window = true, hysteresis = true,
                    min_loss_scale = true, fused_mode = true }

local function fp16_section(raw, cfg, unimpl)
  local out = deep_copy(M.fp16_defaults)
  if given(raw) then
    block("fp16", raw)
    local k = "fp16."
    for _, name in ipairs(sorted_keys(raw)) do
      local v = raw[name]
      if not given(v) then
        -- default stays
      elseif name == "enabled" or name == "consecutive_hysteresis" then
        out[name] = boolean(k .. name, v)
      elseif name == "loss_scale" then
        out.loss_scale = number_at_least(k .. name, v, 0)
      elseif name == "initial_scale_power" then
        out.initial_scale_power = whole_at_least(k .. name, v, 0)
        if out.initial_scale_power > 127 then -- (2^128 is past fp32's range: an inf scale)
          fail("%sinitial_scale_power must be at most 127 (got %s): 2^%s is past fp32's range; " ..
               "DeepSpeed's default is 16", k, show(v), show(v))
        end
      elseif name == "loss_scale_window" or name == "hysteresis" then
        out[name] = whole_at_least(k .. name, v, 1)
      elseif name == "min_loss_scale" then
        if type(v) ~= "number" or not (v > 0) then
          fail("%smin_loss_scale must be a number > 0 (got %s)", k, show(v))
        end
        out.min_loss_scale = v
      else -- (a misspelling is refused whatever its value)
        values.refuse_misspelt(name, fp16_keys, k, { auto_cast = true,
                               fp16_master_weights_and_grads = true })
        if not (v == false or (name == "fused_mode" and v == true)) then
          unimpl[#unimpl + 1] = k .. name
        end
      end
    end
  end
  if out.enabled and out.loss_scale == 0 and out.min_loss_scale > 2 ^ out.initial_scale_power then
    fail("fp16.min_loss_scale (%s) is above the starting scale 2^initial_scale_power (%s), so " ..
         "an overflow would raise the scale; lower min_loss_scale or raise initial_scale_power",
         show(out.min_loss_scale), show(2 ^ out.initial_scale_power))
  end
  if not out.enabled and given(raw) then
    for _, name in ipairs({ "loss_scale", "initial_scale_power", "loss_scale_window",
                            "hysteresis", "min_loss_scale", "consecutive_hysteresis" }) do
      if given(raw[name]) then
        cfg.no_effect[#cfg.no_effect + 1] = ("fp16.%s (the loss scaler runs only with " ..
                                             "fp16.enabled true)"):format(name)
      end
    end
  end
  cfg.fp16 = out
end

local function bf16_section(raw, cfg, unimpl, name)
  local out = { enabled = false }
  if given(raw) then
    block(name, raw)
    for _, k in ipairs(sorted_keys(raw)) do
      local v = raw[k]
      if k == "enabled" then
        if given(v) then out.enabled = boolean(name .. ".enabled", v) end
      -- (immediate_grad_update false: micro-steps' gradients added up in bf16
      -- before the fp32 ones, which this engine does not do)
      else
        values.refuse_misspelt(k, { enabled = true, immediate_grad_update = true }, name .. ".",
                               { check_grad_overflow = true })
        if not ((v == false and k ~= "immediate_grad_update") or v == cjson.null or
                (k == "immediate_grad_update" and v == true)) then
          unimpl[#unimpl + 1] = name .. "." .. k
        end
      end
    end
  end
  cfg.bf16 = out
end

-- data_types: grad_accum_dtype, the dtype the gradients are kept (and
-- accumulated, reduced) in: "fp32" (the default) or the working dtype.
local grad_dtypes = { fp32 = true, bf16 = true, fp16 = true }
local function data_types_section(raw, cfg, unimpl)
  cfg.grad_accum_dtype = "fp32"
  if not given(raw) then return end
  block("data_types", raw)
  for _, k in ipairs(sorted_keys(raw)) do
    local v = raw[k]
    if k == "grad_accum_dtype" then
      if given(v) then
        if type(v) ~= "string" or not grad_dtypes[v] then
          fail("data_types.grad_accum_dtype must be fp32, bf16 or fp16 (got %s)", show(v))
        end
        if v ~= "fp32" and v ~= cfg.dtype then
          fail("data_types.grad_accum_dtype is %s but the working dtype is %s; " ..
               "it must be fp32 or the working dtype", v, cfg.dtype)
        end
        cfg.grad_accum_dtype = v
      end
    else
      values.refuse_misspelt(k, { grad_accum_dtype = true }, "data_types.")
      if not asks_for_nothing(v) then unimpl[#unimpl + 1] = "data_types." .. k end
    end
  end
end

-- activation_checkpointing: how checkpointing works once it is on. In
-- DeepSpeed the model's code turns it on (deepspeed.checkpointing.checkpoint);
-- here --checkpoint-activations (initialize's checkpoint_activations) does.
-- Settings that cannot act here go to cfg.no_effect with the reason.
local function activation_checkpointing_section(raw, cfg, unimpl)
  local out = deep_copy(M.activation_checkpointing_defaults)
  cfg.activation_checkpointing = out
  cfg.activation_checkpointing_given = given(raw)
  if not given(raw) then return end
  local key = "activation_checkpointing."
  block("activation_checkpointing", raw)
  for _, k in ipairs(sorted_keys(raw)) do
    local v = raw[k]
    if k == "number_checkpoints" then
      if given(v) then out.number_checkpoints = whole_at_least(key .. k, v, 1) end
    elseif type(M.activation_checkpointing_defaults[k]) == "boolean" then
      if given(v) then out[k] = boolean(key .. k, v) end
    else
      local known = { number_checkpoints = true }
      for d in pairs(M.activation_checkpointing_defaults) do known[d] = true end
      values.refuse_misspelt(k, known, key)
      if not asks_for_nothing(v) then unimpl[#unimpl + 1] = key .. k end
    end
  end
  local notes = cfg.no_effect
  if out.partition_activations then
    notes[#notes + 1] = key .. "partition_activations (it splits checkpoints across the " ..
                        "model-parallel group; without model parallelism that group is each rank alone)"
  end
  if out.synchronize_checkpoint_boundary then
    notes[#notes + 1] = key .. "synchronize_checkpoint_boundary (CPU kernels run " ..
                        "synchronously: every checkpoint boundary is synchronized already)"
  end
  if out.number_checkpoints and not out.contiguous_memory_optimization then
    notes[#notes + 1] = key .. "number_checkpoints (it sizes the buffer of " ..
                        "contiguous_memory_optimization, which is off)"
  end
end

-- Offload keys that configure only the NVMe swap files.
local nvme_only = { "nvme_path", "buffer_count", "buffer_size", "pipeline_read", "pipeline_write" }

local function offload_block(key, raw, defaults, unimpl, notes)
  local out = deep_copy(defaults)
  if not given(raw) then return out end
  block(key, raw)
  -- (a key DeepSpeed's block does not have, a misspelt one among them, is
  -- reported with the keys not implemented, never stored)
  local unknown, known = {}, sorted_keys(defaults)
  known[#known + 1] = "nvme_path"
  table.sort(known)
  local known_set = {}
  for _, k in ipairs(known) do known_set[k] = true end
  known_set.device = true
  for _, k in ipairs(sorted_keys(raw)) do
    if k ~= "device" and k ~= "nvme_path" and defaults[k] == nil then
      values.refuse_misspelt(k, known_set, key .. ".")
      unimpl[#unimpl + 1] = ("%s.%s%s"):format(key, k, next(unknown) and "" or
        (" (not a key of %s, which has %s)"):format(key:match("[^.]+$"), table.concat(known, ", ")))
      unknown[k] = true
    end
  end
  for _, k in ipairs(sorted_keys(raw)) do
    local v = raw[k]
    if given(v) and not unknown[k] then
      if k == "device" then
        -- The tiers are the store kinds' table (zero/store/).
        if type(v) ~= "string" or not store.of_config(v) then
          fail('%s.device must be %s (got %s)', key, store.config_names(true), show(v))
        end
      elseif k == "nvme_path" then
        if type(v) ~= "string" then fail("%s.nvme_path must be a path (got %s)", key, show(v)) end
        if v == "" then
          fail('%s.nvme_path is "" (no folder); give the folder the swap files go to', key)
        end
      elseif k == "ratio" then
        if type(v) ~= "number" or v < 0 or v > 1 then
          fail("%s.ratio must be a number in [0, 1] (got %s)", key, show(v))
        end
      elseif k == "buffer_count" or k == "buffer_size" then
        -- no buffer (or an empty one) would stage nothing: DeepSpeed's asserts too
        whole_at_least(key .. "." .. k, v, 1)
      elseif type(defaults[k]) == "number" then
        whole_at_least(key .. "." .. k, v, 0)
      elseif type(defaults[k]) == "boolean" then
        boolean(key .. "." .. k, v)
      end
      out[k] = v
    end
  end
  if not store.of_config(out.device).resident then
    if not out.nvme_path then
      fail('%s.nvme_path is required with "device": "%s"', key, out.device)
    end
    M.check_writable_dir(key .. ".nvme_path", out.nvme_path)
  elseif out.device == "none" then
    for _, k in ipairs(sorted_keys(raw)) do
      if k ~= "device" and given(raw[k]) and not unknown[k] then
        notes[#notes + 1] = ('%s.%s (nothing is offloaded: "device" is "none")'):format(key, k)
      end
    end
  else
    for _, k in ipairs(nvme_only) do
      if given(raw[k]) then
        notes[#notes + 1] = ('%s.%s (it configures the NVMe swap files; "device" is "%s")')
                            :format(key, k, out.device)
      end
    end
  end
  -- Partial offload (ratio < 1) and a CPU cache of NVMe parameters are
  -- read but not acted on.
  if given(raw.ratio) and raw.ratio ~= 1 then unimpl[#unimpl + 1] = key .. ".ratio" end
  if given(raw.max_in_cpu) then unimpl[#unimpl + 1] = key .. ".max_in_cpu" end
  return out
end

-- A directory this process can create files in; else an error naming key.
function M.check_writable_dir(key, path)
  local probe = ("%s/.luazero-probe-%d"):format(path, math.random(1, 2 ^ 30))
  local ok, err = pcall(function() require("luazero.io.atomic").open(probe):abort() end)
  if not ok then
    local why = tostring(err):match("%((.-)%)") or tostring(err)
    fail("%s: cannot create a file in %s (%s); point it at an existing, writable directory",
         key, path, why)
  end
end

local function aio_section(raw, cfg, unimpl)
  local out = deep_copy(M.aio_defaults)
  cfg.aio = out
  if not given(raw) then return end
  block("aio", raw)
  for _, k in ipairs(sorted_keys(raw)) do
    local v = raw[k]
    if M.aio_defaults[k] == nil then
      -- Newer DeepSpeed keys (use_gds, intra_op_parallelism, ...): reported
      -- unless they ask for nothing.
      if not asks_for_nothing(v) then unimpl[#unimpl + 1] = "aio." .. k end
    elseif given(v) then
      if type(M.aio_defaults[k]) == "boolean" then
        out[k] = boolean("aio." .. k, v)
      else
        out[k] = positive_whole("aio." .. k, v)
      end
    end
  end
  if out.block_size % 4096 ~= 0 then
    fail("aio.block_size must be a multiple of 4096 (got %s): O_DIRECT transfers whole " ..
         "4 KiB blocks", show(out.block_size))
  end
  -- (the swap files' limits, core/io/swap.c, checked here before any work)
  for k, most in pairs({ queue_depth = 1024, thread_count = 64 }) do
    if out[k] > most then fail("aio.%s must be 1..%d (got %s)", k, most, show(out[k])) end
  end
end

-- Keys that tune stage 3's parameter gathers only.
local stage3_tuning = { "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                        "stage3_max_live_parameters", "stage3_max_reuse_distance" }

local function zero_section(raw, cfg, unimpl)
  local out = {}
  for k, v in pairs(M.zero_defaults) do out[k] = v end
  local z = "zero_optimization."
  if type(raw) == "boolean" then
    -- DeepSpeed's deprecated form: "zero_optimization": true means stage 1.
    raw = { stage = raw and 1 or 0 }
  end
  raw = given(raw) and block("zero_optimization", raw) or {}
  if given(raw.stage) then
    local s = raw.stage
    if s ~= "auto" and not (is_whole(s) and s >= 0 and s <= 3) then
      fail('%sstage must be 0..3 or "auto" (got %s)', z, show(s))
    end
    out.stage = s
  elseif raw.stage == "auto" then
    out.stage = "auto"
  end
  for _, k in ipairs({ "reduce_bucket_size", "allgather_bucket_size", "sub_group_size" }) do
    if given(raw[k]) then out[k] = positive_whole(z .. k, raw[k]) end
  end
  -- (stage3_prefetch_bucket_size 0: no prefetch, as DeepSpeed reads it)
  for _, k in ipairs({ "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                       "stage3_max_live_parameters", "stage3_max_reuse_distance" }) do
    if given(raw[k]) then out[k] = whole_at_least(z .. k, raw[k], 0) end
  end
  for _, k in ipairs({ "overlap_comm", "contiguous_gradients", "reduce_scatter" }) do
    if given(raw[k]) then out[k] = boolean(z .. k, raw[k]) end
  end
  -- A 16-bit Hugging Face export beside each checkpoint (DeepSpeed's older
  -- name: stage3_gather_fp16_weights_on_model_save).
  out.gather_16bit_weights_on_model_save = false
  for _, k in ipairs({ "stage3_gather_16bit_weights_on_model_save",
                       "stage3_gather_fp16_weights_on_model_save" }) do
    if given(raw[k]) and boolean(z .. k, raw[k]) then
      out.gather_16bit_weights_on_model_save = true
    end
  end
  out.overlap_comm_given = out.overlap_comm ~= nil
  -- DeepSpeed's deprecated "cpu_offload": true is offload_optimizer on the CPU.
  for _, k in ipairs({ "cpu_offload", "cpu_offload_param" }) do
    if given(raw[k]) then boolean(z .. k, raw[k]) end
  end
  -- (spelt: the key the file wrote, for errors)
  local opt_raw = raw.offload_optimizer
  out.spelt = {}
  if raw.cpu_offload == true and not given(opt_raw) then
    opt_raw, out.spelt.offload_optimizer = { device = "cpu" }, "cpu_offload"
  end
  local param_raw = raw.offload_param
  if raw.cpu_offload_param == true and not given(param_raw) then
    param_raw, out.spelt.offload_param = { device = "cpu" }, "cpu_offload_param"
  end
  out.offload_optimizer = offload_block(z .. "offload_optimizer", opt_raw,
                                        M.offload_optimizer_defaults, unimpl, cfg.no_effect)
  out.offload_param = offload_block(z .. "offload_param", param_raw, M.offload_param_defaults,
                                    unimpl, cfg.no_effect)
  -- The stage-3 tuning keys given, noted once the stage is known (set_stage).
  out.stage3_given = {}
  for _, k in ipairs(stage3_tuning) do
    if given(raw[k]) then out.stage3_given[#out.stage3_given + 1] = k end
  end
  local handled = { stage = true, offload_optimizer = true, offload_param = true,
                    cpu_offload = true, cpu_offload_param = true, overlap_comm = true,
                    contiguous_gradients = true, reduce_scatter = true,
                    stage3_gather_16bit_weights_on_model_save = true,
                    stage3_gather_fp16_weights_on_model_save = true }
  -- hpZ (a secondary partition of the parameters within a node): its size 1
  -- (DeepSpeed's default, no secondary partition) is what luazero does.
  if raw.zero_hpz_partition_size == 1 then handled.zero_hpz_partition_size = true end
  for k in pairs(M.zero_defaults) do handled[k] = true end
  for _, k in ipairs(sorted_keys(raw)) do
    local v = raw[k]
    if not handled[k] then
      values.refuse_misspelt(k, handled, z, M.deepspeed_zero_keys)
      if not asks_for_nothing(v) and not (zero_default_ok[k] and v == true) then
        unimpl[#unimpl + 1] = z .. k
      end
    end
  end
  cfg.zero_optimization = out
  M.set_stage(cfg, out.stage)
end

-- Fills what depends on the stage (overlap_comm: DeepSpeed's default is true
-- at stage 3, false below). Call again once "auto" is resolved.
function M.set_stage(cfg, stage)
  local z = cfg.zero_optimization
  z.stage = stage
  if stage ~= "auto" and stage < 3 and z.stage3_given then
    for _, k in ipairs(z.stage3_given) do
      cfg.no_effect[#cfg.no_effect + 1] = ("zero_optimization.%s (it tunes stage 3's " ..
        "parameter gathers; the stage is %d)"):format(k, stage)
    end
    z.stage3_given = nil
  end
  if stage ~= "auto" then
    for _, key in ipairs({ "offload_optimizer", "offload_param" }) do
      local rule = Placement.offload_stages[key]
      if Placement.offloaded(z[key].device) and not Placement.stage_allows(key, stage) then
        -- (named as given: --stage, and cpu_offload where the file wrote it)
        local spelt = z.spelt and z.spelt[key] or key
        if cfg.overrides and cfg.overrides.stage ~= nil then
          fail("--stage %s: zero_optimization.%s needs %s; give --stage %s, or remove %s from " ..
               "the config", show(stage), spelt, rule.names,
               rule.least == 3 and "3" or "1, 2 or 3", spelt)
        end
        fail("zero_optimization.%s needs %s (got stage %s); set %s or remove %s", spelt,
             rule.names, show(stage), rule.set, spelt)
      end
    end
  end
  if not z.overlap_comm_given then
    if stage == "auto" then z.overlap_comm = nil else z.overlap_comm = stage == 3 end
  end
  return cfg
end

------------------------------------------------------------------ overrides

-- Overrides come from command-line flags; each names its flag in errors.
local override_flags = {
  stage = "--stage", dtype = "--dtype", micro_batch = "--micro-batch",
  grad_accum = "--grad-accum", train_batch = "--train-batch", lr = "--lr",
  gradient_clipping = "--gradient-clipping", warmup = "--warmup",
  total_steps = "--steps", memory_budget = "--memory-budget",
  auto = "the trainer's values for \"auto\"",
}
M.override_flags = override_flags

local function apply_overrides(raw, ov, notes)
  for k in pairs(ov) do
    if not override_flags[k] then
      error(("config: unknown override '%s' (known: %s)"):format(k,
            table.concat(sorted_keys(override_flags), ", ")), 0)
    end
  end
  local function section(name)
    if type(raw[name]) ~= "table" then raw[name] = {} end
    return raw[name]
  end
  if ov.stage ~= nil then
    local s = ov.stage
    if s ~= "auto" then s = tonumber(s) end
    if not (s == "auto" or (is_whole(s) and s >= 0 and s <= 3)) then
      fail('--stage must be 0..3 or "auto" (got %s)', tostring(ov.stage))
    end
    section("zero_optimization").stage = s
  end
  if ov.dtype ~= nil then
    local d = ov.dtype
    if d ~= "fp32" and d ~= "bf16" and d ~= "fp16" then
      fail("--dtype must be fp32, bf16 or fp16 (got %s)", tostring(d))
    end
    section("fp16").enabled = d == "fp16"
    if raw.bfloat16 ~= nil and raw.bf16 == nil then raw.bf16, raw.bfloat16 = raw.bfloat16, nil end
    section("bf16").enabled = d == "bf16"
  end
  local batch = {}
  for _, m in ipairs({ { "train_batch", "train_batch_size" },
                       { "micro_batch", "train_micro_batch_size_per_gpu" },
                       { "grad_accum", "gradient_accumulation_steps" } }) do
    local v = ov[m[1]]
    if v ~= nil then
      if not is_whole(v) or v < 1 then
        fail("%s must be a whole number >= 1 (got %s)", override_flags[m[1]], show(v))
      end
      raw[m[2]] = v
      batch[#batch + 1] = override_flags[m[1]]
    end
  end
  if #batch > 0 then notes.batch = table.concat(batch, ", ") end
  if ov.lr ~= nil then
    if type(ov.lr) ~= "number" or not (ov.lr >= 0) then
      fail("--lr must be a number >= 0 (got %s)", show(ov.lr))
    end
    if given(raw.optimizer) then
      local o = block("optimizer", raw.optimizer)
      if type(o.params) ~= "table" then o.params = {} end
      o.params.lr = ov.lr
    end
  end
  if ov.gradient_clipping ~= nil then raw.gradient_clipping = ov.gradient_clipping end
  if ov.warmup ~= nil then whole_at_least("--warmup", ov.warmup, 0) end
  if ov.total_steps ~= nil then whole_at_least("--steps", ov.total_steps, 1) end
end

------------------------------------------------------------------ memory budget

-- "12GiB", "512 MiB", "8G" (binary), "16GB" (decimal), "1.5e9" or a number:
-- bytes. nil and an error message when it is none of these.
function M.parse_bytes(v)
  if type(v) == "number" then
    if v > 0 and v == v and v ~= math.huge then return math.floor(v) end
    return nil, "must be a positive number of bytes"
  end
  if type(v) ~= "string" then return nil, "must be bytes: a number or a string like \"12GiB\"" end
  local num, unit = v:match("^%s*([%d%.eE%+%-]+)%s*(%a*)%s*$")
  local n = tonumber(num)
  local scale = ({ [""] = 1, B = 1, K = 2 ^ 10, KiB = 2 ^ 10, M = 2 ^ 20, MiB = 2 ^ 20,
                   G = 2 ^ 30, GiB = 2 ^ 30, T = 2 ^ 40, TiB = 2 ^ 40, KB = 1e3, MB = 1e6,
                   GB = 1e9, TB = 1e12 })[unit or ""]
  if not n or not scale or n <= 0 then
    return nil, "must be bytes: a number or a string like \"12GiB\", \"512MiB\", \"16GB\""
  end
  return math.floor(n * scale)
end

-- The per-rank memory "stage": "auto" may use, and where that number came
-- from: --memory-budget, then LZ_MEMORY_BUDGET, then luazero.memory_budget of
-- the file, then what this process may take (io/memory.lua: MemAvailable, or
-- a memory cgroup's or ulimit -v's room where less) divided among the ranks
-- of this machine (local_ranks, default the world size).
function M.memory_budget(cfg, local_ranks)
  if cfg.memory_budget_source == "--memory-budget" then
    return cfg.memory_budget, cfg.memory_budget_source
  end
  local env = os.getenv("LZ_MEMORY_BUDGET")
  if env and env ~= "" then
    local b, err = M.parse_bytes(env)
    if not b then fail("LZ_MEMORY_BUDGET=%s %s", env, err) end
    return b, "LZ_MEMORY_BUDGET"
  end
  if cfg.memory_budget then return cfg.memory_budget, cfg.memory_budget_source end
  local avail, from = require("luazero.io.memory").available(local_ranks or cfg.world_size or 1)
  if not avail then
    fail("cannot read MemAvailable from /proc/meminfo; set luazero.memory_budget, " ..
         "LZ_MEMORY_BUDGET or --memory-budget")
  end
  return avail, from
end

local function luazero_section(raw, cfg, ov)
  if given(raw) then
    block("luazero", raw)
    for _, k in ipairs(sorted_keys(raw)) do
      if k ~= "memory_budget" then
        fail("luazero.%s is not a luazero key (known: memory_budget)", k)
      end
    end
    if given(raw.memory_budget) then
      local b, err = M.parse_bytes(raw.memory_budget)
      if not b then fail("luazero.memory_budget %s (got %s)", err, show(raw.memory_budget)) end
      cfg.memory_budget, cfg.memory_budget_source = b, "luazero.memory_budget"
    end
  end
  if ov.memory_budget ~= nil then
    local b, err = M.parse_bytes(ov.memory_budget)
    if not b then fail("--memory-budget %s (got %s)", err, tostring(ov.memory_budget)) end
    cfg.memory_budget, cfg.memory_budget_source = b, "--memory-budget"
  end
end

------------------------------------------------------------------ load

local handled_top = {
  train_batch_size = true, train_micro_batch_size_per_gpu = true,
  gradient_accumulation_steps = true, gradient_clipping = true, optimizer = true,
  scheduler = true, fp16 = true, bf16 = true, bfloat16 = true, zero_optimization = true,
  luazero = true, data_types = true, aio = true, activation_checkpointing = true,
}

-- Every top-level key luazero reads (for a misspelt one's suggestion).
local top_known = {}
for _, t in ipairs({ handled_top, accepted_top, monitor.top_keys, checkpoint.top_keys,
                     moe.top_keys }) do
  for k in pairs(t) do top_known[k] = true end
end

-- source: a path to a JSON file, a table (an already decoded config), or nil
-- (no file: DeepSpeed's defaults and the overrides). world_size: ranks (1).
-- overrides: { stage, dtype, micro_batch, grad_accum, train_batch, lr,
-- gradient_clipping, warmup, total_steps, memory_budget } from flags; they
-- win over the file. Returns the normalised configuration.
function M.load(source, world_size, overrides)
  world_size = world_size or 1
  if not is_whole(world_size) or world_size < 1 then
    error("config: world size must be a whole number >= 1 (got " .. show(world_size) .. ")", 0)
  end
  local raw, name
  if type(source) == "string" then
    raw, name = read_json(source), source
  elseif type(source) == "table" then
    raw, name = deep_copy(source), "(table)"
  elseif source == nil then
    raw, name = {}, "(defaults)"
  else
    error("config: config.load takes a path, a table or nil (got " .. type(source) .. ")", 0)
  end
  local original = deep_copy(raw)
  local ov, notes = overrides or {}, {}
  apply_overrides(raw, ov, notes)
  local filled = {}
  auto.fill(raw, ov.auto or {}, filled)

  local cfg = { source = name, world_size = world_size, raw = original,
                overrides = deep_copy(ov), auto_filled = filled }
  local unimpl = {}
  cfg.no_effect = {}
  cfg.gradient_clipping = M.gradient_clipping_default
  if given(raw.gradient_clipping) then
    cfg.gradient_clipping = number_at_least("gradient_clipping", raw.gradient_clipping, 0)
  end
  optimizer_section(raw.optimizer, cfg, unimpl)
  scheduler.read(raw.scheduler, cfg, unimpl, ov)
  fp16_section(raw.fp16, cfg, unimpl)
  -- "bfloat16" is DeepSpeed's older name of "bf16".
  if raw.bf16 ~= nil then
    bf16_section(raw.bf16, cfg, unimpl, "bf16")
  else
    bf16_section(raw.bfloat16, cfg, unimpl, "bfloat16")
  end
  if cfg.fp16.enabled and cfg.bf16.enabled then
    fail("fp16.enabled and bf16.enabled are both true; enable at most one")
  end
  cfg.dtype = cfg.fp16.enabled and "fp16" or (cfg.bf16.enabled and "bf16" or "fp32")
  data_types_section(raw.data_types, cfg, unimpl)
  zero_section(raw.zero_optimization, cfg, unimpl)
  aio_section(raw.aio, cfg, unimpl)
  activation_checkpointing_section(raw.activation_checkpointing, cfg, unimpl)
  luazero_section(raw.luazero, cfg, ov)
  monitor.read(raw, cfg, unimpl)
  checkpoint.read(raw, cfg, unimpl)
  moe.read(raw, cfg, unimpl)
  batch_sizes(raw, world_size, cfg, notes)
  -- (not implemented, but a value DeepSpeed refuses is refused here too)
  local cdt = raw.communication_data_type
  if given(cdt) and not (cdt == "fp32" or cdt == "fp16" or cdt == "bf16" or cdt == "bfp16") then
    fail('communication_data_type must be "fp32", "fp16" or "bf16" (got %s)', show(cdt))
  end

  for _, k in ipairs(sorted_keys(raw)) do
    if not top_known[k] and not asks_for_nothing(raw[k]) and
       not (k == "gradient_predivide_factor" and raw[k] == 1) then
      unimpl[#unimpl + 1] = k .. values.did_you_mean(k, top_known)
    end
  end
  table.sort(unimpl)
  cfg.unimplemented = unimpl
  return cfg
end

M.auto_message = auto.message -- the start-up line of the "auto" values filled

-- The start-up line for keys that are read but not acted on; nil if none.
function M.unimplemented_message(cfg)
  if #cfg.unimplemented == 0 then return nil end
  return "config: not implemented (ignored): " .. table.concat(cfg.unimplemented, ", ")
end

-- The start-up line for settings that are read and valid but cannot act
-- on this machine or model, each with the reason; nil if none. skip: a
-- key prefix whose notes another line covers.
function M.no_effect_message(cfg, skip)
  local list = {}
  for _, note in ipairs(cfg.no_effect) do
    if not (skip and note:sub(1, #skip) == skip) then list[#list + 1] = note end
  end
  if #list == 0 then return nil end
  return "config: no effect here: " .. table.concat(list, "; ")
end

-- One line saying what the configuration asks for.
function M.summary(cfg)
  local z = cfg.zero_optimization
  local parts = {
    ("stage %s"):format(tostring(z.stage)),
    cfg.dtype .. (cfg.grad_accum_dtype ~= "fp32" and (" (grads " .. cfg.grad_accum_dtype .. ")") or ""),
    ("batch %d = %d micro x %d accum x %d rank%s"):format(cfg.train_batch_size,
      cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, cfg.world_size,
      cfg.world_size == 1 and "" or "s"),
    cfg.gradient_clipping > 0 and ("clipping %g"):format(cfg.gradient_clipping) or "no clipping",
  }
  if cfg.optimizer then parts[#parts + 1] = optimizers.describe(cfg.optimizer) end
  if cfg.scheduler then parts[#parts + 1] = cfg.scheduler.type end
  if cfg.moe.ep_size > 1 then parts[#parts + 1] = "moe.ep_size " .. cfg.moe.ep_size end
  return "config " .. cfg.source .. ": " .. table.concat(parts, ", ")
end

return M
