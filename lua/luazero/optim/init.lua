-- optim — optimizers and learning-rate schedules. optim.new(cfg.optimizer)
-- makes the optimizer a config names.
local AdamW = require("luazero.optim.adamw")
local Lion = require("luazero.optim.lion")

local optim = { AdamW = AdamW, Lion = Lion, schedule = require("luazero.optim.schedule") }

-- DeepSpeed matches its optimizer names case-insensitively; its "Adam" is
-- AdamW unless adam_w_mode is false.
local by_type = { adam = AdamW, adamw = AdamW, lion = Lion }

-- optimizer_cfg: the config's optimizer block ({type, params}); a block
-- without a type (a partial table from Lua) is AdamW, the engine's default.
function optim.new(optimizer_cfg)
  optimizer_cfg = optimizer_cfg or {}
  local t = optimizer_cfg.type or "AdamW"
  local class = type(t) == "string" and by_type[t:lower()]
  if not class then
    error(("config: optimizer.type must be Adam, AdamW or Lion (got %s)"):format(tostring(t)), 2)
  end
  return class.new(optimizer_cfg.params or {})
end

return optim
