-- config/defaults.lua — DeepSpeed's defaults for the keys luazero reads
-- (and what scripts/train.lua uses without a config file): the one home of
-- defaults; luazero.config hands them out under the same names. Each
-- optimizer's defaults are its own file's (the optimizer table,
-- optim/registry.lua), here under the name that file gives them.
local optimizers = require("luazero.optim.registry")

local M = {}

M.fp16_defaults = {
  enabled = false, loss_scale = 0, initial_scale_power = 16, loss_scale_window = 1000,
  hysteresis = 2, consecutive_hysteresis = false, min_loss_scale = 1,
}

M.zero_defaults = {
  stage = 0, contiguous_gradients = true, reduce_scatter = true,
  reduce_bucket_size = 500000000, allgather_bucket_size = 500000000,
  overlap_comm = nil, -- DeepSpeed: true at stage 3, false below
  stage3_prefetch_bucket_size = 50000000, stage3_param_persistence_threshold = 100000,
  stage3_max_live_parameters = 1000000000, stage3_max_reuse_distance = 1000000000,
  sub_group_size = 1000000000,
}

-- DeepSpeed's "aio" block: how the NVMe tier drives libaio.
M.aio_defaults = {
  block_size = 1048576, queue_depth = 8, thread_count = 1, single_submit = false,
  overlap_events = true,
}

-- adam_defaults (FusedAdam's), lion_defaults (FusedLion's), ...: the very
-- tables the optimizers read, so a change shows in both.
for _, class in ipairs(optimizers.list) do
  if class.defaults_name then M[class.defaults_name] = class.defaults end
end
-- The optimizer DeepSpeed's engine is given when the config has none: the
-- table's default (scripts/train.lua brings its own, train_defaults).
M.optimizer_default = optimizers.default_block()
M.gradient_clipping_default = 0

-- What scripts/train.lua uses when no --config file is given, in place of
-- what a DeepSpeed user's script would pass (docs/configuration.md,
-- "Without a config file"): the micro-batch, clipping, the default
-- optimizer (AdamW: these params are its) with GPT-2's betas and weight
-- decay, and a warmup (10% of the steps, at most 100) + cosine schedule.
M.train_defaults = {
  micro_batch = 8, grad_accum = 1, gradient_clipping = 1.0,
  optimizer = { type = optimizers.default.name, decoupled_weight_decay = true,
                params = { betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1 } },
  warmup_fraction = 0.1, warmup_max = 100,
}

M.offload_optimizer_defaults = {
  device = "none", nvme_path = nil, buffer_count = 4, pin_memory = false,
  pipeline_read = false, pipeline_write = false, fast_init = false, ratio = 1.0,
}
M.offload_param_defaults = {
  device = "none", nvme_path = nil, buffer_count = 5, buffer_size = 100000000,
  max_in_cpu = 1000000000, pin_memory = false,
}

-- DeepSpeed's activation_checkpointing defaults
-- (deepspeed/runtime/activation_checkpointing/config.py).
M.activation_checkpointing_defaults = {
  partition_activations = false, cpu_checkpointing = false,
  contiguous_memory_optimization = false, number_checkpoints = nil,
  synchronize_checkpoint_boundary = false, profile = false,
}

-- Scheduler parameters each type takes, with DeepSpeed's defaults;
-- `required` ones have none (WarmupLR's warmup_max_lr is the optimizer's lr
-- when not given, WarmupDecayLR's 0.001, as DeepSpeed's lr_schedules.py has
-- them; "auto" is the optimizer's lr). `peak`: the parameter the schedule peaks
-- at (none: the optimizer's lr), which --lr sets, unless `rates` names the
-- parameters that are its rates (--lr is refused there).
M.scheduler_params = {
  WarmupLR = { defaults = { warmup_min_lr = 0, warmup_num_steps = 1000, warmup_type = "log" },
              optional = { warmup_max_lr = true }, peak = "warmup_max_lr" },
  WarmupDecayLR = { defaults = { warmup_min_lr = 0, warmup_max_lr = 0.001,
                                 warmup_num_steps = 1000, warmup_type = "log" },
                    required = { "total_num_steps" }, peak = "warmup_max_lr" },
  WarmupCosineLR = { defaults = { warmup_min_ratio = 0, warmup_num_steps = 1000,
                                  cos_min_ratio = 0.0001, warmup_type = "log" },
                     required = { "total_num_steps" } },
  -- cycle_second_step_size defaults to cycle_first_step_size,
  -- cycle_second_stair_count to cycle_first_stair_count.
  OneCycle = { defaults = { decay_lr_rate = 0, cycle_first_step_size = 2000,
                            cycle_first_stair_count = 0, decay_step_size = 0,
                            cycle_momentum = true, cycle_min_mom = 0.8, cycle_max_mom = 0.9,
                            decay_mom_rate = 0 },
               optional = { cycle_second_step_size = true, cycle_second_stair_count = true },
               required = { "cycle_min_lr", "cycle_max_lr" },
               peak = "cycle_max_lr", rates = "cycle_min_lr and cycle_max_lr" },
  -- (LRRangeTest rises without a peak: its starting rate is the one named)
  LRRangeTest = { defaults = { lr_range_test_min_lr = 1e-3, lr_range_test_step_size = 2000,
                               lr_range_test_step_rate = 1.0, lr_range_test_staircase = false },
                  peak = "lr_range_test_min_lr", rates = "lr_range_test_min_lr" },
}

-- What each required scheduler parameter is, for the error when it is missing.
M.scheduler_required = {
  total_num_steps = "a whole number >= 1: the optimizer steps of the run",
  cycle_min_lr = "a number >= 0: the learning rate the cycle starts and ends at",
  cycle_max_lr = "a number >= 0: the learning rate at the top of the cycle",
}

-- Every key of DeepSpeed's zero_optimization block (DeepSpeedZeroConfig's
-- fields and their aliases), implemented here or not: none of them is taken
-- for a misspelling of another.
M.deepspeed_zero_keys = {}
for _, k in ipairs({
  "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size",
  "use_multi_rank_bucket_allreduce", "allgather_partitions", "allgather_bucket_size",
  "overlap_comm", "load_from_fp32_weights", "elastic_checkpoint", "offload_param",
  "offload_optimizer", "sub_group_size", "cpu_offload_param", "cpu_offload_use_pin_memory",
  "cpu_offload", "prefetch_bucket_size", "stage3_prefetch_bucket_size",
  "param_persistence_threshold", "stage3_param_persistence_threshold",
  "model_persistence_threshold", "stage3_model_persistence_threshold", "max_live_parameters",
  "stage3_max_live_parameters", "max_reuse_distance", "stage3_max_reuse_distance",
  "gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
  "module_granularity_threshold", "stage3_module_granularity_threshold",
  "use_all_reduce_for_fetch_params", "stage3_use_all_reduce_for_fetch_params",
  "stage3_gather_fp16_weights_on_model_save", "ignore_unused_parameters", "legacy_stage1",
  "round_robin_gradients", "zero_hpz_partition_size", "zero_quantized_weights",
  "zero_quantized_nontrainable_weights", "zero_quantized_gradients", "zeropp_loco_param",
  "mics_shard_size", "mics_hierarchical_params_gather", "memory_efficient_linear",
  "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings",
}) do M.deepspeed_zero_keys[k] = true end

return M
