-- zero/settings.lua — what the engine reads from a DeepSpeed config
-- (normalised by luazero.config, or a partial table in tests), and the
-- placement plan those settings give (zero/plan.lua).
--
--   local s = Settings.read(cfg)
--   local P = Settings.plan_of(s, "cpu", states, formats, master, moe)
local config = require("luazero.config")
local moe_config = require("luazero.config.moe")
local Placement = require("luazero.zero.plan")

local M = {}

-- The settings the engine reads from a DeepSpeed config (normalised by
-- luazero.config, or a partial table in tests): what is absent takes the
-- defaults luazero.config holds, the one home of defaults.
function M.read(cfg)
  cfg = cfg or {}
  local zd = config.zero_defaults
  local z = cfg.zero_optimization or {}
  local fp16, bf16 = cfg.fp16 or {}, cfg.bf16 or {}
  local dtype = "fp32"
  if fp16.enabled then dtype = "fp16" elseif bf16.enabled then dtype = "bf16" end
  local function zget(k) if z[k] == nil then return zd[k] end return z[k] end
  local opt = cfg.optimizer or config.optimizer_default
  local moe = cfg.moe or {}
  return {
    stage = zget("stage"),
    dtype = dtype,
    accum = cfg.gradient_accumulation_steps or 1,
    micro_batch = cfg.train_micro_batch_size_per_gpu,
    clip = cfg.gradient_clipping or config.gradient_clipping_default,
    optimizer = opt,
    reduce_bucket = zget("reduce_bucket_size"),
    allgather_bucket = zget("allgather_bucket_size"),
    overlap = z.overlap_comm == true,
    prefetch = zget("stage3_prefetch_bucket_size"),
    persistence = zget("stage3_param_persistence_threshold"),
    max_live = zget("stage3_max_live_parameters"),
    fp16 = fp16,
    -- data_types.grad_accum_dtype: the dtype the gradients are kept in.
    grad_dtype = cfg.grad_accum_dtype or "fp32",
    offload_opt = z.offload_optimizer or config.offload_optimizer_defaults,
    offload_param = z.offload_param or config.offload_param_defaults,
    sub_group = zget("sub_group_size"),
    aio = cfg.aio,
    ep_size = moe.ep_size or moe_config.defaults.ep_size,
    -- how ZeRO-3 gathers the experts (nil: as the model was built)
    moe_gather = moe.gather,
    routed_only = moe.routed_only == true,
    -- where the experts live under expert parallelism (nil: their group)
    expert_placement = moe.placement,
  }
end

-- The placement plan a configuration gives (zero/plan.lua); states: the
-- optimizer class's per-element states, formats their formats, master its
-- master weights' format (default: the config block's; a block written in
-- Lua has it only once the optimizer is made from it); moe: the model's MoE
-- blocks' gather (plan.moe_of), nil without.
function M.plan_of(s, device, states, formats, master, moe)
  return Placement.new{ stage = s.stage, dtype = s.dtype, grad_dtype = s.grad_dtype,
                        offload_optimizer = s.offload_opt.device,
                        offload_param = s.offload_param.device, device = device or "cpu",
                        accum = s.accum, optimizer_states = states, optimizer_formats = formats,
                        master_format = master or s.optimizer.master_format, moe = moe,
                        ep_size = s.ep_size, expert_placement = s.expert_placement }
end

return M
