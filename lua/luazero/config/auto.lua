-- config/auto.lua — "auto" (Hugging Face's DeepSpeed templates) filled as its
-- Trainer fills it, from the trainer's own values: the optimizer's lr, the
-- scheduler's warmup_num_steps and gradient_clipping. (warmup_max_lr "auto"
-- is the optimizer's lr and total_num_steps "auto" --steps:
-- config/scheduler.lua, which adds them to the same list; every other
-- "auto" is the default.)
--
--   auto.fill(raw, { lr = 3e-3, warmup = 2 }, filled)  -- before the blocks are read
--   print(auto.message(cfg))
local defaults = require("luazero.config.defaults")

local M = {}

-- Fills raw's "auto" values from `given` (lr, warmup, gradient_clipping:
-- scripts/train.lua's; gradient_clipping 1.0 without one, as the Trainer's
-- max_grad_norm) and lists each fill in `filled`, for the start-up line.
function M.fill(raw, given, filled)
  local o = type(raw.optimizer) == "table" and type(raw.optimizer.params) == "table" and
            raw.optimizer.params
  if o and o.lr == "auto" and given.lr then
    o.lr = given.lr
    filled[#filled + 1] = ("optimizer.params.lr %g"):format(given.lr)
  end
  local sp = type(raw.scheduler) == "table" and type(raw.scheduler.params) == "table" and
             raw.scheduler.params
  if sp and sp.warmup_num_steps == "auto" and given.warmup then
    sp.warmup_num_steps = math.max(1, given.warmup)
    filled[#filled + 1] = ("scheduler.params.warmup_num_steps %d"):format(sp.warmup_num_steps)
  end
  if raw.gradient_clipping == "auto" then
    raw.gradient_clipping = given.gradient_clipping or defaults.train_defaults.gradient_clipping
    filled[#filled + 1] = ("gradient_clipping %g"):format(raw.gradient_clipping)
  end
end

-- The start-up line for the values filled (cfg.auto_filled); nil if none.
function M.message(cfg)
  if #cfg.auto_filled == 0 then return nil end
  return 'config: "auto" filled as the Hugging Face Trainer fills it, with this run\'s values: ' ..
         table.concat(cfg.auto_filled, ", ")
end

return M
