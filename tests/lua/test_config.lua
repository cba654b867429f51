-- test_config.lua — DeepSpeed's configuration (lua/luazero/config.lua):
-- defaults, the batch-size rule, errors naming the key or the file,
-- not-implemented keys, overrides, and the three schedules (optim/schedule.lua)
-- against numbers worked out by hand from DeepSpeed's lr_schedules.py.
local config = require("luazero.config")
local schedule = require("luazero.optim.schedule")

local T = {}
-- The end of a batch-size refusal where the file gives all three keys.
local ALL3 = "; all three are given, so one world size fits: leave one out and it follows " ..
             "from the other two and the world size"

local tmp = os.tmpname()
os.remove(tmp)
os.execute("mkdir -p '" .. tmp .. "'")

local function write_file(name, text)
  local path = tmp .. "/" .. name
  local f = assert(io.open(path, "wb"))
  f:write(text)
  f:close()
  return path
end

-- The error a load raises; fails when it loads.
local function load_error(source, world, overrides)
  local ok, err = pcall(config.load, source, world, overrides)
  assert(not ok, "expected an error, the config loaded")
  return tostring(err)
end

local function expect_error(source, world, expected, overrides)
  local err = load_error(source, world, overrides)
  assert(err == expected, ("\nexpected: %s\n     got: %s"):format(expected, err))
end

local function close(got, want, what)
  local tol = 1e-12 * math.max(1, math.abs(want))
  assert(math.abs(got - want) <= tol, ("%s: got %.17g, want %.17g"):format(what, got, want))
end

------------------------------------------------------------------ defaults

function T.defaults_are_deepspeeds()
  local cfg = config.load({ train_micro_batch_size_per_gpu = 1 }, 1)
  assert(cfg.train_batch_size == 1 and cfg.gradient_accumulation_steps == 1)
  assert(cfg.gradient_clipping == 0, "DeepSpeed's gradient_clipping default is 0 (off)")
  assert(cfg.dtype == "fp32" and cfg.fp16.enabled == false and cfg.bf16.enabled == false)
  local f = cfg.fp16
  assert(f.loss_scale == 0 and f.initial_scale_power == 16 and f.loss_scale_window == 1000 and
         f.hysteresis == 2 and f.min_loss_scale == 1 and f.consecutive_hysteresis == false)
  local z = cfg.zero_optimization
  assert(z.stage == 0 and z.reduce_bucket_size == 5e8 and z.allgather_bucket_size == 5e8)
  assert(z.overlap_comm == false and z.contiguous_gradients == true and z.reduce_scatter == true)
  assert(z.stage3_prefetch_bucket_size == 5e7 and z.stage3_param_persistence_threshold == 1e5)
  assert(z.stage3_max_live_parameters == 1e9 and z.stage3_max_reuse_distance == 1e9)
  assert(z.offload_optimizer.device == "none" and z.offload_param.device == "none")
  assert(cfg.optimizer == nil and cfg.scheduler == nil)
  assert(#cfg.unimplemented == 0 and config.unimplemented_message(cfg) == nil)
end

function T.overlap_comm_defaults_to_true_at_stage_3_only()
  for stage = 0, 3 do
    local cfg = config.load({ train_batch_size = 4, zero_optimization = { stage = stage } }, 2)
    assert(cfg.zero_optimization.overlap_comm == (stage == 3), "stage " .. stage)
  end
  local cfg = config.load({ train_batch_size = 4,
                            zero_optimization = { stage = 3, overlap_comm = false } }, 2)
  assert(cfg.zero_optimization.overlap_comm == false, "a given overlap_comm stays")
  cfg = config.load({ train_batch_size = 4, zero_optimization = { stage = "auto" } }, 2)
  assert(cfg.zero_optimization.stage == "auto" and cfg.zero_optimization.overlap_comm == nil)
  config.set_stage(cfg, 3)
  assert(cfg.zero_optimization.stage == 3 and cfg.zero_optimization.overlap_comm == true)
end

function T.optimizer_type_is_case_insensitive_with_fused_adam_defaults()
  local cfg = config.load({ train_batch_size = 1, optimizer = { type = "ADAM" } }, 1)
  local o = cfg.optimizer
  assert(o.type == "Adam" and o.params.lr == 1e-3 and o.params.betas[1] == 0.9 and
         o.params.betas[2] == 0.999 and o.params.eps == 1e-8 and o.params.weight_decay == 0)
  assert(o.decoupled_weight_decay == true, "DeepSpeed's Adam is AdamW unless adam_w_mode is false")
  -- Adam with L2 decay is another update: refused where the decay is not 0
  expect_error({ train_batch_size = 1, optimizer = { type = "adam", params = {
                 adam_w_mode = false, lr = 2e-4, weight_decay = 0.1 } } }, 1,
               "config: optimizer.params.adam_w_mode false asks for Adam with L2 weight decay " ..
               "(added to the gradient), which luazero does not have: its update decouples the " ..
               "decay (AdamW); drop adam_w_mode, or set weight_decay 0, where the two agree")
  cfg = config.load({ train_batch_size = 1, optimizer = { type = "adam",
                      params = { adam_w_mode = false, lr = 2e-4, betas = { 0.8, 0.95 } } } }, 1)
  o = cfg.optimizer
  assert(o.decoupled_weight_decay == false and o.params.lr == 2e-4 and o.params.betas[2] == 0.95
         and o.params.weight_decay == 0 and #cfg.unimplemented == 0)
  expect_error({ train_batch_size = 1, optimizer = { type = "Adam", params = { amsgrad = true } } },
               1, "config: optimizer.params.amsgrad true (AMSGrad) is not implemented, and the " ..
               "update would differ from the one asked for; set it false or drop it")
  expect_error({ train_batch_size = 1, optimizer = { type = "Adam",
                 params = { bias_correction = false } } }, 1,
               "config: optimizer.params.bias_correction false is not implemented (the update " ..
               "always corrects the moments' bias), and the update would differ; drop it")
  cfg = config.load({ train_batch_size = 1, optimizer = { type = "adamW",
                      params = { adam_w_mode = false } } }, 1)
  assert(cfg.optimizer.type == "AdamW" and cfg.optimizer.decoupled_weight_decay == true)
end

------------------------------------------------------------------ batch sizes

function T.batch_size_rule_at_world_sizes_1_2_4()
  local cases = {
    -- given                              -> {train, micro, accum} at world 1, 2, 4
    { { train_batch_size = 32, train_micro_batch_size_per_gpu = 4 },
      { { 32, 4, 8 }, { 32, 4, 4 }, { 32, 4, 2 } } },
    { { train_batch_size = 32, gradient_accumulation_steps = 2 },
      { { 32, 16, 2 }, { 32, 8, 2 }, { 32, 4, 2 } } },
    { { train_micro_batch_size_per_gpu = 4, gradient_accumulation_steps = 2 },
      { { 8, 4, 2 }, { 16, 4, 2 }, { 32, 4, 2 } } },
    { { train_batch_size = 32 }, { { 32, 32, 1 }, { 32, 16, 1 }, { 32, 8, 1 } } },
    { { train_micro_batch_size_per_gpu = 4 }, { { 4, 4, 1 }, { 8, 4, 1 }, { 16, 4, 1 } } },
  }
  for ci, c in ipairs(cases) do
    for wi, world in ipairs({ 1, 2, 4 }) do
      local cfg = config.load(c[1], world)
      local want = c[2][wi]
      local got = { cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
                    cfg.gradient_accumulation_steps }
      assert(got[1] == want[1] and got[2] == want[2] and got[3] == want[3],
             ("case %d world %d: got %d/%d/%d, want %d/%d/%d"):format(ci, world, got[1], got[2],
             got[3], want[1], want[2], want[3]))
    end
  end
  -- All three given: they must agree with the world size.
  local all = { train_batch_size = 16, train_micro_batch_size_per_gpu = 2,
                gradient_accumulation_steps = 2 }
  assert(config.load(all, 4).train_batch_size == 16)
  expect_error(all, 2, "config: train_batch_size 16 != train_micro_batch_size_per_gpu 2 * " ..
               "gradient_accumulation_steps 2 * world size 2 (= 8)" .. ALL3)
  expect_error(all, 1, "config: train_batch_size 16 != train_micro_batch_size_per_gpu 2 * " ..
               "gradient_accumulation_steps 2 * world size 1 (= 4)" .. ALL3)
end

function T.batch_sizes_that_do_not_divide_are_errors()
  -- DeepSpeed floors 10 // 4 // 1 = 2 and then fails its check.
  local err = load_error({ train_batch_size = 10, train_micro_batch_size_per_gpu = 4 }, 1)
  assert(err:find("config: train_batch_size 10 != train_micro_batch_size_per_gpu 4 * " ..
                  "gradient_accumulation_steps 2 * world size 1 (= 8)", 1, true), err)
  err = load_error({ train_batch_size = 2 }, 4)
  assert(err:find("config: train_batch_size 2 is too small for world size 4", 1, true), err)
  err = load_error({ gradient_accumulation_steps = 2 }, 1)
  assert(err:find("train_batch_size or train_micro_batch_size_per_gpu", 1, true), err)
  expect_error({ train_batch_size = 0 }, 1,
               "config: train_batch_size must be a whole number >= 1 (got 0)")
  expect_error({ train_micro_batch_size_per_gpu = 2.5 }, 1,
               "config: train_micro_batch_size_per_gpu must be a whole number >= 1 (got 2.5)")
end

------------------------------------------------------------------ bad values

function T.bad_configs_of_issue_5_name_the_key_or_file()
  expect_error({ train_batch_size = 8, zero_optimization = { stage = 4 } }, 1,
               'config: zero_optimization.stage must be 0..3 or "auto" (got 4)')
  expect_error({ train_batch_size = 32, train_micro_batch_size_per_gpu = 4,
                 gradient_accumulation_steps = 2 }, 2,
               "config: train_batch_size 32 != train_micro_batch_size_per_gpu 4 * " ..
               "gradient_accumulation_steps 2 * world size 2 (= 16)" .. ALL3)
  expect_error({ train_batch_size = 8, fp16 = { enabled = true }, bf16 = { enabled = true } }, 1,
               "config: fp16.enabled and bf16.enabled are both true; enable at most one")
  expect_error({ train_batch_size = 8, zero_optimization = { reduce_bucket_size = -5 } }, 1,
               "config: zero_optimization.reduce_bucket_size must be a positive number (got -5)")
  local bad = write_file("bad.json", '{ "train_batch_size": 8, }')
  local err = load_error(bad, 1)
  assert(err:find("config: " .. bad .. ": not valid JSON (", 1, true) and err:sub(-1) == ")", err)
  assert(not err:find("\n"), "one line")
  local bom = write_file("bom.json", '\239\187\191{ "train_batch_size": 8 }')
  expect_error(bom, 1, "config: " .. bom .. ": starts with a UTF-8 byte order mark (EF BB BF), " ..
                       "which JSON does not allow; save the file as UTF-8 without it")
  local missing = tmp .. "/missing.json"
  expect_error(missing, 1, "config: " .. missing .. ": cannot read it (No such file or directory)")
  local list = write_file("list.json", "[1, 2]")
  err = load_error(list, 1)
  assert(err:find("config: " .. list .. ": the top level must be a JSON object", 1, true), err)
end

function T.other_bad_values_name_the_key_and_allowed_values()
  local base = function(extra)
    local t = { train_batch_size = 8 }
    for k, v in pairs(extra) do t[k] = v end
    return t
  end
  expect_error(base({ zero_optimization = { stage = "two" } }), 1,
               'config: zero_optimization.stage must be 0..3 or "auto" (got "two")')
  expect_error(base({ zero_optimization = { allgather_bucket_size = 0 } }), 1,
               "config: zero_optimization.allgather_bucket_size must be a positive number (got 0)")
  -- stage3_prefetch_bucket_size 0 is DeepSpeed's "no prefetch"; below it, refused
  assert(config.load(base({ zero_optimization = { stage = 3, stage3_prefetch_bucket_size = 0 } }),
                     1).zero_optimization.stage3_prefetch_bucket_size == 0)
  expect_error(base({ zero_optimization = { stage3_prefetch_bucket_size = -1 } }), 1,
               "config: zero_optimization.stage3_prefetch_bucket_size must be a whole number " ..
               ">= 0 (got -1)")
  expect_error(base({ zero_optimization = { stage3_max_live_parameters = -1 } }), 1,
               "config: zero_optimization.stage3_max_live_parameters must be a whole number " ..
               ">= 0 (got -1)")
  expect_error(base({ zero_optimization = { overlap_comm = "yes" } }), 1,
               'config: zero_optimization.overlap_comm must be true or false (got "yes")')
  expect_error(base({ zero_optimization = { offload_optimizer = { device = "gpu" } } }), 1,
               'config: zero_optimization.offload_optimizer.device must be "none", "cpu" or ' ..
               '"nvme" (got "gpu")')
  expect_error(base({ gradient_clipping = -1 }), 1,
               "config: gradient_clipping must be a number >= 0 (got -1)")
  expect_error(base({ gradient_clipping = math.huge }), 1,
               "config: gradient_clipping must be a finite number >= 0 (got inf)")
  expect_error(base({ optimizer = { type = "Lamb" } }), 1,
               'config: optimizer.type "Lamb" is not available; luazero has "Adam", "AdamW", "Lion", "Muon", "AdamW8bit" and "Adam8bit"')
  expect_error(base({ optimizer = { type = "Adam", params = { betas = { 0.9 } } } }), 1,
               "config: optimizer.params.betas must be a list of two numbers in [0, 1), " ..
               "e.g. [0.9, 0.999] (got [0.9])")
  local err = load_error(base({ optimizer = { type = "Adam", params = { max_grad_norm = 1 } } }), 1)
  assert(err:find("use the top-level gradient_clipping", 1, true), err)
  expect_error(base({ scheduler = { type = "OneCycle" } }), 1,
               'config: scheduler.params.cycle_min_lr is required by OneCycle (a number >= 0: ' ..
               'the learning rate the cycle starts and ends at)')
  expect_error(base({ scheduler = { type = "WarmupLR", params = { warmup_type = "cubic" } } }), 1,
               'config: scheduler.params.warmup_type must be "log" or "linear" (got "cubic")')
  expect_error(base({ scheduler = { type = "WarmupDecayLR", params = {} } }), 1,
               "config: scheduler.params.total_num_steps is required by WarmupDecayLR " ..
               "(a whole number >= 1: the optimizer steps of the run)")
  expect_error(base({ scheduler = { type = "WarmupCosineLR",
                                    params = { total_num_steps = 10, warmup_max_lr = 1 } } }), 1,
               "config: scheduler.params.warmup_max_lr is not a parameter of WarmupCosineLR " ..
               "(it takes cos_min_ratio, total_num_steps, warmup_min_ratio, warmup_num_steps, " ..
               "warmup_type)")
  expect_error(base({ fp16 = { enabled = true, loss_scale_window = 0 } }), 1,
               "config: fp16.loss_scale_window must be a whole number >= 1 (got 0)")
  expect_error(base({ fp16 = { min_loss_scale = 0 } }), 1,
               "config: fp16.min_loss_scale must be a number > 0 (got 0)")
  expect_error(base({ fp16 = { enabled = true, initial_scale_power = 1100 } }), 1,
               "config: fp16.initial_scale_power must be at most 127 (got 1100): 2^1100 is past " ..
               "fp32's range; DeepSpeed's default is 16")
  expect_error(base({ fp16 = { enabled = true, initial_scale_power = 0, min_loss_scale = 64 } }), 1,
               "config: fp16.min_loss_scale (64) is above the starting scale 2^initial_scale_power " ..
               "(1), so an overflow would raise the scale; lower min_loss_scale or raise " ..
               "initial_scale_power")
  expect_error(base({ luazero = { budget = 1 } }), 1,
               "config: luazero.budget is not a luazero key (known: memory_budget)")
  expect_error(base({}), 1, 'config: --stage must be 0..3 or "auto" (got 5)', { stage = 5 })
  expect_error(base({}), 1, "config: --dtype must be fp32, bf16 or fp16 (got f8)", { dtype = "f8" })
end

------------------------------------------------------------------ activation checkpointing

function T.activation_checkpointing_defaults_values_and_errors()
  local cfg = config.load({ train_batch_size = 8 }, 1)
  local ac = cfg.activation_checkpointing
  assert(ac.partition_activations == false and ac.cpu_checkpointing == false and
         ac.contiguous_memory_optimization == false and ac.number_checkpoints == nil and
         ac.synchronize_checkpoint_boundary == false and ac.profile == false,
         "DeepSpeed's defaults")
  assert(not cfg.activation_checkpointing_given and config.no_effect_message(cfg) == nil)
  cfg = config.load({ train_batch_size = 8, activation_checkpointing = {
    cpu_checkpointing = true, contiguous_memory_optimization = true, number_checkpoints = 12,
    profile = true, partition_activations = false, synchronize_checkpoint_boundary = false } }, 1)
  ac = cfg.activation_checkpointing
  assert(ac.cpu_checkpointing and ac.contiguous_memory_optimization and ac.profile)
  assert(ac.number_checkpoints == 12 and cfg.activation_checkpointing_given)
  assert(#cfg.unimplemented == 0 and config.no_effect_message(cfg) == nil)
  -- null is "not given": the default stays.
  local cjson = require("cjson")
  cfg = config.load({ train_batch_size = 8, activation_checkpointing = {
    number_checkpoints = cjson.null, profile = cjson.null } }, 1)
  assert(cfg.activation_checkpointing.number_checkpoints == nil)
  assert(cfg.activation_checkpointing.profile == false)
  -- Valid settings that cannot act here are reported with the reason.
  cfg = config.load({ train_batch_size = 8, activation_checkpointing = {
    partition_activations = true, synchronize_checkpoint_boundary = true,
    number_checkpoints = 4 } }, 1)
  local msg = config.no_effect_message(cfg)
  assert(msg:find("^config: no effect here: activation_checkpointing.partition_activations " ..
                  "%(it splits checkpoints across the model%-parallel group; without model " ..
                  "parallelism that group is each rank alone%)"), msg)
  assert(msg:find("activation_checkpointing.synchronize_checkpoint_boundary (CPU kernels", 1,
                  true), msg)
  assert(msg:find("activation_checkpointing.number_checkpoints (it sizes the buffer of " ..
                  "contiguous_memory_optimization, which is off)", 1, true), msg)
  assert(#cfg.unimplemented == 0)
  local function ac_error(block, expected)
    expect_error({ train_batch_size = 8, activation_checkpointing = block }, 1, expected)
  end
  ac_error({ partition_activations = 1 },
           "config: activation_checkpointing.partition_activations must be true or false (got 1)")
  ac_error({ cpu_checkpointing = "yes" },
           'config: activation_checkpointing.cpu_checkpointing must be true or false (got "yes")')
  ac_error({ contiguous_memory_optimization = { true } },
           "config: activation_checkpointing.contiguous_memory_optimization must be true or " ..
           "false (got a list)")
  ac_error({ synchronize_checkpoint_boundary = 0 },
           "config: activation_checkpointing.synchronize_checkpoint_boundary must be true or " ..
           "false (got 0)")
  ac_error({ profile = "false" },
           'config: activation_checkpointing.profile must be true or false (got "false")')
  ac_error({ number_checkpoints = 0 },
           "config: activation_checkpointing.number_checkpoints must be a whole number >= 1 " ..
           "(got 0)")
  ac_error({ number_checkpoints = 2.5 },
           "config: activation_checkpointing.number_checkpoints must be a whole number >= 1 " ..
           "(got 2.5)")
  ac_error({ number_checkpoints = true },
           "config: activation_checkpointing.number_checkpoints must be a whole number >= 1 " ..
           "(got true)")
  ac_error(true, "config: activation_checkpointing must be a JSON object {...} (got true)")
end

------------------------------------------------------------------ not implemented

-- checkpoint.writer.decoupled is a background save; the writer's other keys
-- are reported; tag_validation is met (every load checks the whole checkpoint).
function T.checkpoint_writer_decoupled_asks_for_background_saves()
  assert(config.load({ train_batch_size = 8 }, 1).checkpoint.async == false, "default")
  local cfg = config.load({ train_batch_size = 8, checkpoint = { tag_validation = "Fail",
                                           writer = { decoupled = true, type = "fast" } } }, 1)
  assert(cfg.checkpoint.async == true, "decoupled")
  assert(table.concat(cfg.unimplemented, ",") == "checkpoint.writer.type",
         table.concat(cfg.unimplemented, ","))
  local ok, err = pcall(config.load, { train_batch_size = 8, checkpoint = { writer = { decoupled = "yes" } } }, 1)
  assert(not ok and err:find("checkpoint.writer.decoupled", 1, true), tostring(err))
end

function T.unimplemented_keys_are_listed_by_dotted_name()
  local cfg = config.load({
    train_batch_size = 8,
    prescale_gradients = true,
    activation_checkpointing = { partition_activations = true, cpu_checkpointing = false,
                                 offload_to_nvme = true },
    steps_per_print = 10,                    -- logging cadence: accepted
    tensorboard = { enabled = false },       -- asks for nothing
    comms_logger = { enabled = true },
    fp16 = { enabled = false, auto_cast = true },
    optimizer = { type = "AdamW", params = { lr = 1e-4, foreach = true, torch_adam = true } },
    zero_optimization = { stage = 2, allgather_partitions = true, round_robin_gradients = false,
                          sub_group_size = 1e9, offload_optimizer = { device = "cpu" },
                          offload_param = { device = "none" } },
    aio = { block_size = 1048576 },
  }, 1)
  local want = { "activation_checkpointing.offload_to_nvme", "comms_logger", "fp16.auto_cast",
                 "optimizer.params.foreach", "prescale_gradients" }
  assert(table.concat(cfg.unimplemented, ",") == table.concat(want, ","),
         table.concat(cfg.unimplemented, ","))
  assert(config.unimplemented_message(cfg) == "config: not implemented (ignored): " ..
         table.concat(want, ", "))
  -- Offload blocks, normalised with DeepSpeed's defaults.
  local o = cfg.zero_optimization.offload_optimizer
  assert(o.device == "cpu" and o.buffer_count == 4 and o.pin_memory == false and o.ratio == 1)
  assert(cfg.zero_optimization.offload_param.buffer_count == 5)
  -- DeepSpeed's deprecated forms.
  cfg = config.load({ train_batch_size = 8, zero_optimization = { stage = 1, cpu_offload = true } },
                      1)
  assert(cfg.zero_optimization.offload_optimizer.device == "cpu")
  -- bf16's immediate_grad_update: true is this engine's way, false is not
  for v, want_u in pairs({ [true] = "", [false] = "bf16.immediate_grad_update" }) do
    local c = config.load({ train_batch_size = 8,
                            bf16 = { enabled = true, immediate_grad_update = v } }, 1)
    assert(table.concat(c.unimplemented, ",") == want_u, table.concat(c.unimplemented, ","))
  end
  cfg = config.load({ train_batch_size = 8, zero_optimization = true }, 1)
  assert(cfg.zero_optimization.stage == 1)
  cfg = config.load({ train_batch_size = 8, bfloat16 = { enabled = true } }, 1)
  assert(cfg.dtype == "bf16")
end

-- A key one or two letters from one luazero reads is reported with the one
-- it likely meant; a key near none is reported as it is.
function T.a_misspelt_key_is_reported_with_the_key_it_likely_meant()
  -- At the top level and in moe (DeepSpeed ignores unknown top-level keys):
  -- reported with the key it likely meant.
  local cfg = config.load({ train_batch_size = 8, gradient_clippin = 1.0,
                            moe = { ep_sise = 1, min_capacity = 4 } }, 1)
  local want = { "gradient_clippin (did you mean gradient_clipping?)",
                 "moe.ep_sise (did you mean moe.ep_size?)", "moe.min_capacity" }
  assert(table.concat(cfg.unimplemented, ",") == table.concat(want, ","),
         table.concat(cfg.unimplemented, ","))
  -- Inside a block (zero_optimization, its offloads, optimizer and its
  -- params, scheduler, fp16, bf16, the monitors, data_types,
  -- activation_checkpointing): refused, as
  -- DeepSpeed's ZeRO config refuses keys it does not have; ignored, it would
  -- leave the run without what it meant.
  for _, c in ipairs({
    { { zero_optimization = { stagee = 2 } }, "zero_optimization.stagee", "stage" },
    { { zero_optimization = { overlap_com = true } }, "zero_optimization.overlap_com",
      "overlap_comm" },
    { { zero_optimization = { offload_optimizer = { device = "cpu", pin_memroy = true } } },
      "zero_optimization.offload_optimizer.pin_memroy", "pin_memory" },
    { { optimizer = { type = "AdamW", param = { lr = 1e-5 } } }, "optimizer.param", "params" },
    { { optimizer = { type = "AdamW", params = { weight_deacy = 0.1 } } },
      "optimizer.params.weight_deacy", "weight_decay" },
    -- (whatever the value: false is no "asks for nothing" when the key is a
    -- misspelling, as of Muon's nesterov or DeepSpeedCPUAdam's adamw_mode)
    { { optimizer = { type = "Muon", params = { nestrov = false } } },
      "optimizer.params.nestrov", "nesterov" },
    { { optimizer = { type = "AdamW", params = { weight_decay = 0.1, adamw_mode = false } } },
      "optimizer.params.adamw_mode", "adam_w_mode" },
    { { zero_optimization = { reduce_scater = false } }, "zero_optimization.reduce_scater",
      "reduce_scatter" },
    { { tensorboard = { output_pat = false } }, "tensorboard.output_pat", "output_path" },
    { { data_types = { grad_accum_dtyp = false } }, "data_types.grad_accum_dtyp",
      "grad_accum_dtype" },
    -- (a misspelling of a key DeepSpeed has and luazero does not implement)
    { { fp16 = { auto_cas = false } }, "fp16.auto_cas", "auto_cast" },
    { { scheduler = { type = "WarmupLR", param = {} } }, "scheduler.param", "params" },
    { { fp16 = { enable = true } }, "fp16.enable", "enabled" },
    { { bf16 = { enable = true } }, "bf16.enable", "enabled" },
    { { tensorboard = { enable = true } }, "tensorboard.enable", "enabled" },
    { { flops_profiler = { enable = true } }, "flops_profiler.enable", "enabled" },
    { { data_types = { grad_accum_dtyp = "fp32" } }, "data_types.grad_accum_dtyp",
      "grad_accum_dtype" },
    { { activation_checkpointing = { partition_activation = true } },
      "activation_checkpointing.partition_activation", "partition_activations" },
  }) do
    c[1].train_batch_size = 8
    local prefix = c[2]:match("^(.*%.)")
    expect_error(c[1], 1, ("config: %s is not a key there; did you mean %s%s? (a misspelt key " ..
                           "would be ignored and the run go on without it)"):format(c[2], prefix,
                                                                                    c[3]))
  end
  -- (a short key takes one edit: "stag" is one from "stage", "stg" two; and
  -- DeepSpeed's own keys, implemented or not, are never taken for misspellings)
  cfg = config.load({ train_batch_size = 8, zero_optimization = { stg = 2,
                      zero_quantized_weights = true } }, 1)
  assert(table.concat(cfg.unimplemented, ",") ==
         "zero_optimization.stg,zero_optimization.zero_quantized_weights",
         table.concat(cfg.unimplemented, ","))
end

function T.offload_and_aio_keys()
  local dir = os.tmpname()
  os.remove(dir)
  assert(os.execute("mkdir -p " .. dir) == 0)
  local cfg = config.load({ train_batch_size = 8, aio = { block_size = 8192, queue_depth = 4 },
                            zero_optimization = { stage = 3, sub_group_size = 4096,
                              offload_optimizer = { device = "nvme", nvme_path = dir },
                              offload_param = { device = "nvme", nvme_path = dir } } }, 1)
  local z = cfg.zero_optimization
  assert(z.sub_group_size == 4096 and z.offload_param.device == "nvme")
  assert(cfg.aio.block_size == 8192 and cfg.aio.queue_depth == 4 and cfg.aio.thread_count == 1
         and cfg.aio.single_submit == false and cfg.aio.overlap_events == true)
  assert(#cfg.unimplemented == 0, table.concat(cfg.unimplemented, ","))
  -- Partial offload and the CPU cache of NVMe parameters are reported.
  cfg = config.load({ train_batch_size = 8, zero_optimization = { stage = 3,
    offload_optimizer = { device = "cpu", ratio = 0.5 },
    offload_param = { device = "nvme", nvme_path = dir, max_in_cpu = 1e6 } } }, 1)
  assert(table.concat(cfg.unimplemented, ",") ==
         "zero_optimization.offload_optimizer.ratio,zero_optimization.offload_param.max_in_cpu")
  -- A key the block does not have, and no misspelling of one, is reported
  -- (the first with the block's keys), never taken; a misspelling is
  -- refused (test a_misspelt_key_...).
  cfg = config.load({ train_batch_size = 8, zero_optimization = { stage = 2,
    offload_optimizer = { device = "cpu", pipelines = true } } }, 1)
  assert(table.concat(cfg.unimplemented, ",") == "zero_optimization.offload_optimizer." ..
         "pipelines (not a key of offload_optimizer, which has buffer_count, device, " ..
         "fast_init, nvme_path, pin_memory, pipeline_read, pipeline_write, ratio)",
         table.concat(cfg.unimplemented, ","))
  assert(cfg.zero_optimization.offload_optimizer.pipelines == nil and #cfg.no_effect == 0)
  expect_error({ train_batch_size = 8, aio = { block_size = 1000 } }, 1,
               "config: aio.block_size must be a multiple of 4096 (got 1000): O_DIRECT " ..
               "transfers whole 4 KiB blocks")
  expect_error({ train_batch_size = 8, aio = { queue_depth = 0 } }, 1,
               "config: aio.queue_depth must be a positive number (got 0)")
  expect_error({ train_batch_size = 8, aio = { queue_depth = 1025 } }, 1,
               "config: aio.queue_depth must be 1..1024 (got 1025)")
  expect_error({ train_batch_size = 8, aio = { thread_count = 65 } }, 1,
               "config: aio.thread_count must be 1..64 (got 65)")
  cfg = config.load({ train_batch_size = 8, aio = { use_gds = false, blocksize = 4096 },
                      optimizer = { type = "Adam", params = { fused = true } },
                      fp16 = { enabled = true, consecutive_hysteresis = true } }, 1)
  assert(table.concat(cfg.unimplemented, ",") == "aio.blocksize,optimizer.params.fused",
         table.concat(cfg.unimplemented, ","))
  assert(cfg.fp16.consecutive_hysteresis == true)
  expect_error({ train_batch_size = 8, zero_optimization = { stage = 2,
                 offload_param = { device = "cpu" } } }, 1,
               "config: zero_optimization.offload_param needs stage 3 (got stage 2); set " ..
               "zero_optimization.stage to 3 or remove offload_param")
  expect_error({ train_batch_size = 8, zero_optimization = {
                 offload_optimizer = { device = "cpu" } } }, 1,
               "config: zero_optimization.offload_optimizer needs stage 1, 2 or 3 (got " ..
               "stage 0); set zero_optimization.stage or remove offload_optimizer")
  -- --stage overrides the file's stage before the check, and the error
  -- names the flag; a deprecated cpu_offload is named as the file spells it.
  expect_error({ train_batch_size = 8, zero_optimization = { stage = 3,
                 offload_param = { device = "cpu" } } }, 1,
               "config: --stage 1: zero_optimization.offload_param needs stage 3; give --stage " ..
               "3, or remove offload_param from the config", { stage = 1 })
  load_error({ train_batch_size = 8, zero_optimization = { stage = 1, cpu_offload = "yes" } }, 1)
  expect_error({ train_batch_size = 8, zero_optimization = { stage = 0, cpu_offload = true } }, 1,
               "config: zero_optimization.cpu_offload needs stage 1, 2 or 3 (got stage 0); set " ..
               "zero_optimization.stage or remove cpu_offload")
  local missing = dir .. "/not-there"
  expect_error({ train_batch_size = 8, zero_optimization = { stage = 1,
                 offload_optimizer = { device = "nvme", nvme_path = missing } } }, 1,
               "config: zero_optimization.offload_optimizer.nvme_path: cannot create a file in " ..
               missing .. " (No such file or directory); point it at an existing, writable " ..
               "directory")
  local file = write_file("a-file", "x")
  expect_error({ train_batch_size = 8, zero_optimization = { stage = 3,
                 offload_param = { device = "nvme", nvme_path = file } } }, 1,
               "config: zero_optimization.offload_param.nvme_path: cannot create a file in " ..
               file .. " (Not a directory); point it at an existing, writable directory")
  os.execute("rm -rf " .. dir)
end

------------------------------------------------------------------ files, overrides

function T.a_file_with_overrides_that_win()
  local path = write_file("ds_config.json", [[
{
  "train_micro_batch_size_per_gpu": 2,
  "gradient_accumulation_steps": 4,
  "gradient_clipping": 1.0,
  "optimizer": { "type": "AdamW", "params": { "lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                              "weight_decay": 0.1 } },
  "fp16": { "enabled": true, "initial_scale_power": 12 },
  "zero_optimization": { "stage": 1, "reduce_bucket_size": 2e8 }
}]])
  local cfg = config.load(path, 2)
  assert(cfg.source == path and cfg.train_batch_size == 16 and cfg.dtype == "fp16")
  assert(cfg.fp16.initial_scale_power == 12 and cfg.gradient_clipping == 1)
  assert(cfg.zero_optimization.stage == 1 and cfg.zero_optimization.reduce_bucket_size == 2e8)
  assert(cfg.raw.fp16.enabled == true, "the file as read is kept (for the checkpoint manifest)")

  cfg = config.load(path, 2, { stage = "3", dtype = "bf16", micro_batch = 8, lr = 1e-3 })
  assert(cfg.zero_optimization.stage == 3 and cfg.zero_optimization.overlap_comm == true)
  assert(cfg.dtype == "bf16" and cfg.fp16.enabled == false and cfg.bf16.enabled == true)
  assert(cfg.fp16.initial_scale_power == 12, "the rest of the fp16 block stays")
  assert(cfg.train_micro_batch_size_per_gpu == 8 and cfg.train_batch_size == 64)
  assert(cfg.optimizer.params.lr == 1e-3 and cfg.optimizer.params.betas[2] == 0.95)
  assert(config.load(path, 2, { stage = "auto" }).zero_optimization.stage == "auto")
  assert(config.load(path, 2, { dtype = "fp32" }).dtype == "fp32")

  -- A flag that makes the batch sizes disagree is an error that says so.
  local fixed = write_file("fixed.json", '{"train_batch_size": 16, ' ..
                           '"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}')
  assert(config.load(fixed, 2).train_batch_size == 16)
  local err = load_error(fixed, 2, { micro_batch = 4 })
  assert(err == "config: train_batch_size 16 != train_micro_batch_size_per_gpu 4 * " ..
         "gradient_accumulation_steps 4 * world size 2 (= 32); --micro-batch overrides the " ..
         "file; all three are given, so one world size fits: leave one out and it follows " ..
         "from the other two and the world size",
         err)
  expect_error(fixed, 2, "config: unknown override 'micro' (known: auto, dtype, grad_accum, " ..
               "gradient_clipping, lr, memory_budget, micro_batch, stage, total_steps, " ..
               "train_batch, warmup)", { micro = 4 })
end

function T.auto_values_are_filled_by_defaults_and_flags()
  -- A Hugging Face style file: "auto" leaves the key to luazero.
  local cfg = config.load({
    train_batch_size = "auto", train_micro_batch_size_per_gpu = "auto",
    gradient_accumulation_steps = "auto", gradient_clipping = "auto",
    fp16 = { enabled = "auto" }, bf16 = { enabled = "auto" },
    zero_optimization = { stage = 2, reduce_bucket_size = "auto" },
  }, 2, { micro_batch = 3, grad_accum = 2, dtype = "bf16" })
  -- (gradient_clipping "auto" is 1.0, the Trainer's max_grad_norm)
  assert(cfg.train_batch_size == 12 and cfg.gradient_clipping == 1 and cfg.dtype == "bf16")
  assert(cfg.zero_optimization.reduce_bucket_size == 5e8)
  -- The optimizer's lr and the scheduler's warmup from the trainer's values
  -- (ov.auto), as the Trainer fills them from its arguments; each listed.
  cfg = config.load({
    train_micro_batch_size_per_gpu = 2, gradient_clipping = "auto",
    optimizer = { type = "AdamW", params = { lr = "auto", weight_decay = "auto" } },
    scheduler = { type = "WarmupDecayLR", params = { total_num_steps = "auto",
                  warmup_num_steps = "auto", warmup_max_lr = "auto" } },
  }, 1, { total_steps = 20, auto = { lr = 3e-3, warmup = 2, gradient_clipping = 0.5 } })
  assert(cfg.optimizer.params.lr == 3e-3 and cfg.gradient_clipping == 0.5)
  assert(cfg.scheduler.params.warmup_num_steps == 2 and cfg.scheduler.params.total_num_steps == 20)
  assert(config.auto_message(cfg) == 'config: "auto" filled as the Hugging Face Trainer fills ' ..
         "it, with this run's values: optimizer.params.lr 0.003, " ..
         "scheduler.params.warmup_num_steps 2, gradient_clipping 0.5, " ..
         "scheduler.params.total_num_steps 20, scheduler.params.warmup_max_lr 0.003",
         config.auto_message(cfg))
  assert(config.auto_message(config.load({ train_batch_size = 2 }, 1)) == nil)
end

-- A communication_data_type DeepSpeed refuses (config.py's
-- get_communication_data_type) is refused; a valid one is reported as not
-- implemented.
function T.communication_data_type_values_are_deepspeeds()
  expect_error({ train_batch_size = 8, communication_data_type = "int8" }, 1,
               'config: communication_data_type must be "fp32", "fp16" or "bf16" (got "int8")')
  local cfg = config.load({ train_batch_size = 8, communication_data_type = "bf16" }, 1)
  assert(table.concat(cfg.unimplemented, ",") == "communication_data_type",
         table.concat(cfg.unimplemented, ","))
end

-- DeepSpeed refuses a file with a key twice in one object (a decoder keeps
-- the last); a file that is not JSON is named with the line and column.
function T.a_key_given_twice_or_a_syntax_error_is_named_with_its_line()
  local dup = write_file("dup.json", '{"train_batch_size": 2,\n "zero_optimization": ' ..
                         '{"stage": 1, "stage": 2}}')
  expect_error(dup, 1, ("config: %s: line 2: key \"stage\" is given twice in one object; keep " ..
                        "one (DeepSpeed refuses the file too)"):format(dup))
  -- the same key in two objects, or inside a string, is fine
  local ok = write_file("ok.json", '{"train_batch_size": 2, "bf16": {"enabled": false}, ' ..
                        '"fp16": {"enabled": false, "x": "\\"enabled\\""}}')
  assert(config.load(ok, 1).train_batch_size == 2)
  local comma = write_file("comma.json", '{"train_batch_size": 2,\n "gradient_clipping": 1.0,\n}')
  local err = load_error(comma, 1)
  assert(err:find("not valid JSON (", 1, true) and err:find(": line 3, column 1)", 1, true), err)
end

function T.memory_budget_comes_from_flag_env_file_or_memavailable()
  local cfg = config.load({ train_batch_size = 2, luazero = { memory_budget = "2GiB" } }, 2)
  local b, src = config.memory_budget(cfg)
  assert(b == 2 * 2 ^ 30 and src == "luazero.memory_budget")
  cfg = config.load({ train_batch_size = 2, luazero = { memory_budget = "2GiB" } }, 2,
                    { memory_budget = "512MiB" })
  b, src = config.memory_budget(cfg)
  assert(b == 512 * 2 ^ 20 and src == "--memory-budget")
  assert(config.parse_bytes("16GB") == 16e9 and config.parse_bytes("1.5e9") == 1.5e9 and
         config.parse_bytes(4096) == 4096 and config.parse_bytes("8G") == 8 * 2 ^ 30)
  assert(config.parse_bytes("lots") == nil and config.parse_bytes(-1) == nil)
  expect_error({ train_batch_size = 2, luazero = { memory_budget = "lots" } }, 1,
               'config: luazero.memory_budget must be bytes: a number or a string like ' ..
               '"12GiB", "512MiB", "16GB" (got "lots")')
  if not os.getenv("LZ_MEMORY_BUDGET") then
    -- LZ_MEMORY_BUDGET sits between the flag and the file.
    local p = io.popen(("LZ_MEMORY_BUDGET=3GiB '%s' -e %q"):format(require("luazero").executable(),
      'local c = require("luazero.config") ' ..
      'local cfg = c.load({ train_batch_size = 2, luazero = { memory_budget = "2GiB" } }, 1) ' ..
      'print(c.memory_budget(cfg)) ' ..
      'print(c.memory_budget(c.load(cfg.raw, 1, { memory_budget = "1GiB" })))'))
    local out = p:read("*a")
    p:close()
    assert(out == "3221225472\tLZ_MEMORY_BUDGET\n1073741824\t--memory-budget\n", out)
    cfg = config.load({ train_batch_size = 2 }, 2)
    b, src = config.memory_budget(cfg)
    local avail, from = require("luazero.io.memory").available(2)
    assert(avail and b == avail and src == from, src)
  end
end

------------------------------------------------------------------ schedules

-- step n runs at DeepSpeed's last_batch_iteration n - 2 (the lr is set when
-- the scheduler is built, then scheduler.step() follows each optimizer step).
local function lrs(sched, opt_lr)
  local t = { train_batch_size = 1, scheduler = sched }
  if opt_lr then t.optimizer = { type = "AdamW", params = { lr = opt_lr } } end
  return schedule.lr_schedule(config.load(t, 1))
end

function T.warmup_lr_log_and_linear()
  -- log: min + (max - min) * ln(it + 1) / ln(W); W = 10, min 0, max 0.01.
  local lr = lrs({ type = "WarmupLR", params = { warmup_min_lr = 0, warmup_max_lr = 0.01,
                                                 warmup_num_steps = 10 } })
  close(lr(1), 0, "step 1 (it -1: warmup_min_lr)")
  close(lr(2), 0, "step 2 (it 0: ln 1 = 0)")
  close(lr(3), 0.01 * 0.30102999566398120, "step 3 (it 1: ln 2 / ln 10)")
  close(lr(6), 0.01 * 0.69897000433601886, "step 6 (it 4: ln 5 / ln 10)")
  close(lr(11), 0.01, "step 11 (it 9: ln 10 / ln 10)")
  close(lr(12), 0.01, "after warmup")
  close(lr(1000), 0.01, "long after warmup")
  -- linear: min + (max - min) * it / W; W = 4, min 1e-4, max 1e-3.
  lr = lrs({ type = "WarmupLR", params = { warmup_min_lr = 1e-4, warmup_max_lr = 1e-3,
                                           warmup_num_steps = 4, warmup_type = "linear" } })
  close(lr(1), 1e-4, "it -1")
  close(lr(2), 1e-4, "it 0")
  close(lr(3), 3.25e-4, "it 1")
  close(lr(4), 5.5e-4, "it 2")
  close(lr(5), 7.75e-4, "it 3")
  close(lr(6), 1e-3, "it 4")
  -- WarmupLR's warmup_max_lr defaults to the optimizer's lr (DeepSpeed's
  -- lr_schedules.py: None, then param_groups' lr; WarmupDecayLR's is 0.001);
  -- warmup_num_steps is at least 2.
  lr = lrs({ type = "WarmupLR", params = { warmup_num_steps = 1, warmup_type = "linear" } }, 3e-4)
  close(lr(3), 1.5e-4, "W = max(2, 1): it 1 -> 1/2")
  close(lr(4), 3e-4, "it 2 -> max = the optimizer's lr")
end

-- The start-up notes of a schedule: a warmup longer than the run, and a
-- WarmupLR whose peak is the optimizer's lr for want of warmup_max_lr.
function T.schedule_notes_say_the_warmup_and_the_peak()
  local note = require("luazero.run.config").schedule_note
  local function cfg(sched)
    return config.load({ train_batch_size = 2, scheduler = sched,
                         optimizer = { type = "AdamW", params = { lr = 5e-4 } } }, 1)
  end
  local n = note(cfg({ type = "WarmupLR", params = { warmup_num_steps = 4 } }), { steps = 2 })
  assert(n and n:find("warmup_num_steps 4 is more than the 2 steps of --steps", 1, true) and
         n:find("\nconfig: WarmupLR without scheduler.params.warmup_max_lr peaks at the " ..
                "optimizer's lr, 0.0005", 1, true), tostring(n))
  assert(note(cfg({ type = "WarmupLR", params = { warmup_num_steps = 2, warmup_max_lr = 1e-3 } }),
              { steps = 9 }) == nil)
  assert(note(cfg({ type = "WarmupDecayLR", params = { warmup_num_steps = 2,
                                                       total_num_steps = 9 } }), { steps = 9 }) == nil)
  -- --warmup without a scheduler in the config (train.lua's warmup + cosine)
  local none = config.load({ train_batch_size = 2 }, 1)
  local n3 = note(none, { steps = 3, warmup = 50 })
  assert(n3 == "--warmup 50 is not less than the 3 steps of --steps: the learning rate never " ..
         "reaches its peak; lower it", tostring(n3))
  assert(note(none, { steps = 60, warmup = 50 }) == nil and note(none, { steps = 3 }) == nil)
end

function T.warmup_decay_lr()
  -- after warmup: max * max(0, (T - it) / max(1, T - W)); W = 10, T = 110.
  local lr = lrs({ type = "WarmupDecayLR", params = { warmup_max_lr = 0.01,
                   warmup_num_steps = 10, total_num_steps = 110, warmup_type = "linear" } })
  close(lr(1), 0, "it -1")
  close(lr(11), 0.009, "it 9: 9/10 of warmup")
  close(lr(12), 0.01, "it 10: (110 - 10) / 100")
  close(lr(62), 0.005, "it 60: 50 / 100")
  close(lr(111), 0.0001, "it 109: 1 / 100")
  close(lr(112), 0, "it 110")
  close(lr(300), 0, "past the end: clamped at 0")
  -- DeepSpeed's WarmupDecayLR default max is 0.001, not the optimizer's lr.
  lr = lrs({ type = "WarmupDecayLR", params = { total_num_steps = 2000 } }, 0.5)
  close(lr(1002), 0.001, "it 1000, warmup done")
  -- "auto" (Hugging Face's template) is the optimizer's lr, as its Trainer
  -- fills it in; --lr is the peak, over the file's; the start-up line's lr
  -- is the peak (schedule.peak).
  lr = lrs({ type = "WarmupDecayLR", params = { total_num_steps = 2000,
                                               warmup_max_lr = "auto" } }, 0.5)
  close(lr(1002), 0.5, "auto: the optimizer's lr")
  for _, t in ipairs({ "WarmupLR", "WarmupDecayLR" }) do
    local cfg = config.load({ train_batch_size = 1, scheduler = { type = t, params = {
                              total_num_steps = t == "WarmupDecayLR" and 2000 or nil,
                              warmup_max_lr = 0.01 } } }, 1, { lr = 0.25 })
    close(schedule.lr_schedule(cfg)(1002), 0.25, t .. ": --lr is the peak")
    close(schedule.peak(cfg.scheduler, 1), 0.25, t .. "'s peak")
  end
  load_error({ train_batch_size = 1, scheduler = { type = "OneCycle", params = {
               cycle_min_lr = 1e-3, cycle_max_lr = 1e-2 } } }, 1, { lr = 0.25 })
  local ok, err = pcall(config.load, { train_batch_size = 1, scheduler = { type = "LRRangeTest" } },
                        1, { lr = 0.25 })
  assert(not ok and err:find("--lr does not apply to scheduler LRRangeTest (its rates are " ..
                             "scheduler.params.lr_range_test_min_lr)", 1, true), err)
end

function T.warmup_cosine_lr()
  -- lr = optimizer lr * ratio; warmup: min_ratio + (1 - min_ratio) * it / W;
  -- then cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2 with
  -- p = min(1, (it - W + 1) / (T - W)). lr 0.01, W 10, T 110.
  local lr = lrs({ type = "WarmupCosineLR", params = { total_num_steps = 110,
                   warmup_num_steps = 10, warmup_min_ratio = 0.1, cos_min_ratio = 0.01,
                   warmup_type = "linear" } }, 0.01)
  close(lr(1), 0, "it -1: 0 before the first scheduler step")
  close(lr(2), 0.001, "it 0: ratio 0.1")
  close(lr(7), 0.0055, "it 5: 0.1 + 0.9 * 0.5")
  -- it 10: p = 1/100, (1 + cos(0.01 pi)) / 2 = 0.99975328018287, ratio 0.99975574738104
  close(lr(12), 0.0099975574738104, "it 10")
  close(lr(61), 0.00505, "it 59: p = 1/2, ratio 0.01 + 0.99 * 0.5")
  close(lr(111), 0.0001, "it 109: p = 1, ratio cos_min_ratio")
  close(lr(500), 0.0001, "past the end: clamped")
  -- log warmup from ratio 0: ln(it + 1) / ln(W).
  lr = lrs({ type = "WarmupCosineLR", params = { total_num_steps = 100, warmup_num_steps = 10 } },
           0.01)
  close(lr(3), 0.01 * 0.30102999566398120, "log warmup, it 1")
end

function T.no_scheduler_is_the_optimizer_lr()
  close(lrs(nil, 2e-4)(7), 2e-4, "constant optimizer lr")
  local cfg = config.load({ train_batch_size = 1 }, 1)
  close(schedule.lr_schedule(cfg)(1), 1e-3, "DeepSpeed's FusedAdam default")
  close(schedule.lr_schedule(cfg, 5e-4)(1), 5e-4, "the client optimizer's lr")
  cfg = config.load({ train_batch_size = 1 }, 1, { lr = 7e-4 })
  close(schedule.lr_schedule(cfg, 5e-4)(1), 7e-4, "--lr wins")
  -- --warmup and --steps fill the scheduler's warmup and total steps.
  cfg = config.load({ train_batch_size = 1, optimizer = { type = "AdamW", params = { lr = 0.01 } },
                      scheduler = { type = "WarmupDecayLR", params = { warmup_max_lr = 0.01,
                                    warmup_type = "linear" } } }, 1, { warmup = 4, total_steps = 8 })
  assert(cfg.scheduler.params.warmup_num_steps == 4 and cfg.scheduler.params.total_num_steps == 8)
  close(schedule.lr_schedule(cfg)(6), 0.01, "it 4 = W")
  close(schedule.lr_schedule(cfg)(8), 0.005, "it 6: (8 - 6) / (8 - 4)")
end

function T.data_types_grad_accum_dtype_is_fp32_or_the_working_dtype()
  assert(config.load({ train_batch_size = 8 }, 1).grad_accum_dtype == "fp32")
  local cfg = config.load({ train_batch_size = 8, bf16 = { enabled = true },
                            data_types = { grad_accum_dtype = "bf16" } }, 1)
  assert(cfg.grad_accum_dtype == "bf16" and #cfg.unimplemented == 0)
  cfg = config.load({ train_batch_size = 8, data_types = { grad_accum_dtype = "fp16" } }, 1,
                    { dtype = "fp16" })
  assert(cfg.grad_accum_dtype == "fp16")
  assert(config.load({ train_batch_size = 8, bf16 = { enabled = true },
                       data_types = { grad_accum_dtype = "fp32" } }, 1).grad_accum_dtype == "fp32")
  expect_error({ train_batch_size = 8, data_types = { grad_accum_dtype = "bf16" } }, 1,
               "config: data_types.grad_accum_dtype is bf16 but the working dtype is fp32; " ..
               "it must be fp32 or the working dtype")
  expect_error({ train_batch_size = 8, bf16 = { enabled = true },
                 data_types = { grad_accum_dtype = "fp8" } }, 1,
               "config: data_types.grad_accum_dtype must be fp32, bf16 or fp16 (got \"fp8\")")
  assert(load_error({ train_batch_size = 8, data_types = 3 }, 1):find("data_types", 1, true))
end

function T.settings_without_effect_are_named()
  local cfg = config.load({ train_batch_size = 8, zero_optimization = { stage = 2,
    stage3_max_live_parameters = 1000, stage3_prefetch_bucket_size = 100,
    offload_optimizer = { device = "cpu", buffer_count = 8, pin_memory = true },
    offload_param = { device = "none", nvme_path = "/tmp" } },
    fp16 = { enabled = false, loss_scale = 0, initial_scale_power = 12 } }, 1)
  local msg = config.no_effect_message(cfg)
  for _, want in ipairs({
    'zero_optimization.offload_optimizer.buffer_count (it configures the NVMe swap files; ' ..
      '"device" is "cpu")',
    'zero_optimization.offload_param.nvme_path (nothing is offloaded: "device" is "none")',
    "zero_optimization.stage3_max_live_parameters (it tunes stage 3's parameter gathers; " ..
      "the stage is 2)",
    "zero_optimization.stage3_prefetch_bucket_size (it tunes",
    "fp16.loss_scale (the loss scaler runs only with fp16.enabled true)",
    "fp16.initial_scale_power (the loss scaler",
  }) do
    assert(msg and msg:find(want, 1, true), ("missing %q in %s"):format(want, tostring(msg)))
  end
  assert(not msg:find("pin_memory", 1, true), msg)
  -- The same keys where they act: no note.
  cfg = config.load({ train_batch_size = 8, zero_optimization = { stage = 3,
    stage3_max_live_parameters = 1000 }, fp16 = { enabled = true, loss_scale = 0 } }, 1)
  assert(config.no_effect_message(cfg) == nil, config.no_effect_message(cfg))
  -- "auto" is noted once, when the stage is chosen.
  cfg = config.load({ train_batch_size = 8, zero_optimization = { stage = "auto",
    stage3_max_reuse_distance = 10 } }, 1)
  assert(config.no_effect_message(cfg) == nil)
  config.set_stage(cfg, 1)
  config.set_stage(cfg, 1)
  local _, n = config.no_effect_message(cfg):gsub("stage3_max_reuse_distance", "")
  assert(n == 1, config.no_effect_message(cfg))
end

return T
