-- optim/adam8bit.lua — bitsandbytes' Adam8bit: AdamW8bit's update (its
-- weight decay is decoupled too) under its own name and defaults (no
-- weight decay), so a config written for bitsandbytes means what it meant.
local adamw8bit = require("luazero.optim.adamw8bit")

local spec = {}
for k, v in pairs(adamw8bit) do spec[k] = v end
spec.name, spec.types, spec.resumes = "Adam8bit", { "Adam8bit" }, { "AdamW8bit" }
spec.params = {}
for i, d in ipairs(adamw8bit.params) do
  local copy = {}
  for k, v in pairs(d) do copy[k] = v end
  if copy[1] == "weight_decay" then copy.default = 0 end
  spec.params[i] = copy
end

return spec
