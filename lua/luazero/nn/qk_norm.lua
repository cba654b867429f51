-- nn/qk_norm.lua — QK-norm (Qwen3's q_norm and k_norm, Gemma 3's): an
-- RMSNorm over each head of q and of k inside the packed q|k|v rows, before
-- the rotary turn; v passes. Weights self_attn.q_norm.weight and
-- self_attn.k_norm.weight [head_dim] (the parent adds this module with name
-- false). offset: the weight acts as offset + w — 0 for Qwen3 (weights
-- start at 1), 1 for Gemma 3's x * (1 + w) (weights start at 0).
local lz = require("luazero")
local Module = require("luazero.nn.module")

local ops = lz.ops
local QKNorm = Module:extend("QKNorm")

function QKNorm.new(n_head, n_kv_head, head_dim, eps, offset)
  local self = setmetatable({}, QKNorm):init()
  self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, head_dim
  self.eps, self.offset = eps or 1e-6, offset or 0
  local init = { kind = self.offset == 0 and "ones" or "zeros" }
  self:param("q_w", { head_dim }, init, false, "q_norm.weight")
  self:param("k_w", { head_dim }, init, false, "k_norm.weight")
  return self
end

-- qkv [B, T, width] -> a new [B, T, width]: q and k heads normed, v copied;
-- qkv and each head's 1/rms are kept for backward.
function QKNorm:forward(qkv)
  local B, T, W = qkv:dim(1), qkv:dim(2), qkv:dim(3)
  local y = self:activation({ B, T, W })
  self.rstd = self:activation({ B * T * (self.n_head + self.n_kv_head) })
  ops.qk_norm_forward(y, self.rstd, qkv, self:cast(self.p.q_w, "f32"),
                      self:cast(self.p.k_w, "f32"), self.n_head, self.n_kv_head, self.eps,
                      self.offset)
  self.input = qkv
  return y
end

-- dx is written over dy (the attention's dqkv scratch).
function QKNorm:backward(dy)
  ops.qk_norm_backward(dy, self:grad_or_sink("q_w"), self:grad_or_sink("k_w"), dy, self.input,
                       self:cast(self.p.q_w, "f32"), self:cast(self.p.k_w, "f32"), self.rstd,
                       self.n_head, self.n_kv_head, self.offset)
  return dy
end

-- The normed rows and 1/rms; casts: both weights in forward and backward.
function QKNorm:own_memory(B, T, dtype)
  local width = (self.n_head + 2 * self.n_kv_head) * self.head_dim
  local x = lz.arena_bytes(B * T * width)
  return { input = x,
           activations = x + lz.arena_bytes(B * T * (self.n_head + self.n_kv_head)),
           casts = 4 * Module.param_cast_bytes(self.head_dim, dtype) }
end

return QKNorm
