-- optim — optimizers and learning-rate schedules.
local M = {
  AdamW = require("luazero.optim.adamw"),
  schedule = require("luazero.optim.schedule"),
}

function M.new(cfg)
  cfg = cfg or {}
  local t = tostring(cfg.type or "AdamW"):lower()
  if t == "adam" or t == "adamw" then return M.AdamW.new(cfg.params or {}) end
  error(("config: optimizer.type must be Adam, AdamW or Lion (got %s)"):format(tostring(cfg.type)), 0)
end

return M
