-- nn/attention.lua — causal multi-head self-attention: c_attn (C -> 3C: q, k,
-- v), the fused attention kernel, c_proj (C -> C). When a batch packs
-- documents (the model's ctx.extra.seg), a token attends within its own.
local lz = require("luazero")
local Module = require("luazero.nn.module")
local Linear = require("luazero.nn.linear")

local ops = lz.ops
local CausalSelfAttention = Module:extend("CausalSelfAttention")

function CausalSelfAttention.new(n_embd, n_head, proj_std)
  assert(n_embd % n_head == 0, "attention: n_embd must be a multiple of n_head")
  local self = setmetatable({}, CausalSelfAttention):init()
  self.n_embd, self.n_head = n_embd, n_head
  self:add("c_attn", Linear.new(n_embd, 3 * n_embd))
  self:add("c_proj", Linear.new(n_embd, n_embd, { std = proj_std }))
  return self
end

function CausalSelfAttention:forward(x)
  local B, T = x:dim(1), x:dim(2)
  local qkv = self:run_forward(self.c_attn, x)
  local y = self:activation({ B, T, self.n_embd })
  local lse = self:activation({ B, self.n_head, T })
  local extra = self.ctx.extra
  local seg = extra and extra.seg
  self.bf16 = self.ctx.cast_dtype == "bf16" -- bf16 training: the tile products in bf16 too
  if self.bf16 then
    ops.attention_bf16_forward(y, lse, qkv, seg, self.n_head, self.n_head, 0, 0, 0)
  elseif seg then
    ops.attention_seg_forward(y, lse, qkv, seg, self.n_head, self.n_head)
  else
    ops.attention_forward(y, lse, qkv, self.n_head)
  end
  self.qkv, self.att_out, self.lse, self.seg = qkv, y, lse, seg
  return self:run_forward(self.c_proj, y)
end

function CausalSelfAttention:backward(dy)
  local dy_att = self:run_backward(self.c_proj, dy)
  local qkv = self.qkv
  local dqkv = self:scratch({ qkv:dim(1), qkv:dim(2), qkv:dim(3) })
  if self.bf16 then
    ops.attention_bf16_backward(dqkv, dy_att, qkv, self.att_out, self.lse, self.seg, self.n_head,
                                self.n_head, 0, 0, 0)
  elseif self.seg then
    ops.attention_seg_backward(dqkv, dy_att, qkv, self.att_out, self.lse, self.seg, self.n_head,
                               self.n_head)
  else
    ops.attention_backward(dqkv, dy_att, qkv, self.att_out, self.lse, self.n_head)
  end
  return self:run_backward(self.c_attn, dqkv)
end

-- Generation: x [B, T, C] holds T new positions of each row; their keys and
-- values join the cache kv = { k, v, pos } (lua/luazero/generate.lua), and
-- each query attends to every cached position up to its own. No backward.
function CausalSelfAttention:forward_cached(x, kv)
  local qkv = self:run_forward(self.c_attn, x)
  local y = self:activation({ x:dim(1), x:dim(2), self.n_embd })
  lz.check(lz.C.lz_attention_decode(y, qkv, kv.k, kv.v, kv.pos, self.n_head, self.n_head))
  return self:run_forward(self.c_proj, y)
end

-- Besides c_attn and c_proj: the attention output and lse, dqkv.
function CausalSelfAttention:own_memory(B, T)
  local BTC = B * T * self.n_embd
  return { activations = lz.arena_bytes(BTC) + lz.arena_bytes(B * self.n_head * T),
           scratch = lz.arena_bytes(3 * BTC) }
end

return CausalSelfAttention
