-- nn/sequential.lua — runs children in order; backward in reverse. Children
-- are named "0", "1", ... (Hugging Face's ModuleList naming: h.0, h.1, ...).
local Module = require("luazero.nn.module")

local Sequential = Module:extend("Sequential")

function Sequential.new(modules)
  local self = setmetatable({}, Sequential):init()
  for i, m in ipairs(modules or {}) do self:add(tostring(i - 1), m) end
  return self
end

function Sequential:forward(x)
  for _, c in ipairs(self.children) do x = self:run_forward(c.module, x) end
  return x
end

function Sequential:backward(dy)
  for i = #self.children, 1, -1 do dy = self:run_backward(self.children[i].module, dy) end
  return dy
end

return Sequential
