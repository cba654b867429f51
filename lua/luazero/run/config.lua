-- run/config.lua — a training run's configuration: the DeepSpeed file (or
-- nothing) with the flags on top, the learning-rate schedule that runs, and
-- the memory budget it holds. ex: a luazero.run.exits.
local config = require("luazero.config")
local optim = require("luazero.optim")
local M = {}

-- The normalised DeepSpeed configuration. Without a file,
-- config.train_defaults stand in for what DeepSpeed would need from the
-- script (micro-batch, clipping, AdamW); the lr (and a micro-batch the size
-- names) is the model size's unless given.
function M.load(flags, world, model_cfg)
  local ov = {
    stage = flags.stage, dtype = flags.dtype, micro_batch = flags.micro_batch,
    grad_accum = flags.grad_accum, lr = flags.lr, warmup = flags.warmup,
    total_steps = flags.steps > 0 and flags.steps or nil, memory_budget = flags.memory_budget,
    -- (what a config's "auto" takes: this run's lr and warmup)
    auto = { lr = flags.lr or model_cfg.lr, warmup = M.warmup(flags) },
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

-- The run's warmup: --warmup, else config.train_defaults' share of --steps.
function M.warmup(flags)
  local td = config.train_defaults
  return flags.warmup or math.min(td.warmup_max, math.floor(flags.steps * td.warmup_fraction))
end

-- The learning-rate schedule that runs, its name for the start-up line and
-- the warmup: the config's scheduler, a constant lr (a config without one,
-- as DeepSpeed), or without a config file warmup + cosine
-- (M.warmup's).

function M.schedule(cfg, flags)
  local lr, warmup = cfg.optimizer.params.lr, M.warmup(flags)
  if cfg.scheduler then
    return optim.schedule.lr_schedule(cfg), ("scheduler %s"):format(cfg.scheduler.type), warmup
  elseif flags.config then
    return function() return lr end, "constant", warmup
  end
  return optim.schedule.warmup_cosine(lr, warmup, flags.steps),
         ("warmup %d + cosine"):format(warmup), warmup
end

-- A note when the config's scheduler warms up over more steps than the run
-- has (its total_num_steps, else --steps): the lr never reaches its peak
-- (DeepSpeed warns too); nil otherwise.
-- Also where a WarmupLR's peak is the optimizer's lr for want of
-- warmup_max_lr (WarmupDecayLR's default is 0.001: the two differ).
function M.schedule_note(cfg, flags)
  local notes = {}
  local p = cfg.scheduler and cfg.scheduler.params
  local total = p and (p.total_num_steps or (flags.steps > 0 and flags.steps))
  if p and p.warmup_num_steps and total and p.warmup_num_steps > total then
    notes[#notes + 1] = ("config: scheduler.params.warmup_num_steps %d is more than the %d " ..
      "steps of %s: the learning rate never reaches its peak; lower it (or set it \"auto\", or " ..
      "give --warmup)"):format(p.warmup_num_steps, total,
                               p.total_num_steps and "total_num_steps" or "--steps")
  end
  if not cfg.scheduler and flags.warmup and flags.steps > 0 and flags.warmup >= flags.steps then
    notes[#notes + 1] = ("--warmup %d is not less than the %d steps of --steps: the learning " ..
      "rate never reaches its peak; lower it"):format(flags.warmup, flags.steps)
  end
  local raw = type(cfg.raw) == "table" and type(cfg.raw.scheduler) == "table" and
              type(cfg.raw.scheduler.params) == "table" and cfg.raw.scheduler.params or {}
  if cfg.scheduler and cfg.scheduler.type == "WarmupLR" and p.warmup_max_lr == nil and
     raw.warmup_max_lr ~= "auto" then
    notes[#notes + 1] = ("config: WarmupLR without scheduler.params.warmup_max_lr peaks at the " ..
      "optimizer's lr, %g, as DeepSpeed's does (WarmupDecayLR's default peak is 0.001)")
      :format(cfg.optimizer.params.lr)
  end
  return #notes > 0 and table.concat(notes, "\n") or nil
end

local function local_world() return tonumber(os.getenv("LOCAL_WORLD_SIZE") or "") end

-- LZ_MEMORY_BUDGET, read once, before any work.
function M.check_memory_budget_env(ex, cfg)
  if (os.getenv("LZ_MEMORY_BUDGET") or "") ~= "" then
    ex.checked(config.memory_budget, cfg, local_world())
  end
end

-- A budget given explicitly (--memory-budget, LZ_MEMORY_BUDGET,
-- luazero.memory_budget) is held: a step whose peak RSS or ledger peak
-- passes it stops the run. Returns budget, source (nil: none held).
function M.held_budget(cfg)
  if cfg.memory_budget or (os.getenv("LZ_MEMORY_BUDGET") or "") ~= "" then
    return config.memory_budget(cfg, local_world())
  end
end

return M
