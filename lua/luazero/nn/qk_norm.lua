-- nn/qk_norm.lua — QK-norm (Qwen3's q_norm and k_norm, Gemma 3's): an
-- RMSNorm over each head of q and of k inside the packed q|k|v rows, before
-- the rotary turn; v passes. Weights self_attn.q_norm.weight and
-- self_attn.k_norm.weight [head_dim] (the parent adds this module with name
-- false). offset: the weight acts as offset + w — 0 for Qwen3 (weights
-- start at 1), 1 for Gemma 3's x * (1 + w) (weights start at 0).
-- QKNorm.whole is OLMoE's (OlmoeAttention): one RMSNorm over the whole q
-- projection (q_norm.weight [n_head * head_dim]) and one over the whole k
-- projection ([n_kv_head * head_dim]), then, where clip_qkv is set, q, k
-- and v clamped to [-clip, clip]. One op (qk_norm_forward/backward) on
-- every device.
local lz = require("luazero")
local Module = require("luazero.nn.module")

local ops = lz.ops
local QKNorm = Module:extend("QKNorm")

-- n_head q heads of q_dim, n_kv_head k heads of k_dim.
local function make(n_head, n_kv_head, q_dim, k_dim, eps, offset, clip)
  local self = setmetatable({}, QKNorm):init()
  self.n_head, self.n_kv_head, self.q_dim, self.k_dim = n_head, n_kv_head, q_dim, k_dim
  self.eps, self.offset, self.clip = eps or 1e-6, offset or 0, clip or 0
  local init = { kind = self.offset == 0 and "ones" or "zeros" }
  self:param("q_w", { q_dim }, init, false, "q_norm.weight")
  self:param("k_w", { k_dim }, init, false, "k_norm.weight")
  return self
end

function QKNorm.new(n_head, n_kv_head, head_dim, eps, offset)
  return make(n_head, n_kv_head, head_dim, head_dim, eps, offset)
end

-- OLMoE's: q_width = n_head * head_dim, kv_width = n_kv_head * head_dim;
-- clip nil for none.
function QKNorm.whole(q_width, kv_width, eps, clip)
  return make(1, 1, q_width, kv_width, eps or 1e-5, 0, clip)
end

-- qkv [B, T, width] -> a new [B, T, width]: q and k heads normed, v copied;
-- qkv and each head's 1/rms are kept for backward.
function QKNorm:forward(qkv)
  local B, T, W = qkv:dim(1), qkv:dim(2), qkv:dim(3)
  local y = self:activation({ B, T, W })
  self.rstd = self:activation({ B * T * (self.n_head + self.n_kv_head) })
  ops.qk_norm_forward(y, self.rstd, qkv, self:cast(self.p.q_w, "f32"),
                      self:cast(self.p.k_w, "f32"), self.n_head, self.n_kv_head, self.eps,
                      self.offset, self.clip)
  self.input = qkv
  return y
end

-- dx is written over dy (the attention's dqkv scratch); no gradient passes
-- where the clip clamped.
function QKNorm:backward(dy)
  ops.qk_norm_backward(dy, self:grad_or_sink("q_w"), self:grad_or_sink("k_w"), dy, self.input,
                       self:cast(self.p.q_w, "f32"), self:cast(self.p.k_w, "f32"), self.rstd,
                       self.n_head, self.n_kv_head, self.offset, self.clip)
  return dy
end

-- The normed rows and 1/rms; casts: both weights in forward and backward.
function QKNorm:own_memory(B, T, dtype)
  local width = self.n_head * self.q_dim + 2 * self.n_kv_head * self.k_dim
  local x = lz.arena_bytes(B * T * width)
  return { input = x,
           activations = x + lz.arena_bytes(B * T * (self.n_head + self.n_kv_head)),
           casts = 2 * (Module.param_cast_bytes(self.q_dim, dtype) +
                        Module.param_cast_bytes(self.k_dim, dtype)) }
end

return QKNorm
