-- optim/schedule.lua — learning-rate schedules as functions of the 1-based
-- step: warmup + cosine (what scripts/train.lua runs without a config
-- file), and DeepSpeed's schedulers as a config's scheduler block names them.
--
--   local lr = schedule.lr_schedule(cfg)   -- lr(step), step = 1, 2, ... applied steps
local defaults = require("luazero.config.defaults")

local M = {}

-- Linear warmup from lr/warmup to lr over `warmup` steps, then cosine decay
-- to min_lr at step `total` (llm.c, nanoGPT). min_lr defaults to lr / 10.
function M.warmup_cosine(lr, warmup, total, min_lr)
  min_lr = min_lr or lr * 0.1
  return function(step)
    if step <= warmup then return lr * step / warmup end
    if step >= total then return min_lr end
    local ratio = (step - warmup) / (total - warmup)
    return min_lr + 0.5 * (1 + math.cos(math.pi * ratio)) * (lr - min_lr)
  end
end

-- DeepSpeed's lr_schedules.py as functions of its last_batch_iteration `it`.
-- warmup_num_steps is at least 2 there (max(2, n)); before the first
-- scheduler step (it < 0) WarmupLR/WarmupDecayLR give warmup_min_lr and
-- WarmupCosineLR gives 0.
local function warmup_gamma(p, it)
  local W = math.max(2, p.warmup_num_steps)
  if p.warmup_type == "log" then return math.log(it + 1) * (1 / math.log(W)) end
  return it / W
end

function M.lr_at_iteration(sched, base_lr, it)
  if not sched then return base_lr end
  local p, t = sched.params, sched.type
  local W = math.max(2, p.warmup_num_steps)
  if t == "WarmupLR" or t == "WarmupDecayLR" then
    local min_lr = p.warmup_min_lr
    local max_lr = p.warmup_max_lr or base_lr
    if it < 0 then return min_lr end
    local gamma
    if it < W then
      gamma = warmup_gamma(p, it)
    elseif t == "WarmupLR" then
      gamma = 1
    else
      local T = p.total_num_steps
      gamma = math.max(0, (T - it) / math.max(1, T - W))
    end
    return min_lr + (max_lr - min_lr) * gamma
  elseif t == "WarmupCosineLR" then
    if it < 0 then return 0 end
    local ratio
    if it < W then
      ratio = p.warmup_min_ratio + warmup_gamma(p, it) * (1 - p.warmup_min_ratio)
    else
      local progress = math.min(1, (it - W + 1) / math.max(1, p.total_num_steps - W))
      ratio = (1 + math.cos(math.pi * progress)) / 2
      ratio = math.max(0, p.cos_min_ratio + (1 - p.cos_min_ratio) * ratio)
    end
    return base_lr * ratio
  end
  error("config: unknown scheduler type " .. tostring(t), 0)
end

-- lr(step): the learning rate DeepSpeed uses for the step-th optimizer step
-- (1, 2, ...), counting applied steps only — DeepSpeed does not advance the
-- scheduler on a step skipped for fp16 overflow. DeepSpeed sets the lr once
-- when the scheduler is built (last_batch_iteration -1) and calls
-- scheduler.step() after each applied optimizer step, so step n runs at
-- last_batch_iteration n - 2. base_lr: the optimizer's lr (the config's
-- optimizer.params.lr, else the one given here, else the default
-- optimizer's: AdamW's 1e-3);
-- without a scheduler lr(step) is base_lr.
function M.lr_schedule(cfg, base_lr)
  local lr0 = (cfg.optimizer and cfg.optimizer.params.lr) or base_lr
              or defaults.optimizer_default.params.lr
  if cfg.optimizer == nil and cfg.overrides and cfg.overrides.lr then lr0 = cfg.overrides.lr end
  local sched = cfg.scheduler
  return function(step) return M.lr_at_iteration(sched, lr0, step - 2) end
end

return M
