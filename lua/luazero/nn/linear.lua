-- nn/linear.lua — y = x W^T + b, W stored [out, in] (torch.nn.Linear's layout).
-- Hugging Face's GPT-2 keeps these weights in Conv1D modules, which store the
-- transpose [in, out]; export transposes them.
local lz = require("luazero")
local Module = require("luazero.nn.module")

local ops = lz.ops
local Linear = Module:extend("Linear")

-- opts.bias (default true), opts.std (init std, default 0.02).
function Linear.new(n_in, n_out, opts)
  opts = opts or {}
  local self = setmetatable({}, Linear):init()
  self.n_in, self.n_out = n_in, n_out
  self:param("weight", { n_out, n_in }, { kind = "normal", std = opts.std or 0.02 }, true)
  if opts.bias ~= false then self:param("bias", { n_out }, { kind = "zeros" }, false) end
  return self
end

-- x [B, T, in] -> [B, T, out]
function Linear:forward(x)
  local y = self:activation({ x:dim(1), x:dim(2), self.n_out })
  ops.linear_forward(y, x, self.p.weight, self.p.bias)
  self.input = x
  return y
end

function Linear:backward(dy)
  local x = self.input
  local dx = self:scratch({ x:dim(1), x:dim(2), self.n_in })
  ops.linear_backward(dx, self.g.weight, self.g.bias, dy, x, self.p.weight)
  return dx
end

return Linear
