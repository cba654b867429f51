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

-- OneCycle's cycle: its length (first + second step size) and the scale
-- (0 at the cycle's ends, 1 at its top) of the lr at iteration it. The
-- stair counts are read by DeepSpeed's OneCycle but never applied; the
-- same here.
local function one_cycle(p)
  local first = p.cycle_first_step_size
  local total = first + (p.cycle_second_step_size or first)
  local ratio = first / total
  return { total = total, scale = function(it)
    local b = it + 1
    local x = 1 + b / total - math.floor(1 + b / total)
    if x <= ratio then return x / ratio end
    return (x - 1) / (ratio - 1)
  end }
end

function M.lr_at_iteration(sched, base_lr, it)
  if not sched then return base_lr end
  local p, t = sched.params, sched.type
  local W = p.warmup_num_steps and math.max(2, p.warmup_num_steps)
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
  elseif t == "OneCycle" then
    local c = one_cycle(p)
    if it < c.total then return p.cycle_min_lr + (p.cycle_max_lr - p.cycle_min_lr) * c.scale(it) end
    -- After the cycle: cycle_min_lr / (1 + decay_lr_rate * (it - total + 1) /
    -- decay_step_size); no decay when either is 0.
    if p.decay_step_size == 0 or p.decay_lr_rate == 0 then return p.cycle_min_lr end
    return p.cycle_min_lr / (1 + p.decay_lr_rate * (it - c.total + 1) / p.decay_step_size)
  elseif t == "LRRangeTest" then
    -- lr_range_test_min_lr * (1 + step_rate * interval), interval =
    -- (it + 1) / step_size, floored with lr_range_test_staircase.
    local interval = (it + 1) / p.lr_range_test_step_size
    if p.lr_range_test_staircase then interval = math.floor(interval) end
    return p.lr_range_test_min_lr * (1 + p.lr_range_test_step_rate * interval)
  end
  error("config: unknown scheduler type " .. tostring(t), 0)
end

-- The learning rate a config's schedule (nil: none) peaks at over base_lr,
-- the optimizer's: what the start-up line names. sched.peak is the
-- parameter it peaks at (config/defaults.lua's scheduler_params; none, or
-- not given: the optimizer's lr).
function M.peak(sched, base_lr)
  return sched and sched.peak and sched.params[sched.peak] or base_lr
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

-- OneCycle with cycle_momentum: Adam's (or Lion's) betas at iteration it,
-- as DeepSpeed sets them: beta1 cycles inversely to the lr, from
-- cycle_max_mom down to cycle_min_mom and back, then
-- cycle_max_mom * (1 + decay_mom_rate * (it - total + 1) / decay_step_size);
-- beta2 is 0.99 throughout. Before the first scheduler step (it -1)
-- DeepSpeed has set (cycle_min_mom, 0.99). nil for any other schedule.
function M.betas_at_iteration(sched, it)
  if not (sched and sched.type == "OneCycle" and sched.params.cycle_momentum) then return nil end
  local p = sched.params
  if it < 0 then return p.cycle_min_mom, 0.99 end
  local c = one_cycle(p)
  if it < c.total then
    return p.cycle_max_mom - (p.cycle_max_mom - p.cycle_min_mom) * c.scale(it), 0.99
  end
  if p.decay_step_size == 0 or p.decay_mom_rate == 0 then return p.cycle_max_mom, 0.99 end
  return p.cycle_max_mom * (1 + p.decay_mom_rate * (it - c.total + 1) / p.decay_step_size), 0.99
end

-- betas(step) -> beta1, beta2 for the step-th applied optimizer step (as
-- lr_schedule counts), or nil when the config's schedule leaves the betas
-- alone.
function M.betas_schedule(cfg)
  local sched = cfg.scheduler
  if not M.betas_at_iteration(sched, -1) then return nil end
  return function(step) return M.betas_at_iteration(sched, step - 2) end
end

-- Lets the config's schedule drive the engine's optimizer's betas: each
-- step's lr lookup (engine.lr) first sets the step's betas. Every
-- optimizer luazero has (AdamW, Lion) reads its betas at each update.
function M.drive_betas(engine, cfg)
  local betas = M.betas_schedule(cfg)
  if not betas then return engine end
  local lr, opt = engine.lr, engine.optimizer
  engine.lr = function(step)
    opt.beta1, opt.beta2 = betas(step)
    opt.betas = { opt.beta1, opt.beta2 }
    return lr(step)
  end
  return engine
end

return M
