-- nn/rmsnorm.lua — RMSNorm over the last dimension (Llama's input_layernorm,
-- post_attention_layernorm and final norm, as Hugging Face's LlamaRMSNorm):
-- y = weight * x / sqrt(mean(x^2) + eps). No bias. With offset 1, Gemma's
-- (GemmaRMSNorm): y = (1 + weight) * x / sqrt(mean(x^2) + eps), the weight
-- starting at 0; 1 + weight is formed in f32 before the product, as
-- transformers does, and its gradient is the weight's.
local lz = require("luazero")
local Module = require("luazero.nn.module")

local ops = lz.ops
local RMSNorm = Module:extend("RMSNorm")

-- eps: rms_norm_eps of the model's config (Llama 1e-6, Llama 2/3 1e-5).
-- offset: added to the weight (nil: none, Llama's).
function RMSNorm.new(n, eps, offset)
  local self = setmetatable({}, RMSNorm):init()
  self.n, self.eps, self.offset = n, eps or 1e-6, offset
  self:param("weight", { n }, { kind = offset and "zeros" or "ones" }, false)
  return self
end

-- The f32 factor the kernel multiplies by: the weight, or offset + weight
-- (a fresh tensor: the weight itself stays as the optimizer owns it).
function RMSNorm:scale_operand()
  local w = self:cast(self.p.weight, "f32")
  if not self.offset then return w end
  local s = self:activation({ self.n })
  ops.fill(s, self.offset)
  ops.axpy(s, 1, w)
  return s
end

-- x [B, T, C]; 1/rms per row is kept for backward. y is written bf16 for a
-- consumer that only multiplies it (self.feeds, set by the block or model
-- that runs this norm before it; Module:output_for): backward never reads y.
function RMSNorm:forward(x)
  local B, T = x:dim(1), x:dim(2)
  local y = self:output_for(self.feeds, { B, T, self.n })
  self.rstd = self:activation({ B, T })
  local w = self:scale_operand()
  ops.rmsnorm_forward(y, self.rstd, x, w, self.eps)
  self.input, self.w = x, w
  return y
end

function RMSNorm:backward(dy)
  local x = self.input
  local dx = self:scratch({ x:dim(1), x:dim(2), self.n })
  local w = self.offset and self.w or self:cast(self.p.weight, "f32")
  ops.rmsnorm_backward(dx, self:grad_or_sink("weight"), dy, x, w, self.rstd)
  return dx
end

-- Casts: the weight in forward and in backward; y as output_bytes_for. An
-- offset's sum is an activation.
function RMSNorm:own_memory(B, T, dtype)
  local x = lz.arena_bytes(B * T * self.n)
  local y, y_casts = Module.output_bytes_for(self.feeds, B * T * self.n, dtype)
  local sum = self.offset and lz.arena_bytes(self.n) or 0
  return { input = x, activations = y + lz.arena_bytes(B * T) + sum, scratch = x,
           casts = 2 * Module.param_cast_bytes(self.n, dtype) + y_casts }
end

return RMSNorm
