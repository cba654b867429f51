-- optim — optimizers and learning-rate schedules. optim.new(cfg.optimizer)
-- makes the optimizer a config names; the optimizers themselves are the
-- table optim/registry.lua builds from their files, each also here by
-- name (optim.AdamW, optim.Lion, ...).
local registry = require("luazero.optim.registry")

local optim = { schedule = require("luazero.optim.schedule"), registry = registry,
                new = registry.new, find = registry.find }
for _, class in ipairs(registry.list) do optim[class.name] = class end

-- Adds the optimizer a file declares (docs/extending.md); returns its class.
function optim.register(path)
  local class = registry.register(path)
  optim[class.name] = class
  return class
end

return optim
