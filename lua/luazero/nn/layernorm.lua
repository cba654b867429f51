-- nn/layernorm.lua — LayerNorm over the last dimension (eps 1e-5, as GPT-2).
local lz = require("luazero")
local Module = require("luazero.nn.module")

local ops = lz.ops
local LayerNorm = Module:extend("LayerNorm")

function LayerNorm.new(n, eps)
  local self = setmetatable({}, LayerNorm):init()
  self.n, self.eps = n, eps or 1e-5
  self:param("weight", { n }, { kind = "ones" }, false)
  self:param("bias", { n }, { kind = "zeros" }, false)
  return self
end

-- x [B, T, C]; mean and 1/std per row are kept for backward.
function LayerNorm:forward(x)
  local B, T = x:dim(1), x:dim(2)
  local y = self:activation({ B, T, self.n })
  self.mean = self:activation({ B, T })
  self.rstd = self:activation({ B, T })
  ops.layernorm_forward(y, self.mean, self.rstd, x, self:cast(self.p.weight, "f32"),
                        self:cast(self.p.bias, "f32"), self.eps)
  self.input = x
  return y
end

function LayerNorm:backward(dy)
  local x = self.input
  local dx = self:scratch({ x:dim(1), x:dim(2), self.n })
  ops.layernorm_backward(dx, self:grad_or_sink("weight"), self:grad_or_sink("bias"), dy, x,
                         self:cast(self.p.weight, "f32"), self.mean, self.rstd)
  return dx
end

-- Casts: weight and bias in forward, weight in backward.
function LayerNorm:own_memory(B, T, dtype)
  local x, rows = lz.arena_bytes(B * T * self.n), lz.arena_bytes(B * T)
  return { input = x, activations = x + 2 * rows, scratch = x,
           casts = 3 * Module.param_cast_bytes(self.n, dtype) }
end

return LayerNorm
