-- nn/linear.lua — y = x W^T + b, W stored [out, in] (torch.nn.Linear's layout).
-- Hugging Face's GPT-2 keeps these weights in Conv1D modules, which store the
-- transpose [in, out]; export transposes them.
--
-- forward and backward take an optional weight to multiply by instead of the
-- module's own (and, in backward, where that weight's gradient goes): a
-- wrapper (nn/lora.lua) passes an effective weight it formed from this one.
local lz = require("luazero")
local Module = require("luazero.nn.module")

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

-- The [out, in] weight, the [out] bias (nil without one) and their
-- gradients (nil when frozen). A subclass whose weight is several
-- parameters (nn/packed_linear.lua) lends tensors over them, given back
-- through release.
function Linear:weight() return self.p.weight end
function Linear:weight_grad() return self.g.weight end
function Linear:bias() return self.p.bias end
function Linear:bias_grad() return self.g.bias end
function Linear:release() end

-- x [B, T, in] -> [B, T, out]
-- With a bf16 weight (the ZeRO engine's bf16 working copy) x is cast to
-- bf16 and the GEMM accumulates in fp32; the output stays f32.
function Linear:forward(x, w)
  local y = self:activation({ x:dim(1), x:dim(2), self.n_out })
  local own = not w and self:weight()
  local xw, ww = self:matmul_operands(x, w or own)
  local b = self.has_bias and self:bias()
  ops.linear_forward(y, xw, ww, b and self:cast(b, "f32") or nil)
  if own then self:release(own) end
  if b then self:release(b) end
  self.input = xw
  return y
end

-- One kernel call writes the weight's and the bias's gradients.
function Linear:writes_grads() return true end
-- Its weight gradient's product takes the gradient norm's block partials
-- where the engine hands them (self.norm_blocks: zero/reduce.lua's
-- norm_blocks_for), while the gradient is in the cache.
Linear.takes_norm_blocks = true

-- w, dw: the weight forward was given and where its gradient accumulates.
-- self.grads_write (set by the engine for this call): the own gradients
-- hold no sum yet, and are written instead of added to.
function Linear:backward(dy, w, dw)
  local x = self.input
  local dx = self:scratch({ x:dim(1), x:dim(2), self.n_in })
  local write, nb = self.grads_write, self.norm_blocks
  self.grads_write, self.norm_blocks = nil, nil
  local own, gown
  if not w then
    own, gown = self:weight(), self:weight_grad()
    w, dw = own, gown
  elseif write then
    -- (a wrapper's weight, whose gradient goes where the wrapper says:
    -- the own ones are zeroed, then added into as before)
    local g, b = self:weight_grad(), self.has_bias and self:bias_grad()
    if g then g:zero(); self:release(nil, g) end
    if b then b:zero(); self:release(b) end
    write = false
  end
  local dyw, ww = self:matmul_operands(dy, w)
  local gb = self.has_bias and self:bias_grad()
  local at = nb and gown and nb.at(gown)
  if at then
    -- (its own gradient, where the slice the norm reads holds it)
    ops.linear_backward_norm(dx, dw, gb or nil, dyw, x, ww, write and 1 or 0, nb.ptr, nb.n, at)
  else
    local backward = write and ops.linear_backward_write or ops.linear_backward
    backward(dx, dw, gb or nil, dyw, x, ww)
  end
  if own then self:release(own, gown) end
  if gb then self:release(gb) end
  return dx
end

-- Its input and its output's gradient are matmul operands only (LoRA's
-- wrapper reads both itself).
function Linear:gemm_input() return 1 end

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
