-- nn/rmsnorm.lua — RMSNorm over the last dimension (Llama's input_layernorm,
-- post_attention_layernorm and final norm, as Hugging Face's LlamaRMSNorm):
-- y = weight * x / sqrt(mean(x^2) + eps). No bias.
local lz = require("luazero")
local Module = require("luazero.nn.module")

local ops = lz.ops
local RMSNorm = Module:extend("RMSNorm")

-- eps: rms_norm_eps of the model's config (Llama 1e-6, Llama 2/3 1e-5).
function RMSNorm.new(n, eps)
  local self = setmetatable({}, RMSNorm):init()
  self.n, self.eps = n, eps or 1e-6
  self:param("weight", { n }, { kind = "ones" }, false)
  return self
end

-- x [B, T, C]; 1/rms per row is kept for backward.
function RMSNorm:forward(x)
  local B, T = x:dim(1), x:dim(2)
  local y = self:activation({ B, T, self.n })
  self.rstd = self:activation({ B, T })
  ops.rmsnorm_forward(y, self.rstd, x, self:cast(self.p.weight, "f32"), self.eps)
  self.input = x
  return y
end

function RMSNorm:backward(dy)
  local x = self.input
  local dx = self:scratch({ x:dim(1), x:dim(2), self.n })
  ops.rmsnorm_backward(dx, self:grad_or_sink("weight"), dy, x, self:cast(self.p.weight, "f32"),
                       self.rstd)
  return dx
end

-- Casts: the weight in forward and in backward.
function RMSNorm:own_memory(B, T, dtype)
  local x = lz.arena_bytes(B * T * self.n)
  return { input = x, activations = x + lz.arena_bytes(B * T), scratch = x,
           casts = 2 * Module.param_cast_bytes(self.n, dtype) }
end

return RMSNorm
