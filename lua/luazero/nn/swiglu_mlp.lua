-- nn/swiglu_mlp.lua — a gated feed-forward: Llama's (Hugging Face's
-- LlamaMLP), down_proj(silu(gate_proj(x)) * up_proj(x)), no biases; with
-- opts.act "gelu_tanh" Gemma's GeGLU (GemmaMLP), the gate through the tanh
-- GELU. opts.fused names one Linear writing gate's rows then up's (Phi-3's
-- gate_up_proj, which Phi3MLP chunks in two), read by the packed SwiGLU kernel.
local lz = require("luazero")
local Module = require("luazero.nn.module")
local Linear = require("luazero.nn.linear")

local ops = lz.ops
local SwiGLUMLP = Module:extend("SwiGLUMLP")

-- The gate's activation -> the forward and backward ops.
local ACTS = {
  silu = { "swiglu_forward", "swiglu_backward" },
  gelu_tanh = { "geglu_forward", "geglu_backward" },
}

-- n_hidden: intermediate_size. std: the init std of all three projections.
-- opts: what a family changes (nil: none): act, "silu" (default) or
-- "gelu_tanh"; fused, the name of one gate|up Linear (SwiGLU only).
function SwiGLUMLP.new(n_embd, n_hidden, std, opts)
  local self = setmetatable({}, SwiGLUMLP):init()
  self.n_embd, self.n_hidden = n_embd, n_hidden
  self.opts = opts or {}
  local act = self.opts.act or "silu"
  local pair = ACTS[act]
  if not pair then
    error(("mlp: activation %s is not a gated one here (silu, gelu_tanh)"):format(tostring(act)), 0)
  end
  if self.opts.fused and act ~= "silu" then
    error(("mlp: a fused gate|up projection takes silu only (got %s)"):format(act), 0)
  end
  -- looked up per call, so a profiler's wrapping of the op table sees them
  self.forward_op, self.backward_op = pair[1], pair[2]
  local lin = { bias = false, std = std }
  if self.opts.fused then
    self.gate_up = self:add(self.opts.fused, Linear.new(n_embd, 2 * n_hidden, lin))
  else
    self:add("gate_proj", Linear.new(n_embd, n_hidden, lin))
    self:add("up_proj", Linear.new(n_embd, n_hidden, lin))
  end
  self:add("down_proj", Linear.new(n_hidden, n_embd, lin))
  return self
end

-- x goes to the gate and up projections only: a copy for each.
function SwiGLUMLP:gemm_input()
  if self.gate_up then return self.gate_up:gemm_input() end
  local g, u = self.gate_proj:gemm_input(), self.up_proj:gemm_input()
  return (g > 0 and u > 0) and g + u or 0
end

-- act(gate) * up feeds down_proj only: written bf16 for it under bf16
-- training (backward reads gate and up, never it).
function SwiGLUMLP:forward(x)
  if self.gate_up then
    local gu = self:run_forward(self.gate_up, x)
    local h = self:output_for(self.down_proj, { gu:dim(1), gu:dim(2), self.n_hidden })
    ops.swiglu_packed_forward(h, gu)
    self.gu = gu
    return self:run_forward(self.down_proj, h)
  end
  local gate = self:run_forward(self.gate_proj, x)
  local up = self:run_forward(self.up_proj, x)
  local h = self:output_for(self.down_proj, { gate:dim(1), gate:dim(2), self.n_hidden })
  ops[self.forward_op](h, gate, up)
  self.gate, self.up = gate, up
  return self:run_forward(self.down_proj, h)
end

-- Whether dgate and dup are written bf16 (Module:grad_for): both
-- projections only multiply them.
function SwiGLUMLP:bf16_grads()
  return self:writes_bf16_for(self.gate_proj) and self:writes_bf16_for(self.up_proj)
end

-- The two projections read the same x: their input gradients add.
function SwiGLUMLP:backward(dy)
  local dh = self:run_backward(self.down_proj, dy)
  local B, T, H = dh:dim(1), dh:dim(2), self.n_hidden
  if self.gate_up then
    local dgu = self:grad_for(self.gate_up, { B, T, 2 * H })
    ops.swiglu_packed_backward(dgu, dh, self.gu)
    return self:run_backward(self.gate_up, dgu)
  end
  local dgate, dup = dh, nil -- dgate over dh in f32
  if self:bf16_grads() then
    dgate = self.ctx.cast_arena:tensor({ B, T, H }, "bf16")
    dup = self.ctx.cast_arena:tensor({ B, T, H }, "bf16")
  else
    dup = self:scratch({ B, T, H })
  end
  ops[self.backward_op](dgate, dup, dh, self.gate, self.up)
  local dx = self:run_backward(self.gate_proj, dgate)
  local dx_up = self:run_backward(self.up_proj, dup)
  ops.add(dx, dx, dx_up)
  return dx
end

-- Besides the projections: act(gate) * up (output_bytes_for); dup (dgu
-- when packed), in f32 scratch, or bf16 where the projections would have
-- cast their output gradients (the same bytes: theirs not taken).
function SwiGLUMLP:own_memory(B, T, dtype)
  local n = B * T * self.n_hidden
  local h, casts = Module.output_bytes_for(self.down_proj, n, dtype)
  local bf16_grads
  if self.gate_up then
    bf16_grads = dtype == "bf16" and self.gate_up:gemm_input() > 0
  else
    bf16_grads = dtype == "bf16" and self.gate_proj:gemm_input() > 0 and self.up_proj:gemm_input() > 0
  end
  local scratch = bf16_grads and 0 or lz.arena_bytes(self.gate_up and 2 * n or n)
  return { activations = h, casts = casts, scratch = scratch }
end

return SwiGLUMLP
