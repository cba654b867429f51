-- nn/linear.lua — y = x W^T + b, W stored [out, in] (torch.nn.Linear's layout).
-- Hugging Face's GPT-2 keeps these weights in Conv1D modules, which store the
-- transpose [in, out]; export transposes them.
local lz = require("luazero")
local Module = require("luazero.nn.module")
local lora = require("luazero.nn.lora")

local ops = lz.ops
local Linear = Module:extend("Linear")

-- opts.bias (default true), opts.std (init std, default 0.02).
function Linear.new(n_in, n_out, opts)
  opts = opts or {}
  local self = setmetatable({}, Linear):init()
  self.n_in, self.n_out, self.has_bias = n_in, n_out, opts.bias ~= false
  self:param("weight", { n_out, n_in }, { kind = "normal", std = opts.std or 0.02 }, true)
  if self.has_bias then self:param("bias", { n_out }, { kind = "zeros" }, false) end
  return self
end

-- x [B, T, in] -> [B, T, out]
-- With a bf16 weight (the ZeRO engine's bf16 working copy) x is cast to
-- bf16 and the GEMM accumulates in fp32; the output stays f32.
-- With LoRA adapters (models/lora.lua) the weight is the effective one.
function Linear:weight()
  if self.lora then return lora.effective(self, self.p.weight) end
  return self.p.weight
end

function Linear:forward(x)
  local y = self:activation({ x:dim(1), x:dim(2), self.n_out })
  local xw, w = self:matmul_operands(x, (self:weight()))
  ops.linear_forward(y, xw, w, self:cast(self.p.bias, "f32"))
  self.input = xw
  return y
end

function Linear:backward(dy)
  local x = self.input
  local dx = self:scratch({ x:dim(1), x:dim(2), self.n_in })
  local weight, copies = self:weight()
  local dyw, w = self:matmul_operands(dy, weight)
  local dw = copies and lora.grad_workspace(self, self.n_out, self.n_in, w:device_name()) or
             self.g.weight
  ops.linear_backward(dx, dw, self.g.bias, dyw, x, w)
  if copies then lora.backward(self, dw, copies) end
  return dx
end

-- Casts: the matmul operands in forward and backward, the bias in forward.
function Linear:own_memory(B, T, dtype)
  local x, y, w = B * T * self.n_in, B * T * self.n_out, self.n_in * self.n_out
  local bias = self.has_bias and Module.param_cast_bytes(self.n_out, dtype) or 0
  return {
    input = lz.arena_bytes(x), activations = lz.arena_bytes(y), scratch = lz.arena_bytes(x),
    casts = Module.matmul_cast_bytes(x, w, dtype) + bias + Module.matmul_cast_bytes(y, w, dtype),
  }
end

return Linear
