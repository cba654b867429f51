-- nn/gqa.lua — Llama's self-attention (Hugging Face's LlamaAttention):
-- q_proj, k_proj, v_proj (no biases), rotary embeddings on q and k, causal
-- grouped-query attention (n_kv_head key/value heads, each shared by
-- n_head / n_kv_head query heads), o_proj. When a batch packs documents
-- (the model's ctx.extra), q and k turn by each token's position within its
-- document (extra.pos) and a token attends within its own (extra.seg).
--
-- q_proj, k_proj and v_proj are one PackedLinear (nn/packed_linear.lua),
-- added with name false so their weights keep Hugging Face's names
-- (self_attn.q_proj.weight, ...): one GEMM writes the packed q|k|v rows the
-- attention kernel reads. A family whose file holds them as one tensor
-- (Phi-3's self_attn.qkv_proj.weight) names it in opts.qkv_name.
--
-- A family's options (opts, absent = Llama's behaviour):
--   window   a query sees its `window` latest keys (the kernel's option)
--   softcap  scores s -> softcap * tanh(s / softcap)
--   scale    the scores' factor instead of 1/sqrt(head_dim)
--   bias     a bias on q_proj, k_proj and v_proj, none on o_proj (Qwen2)
--   qk_norm  { eps =, offset = }: an RMSNorm over each q and k head before
--            the rotary turn (nn/qk_norm.lua; Qwen3 offset 0, Gemma 3 1)
--   qk_norm_full { eps =, clip = }: an RMSNorm over the whole q and the whole
--            k projection, then q, k, v clamped to [-clip, clip] where clip
--            is set (OLMoE; QKNorm.whole in nn/qk_norm.lua)
--   qkv_name the one tensor's name of a fused q|k|v projection (Phi-3)
--   rotary_dim (Phi-3's partial_rotary_factor): only the first rotary_dim
--            values of each head turn; with it, or a rope whose cos and sin
--            scale (nn/rope.lua), q and k turn through the rope_ext kernel.
local ffi = require("ffi")
local lz = require("luazero")
local Module = require("luazero.nn.module")
local Linear = require("luazero.nn.linear")
local PackedLinear = require("luazero.nn.packed_linear")
local QKNorm = require("luazero.nn.qk_norm")

local ops = lz.ops
local GQA = Module:extend("GroupedQueryAttention")

-- rope: { inv_freq = f32 tensor [head_dim / 2] } (nn/rope.lua), shared by
-- every layer. std: the init std of the four projections. opts: what a
-- family changes of Llama's attention (nil: none).
function GQA.new(n_embd, n_head, n_kv_head, head_dim, rope, std, opts)
  assert(n_head % n_kv_head == 0, "attention: n_head must be a multiple of n_kv_head")
  local self = setmetatable({}, GQA):init()
  self.n_embd, self.n_head, self.n_kv_head, self.head_dim = n_embd, n_head, n_kv_head, head_dim
  self.q_width, self.kv_width = n_head * head_dim, n_kv_head * head_dim
  self.width = self.q_width + 2 * self.kv_width
  self.rope = rope
  self.opts = opts or {}
  local o = self.opts
  -- the kernel's options; all 0 runs the plain entries
  self.window, self.softcap, self.scale = o.window or 0, o.softcap or 0, o.scale or 0
  self.plain = self.window == 0 and self.softcap == 0 and self.scale == 0
  local parts = { { "q_proj", self.q_width }, { "k_proj", self.kv_width },
                  { "v_proj", self.kv_width } }
  if o.qkv_name then parts = { { o.qkv_name, self.width } } end
  self.qkv_proj = self:add(false, PackedLinear.new(n_embd, parts, std, { bias = o.bias }))
  self:add("o_proj", Linear.new(self.q_width, n_embd, { bias = false, std = std }))
  local qk = self.opts.qk_norm
  if qk then
    self.qk_norm = self:add(false, QKNorm.new(n_head, n_kv_head, head_dim, qk.eps, qk.offset))
  end
  local full = self.opts.qk_norm_full
  if full then
    self.qk_norm = self:add(false, QKNorm.whole(self.q_width, self.kv_width, full.eps, full.clip))
  end
  return self
end

-- x goes to the q|k|v projection only.
function GQA:gemm_input() return self.qkv_proj:gemm_input() end

-- The q|k|v projection of x, its q and k heads normed when the family says so.
function GQA:project(x)
  local qkv = self:run_forward(self.qkv_proj, x)
  if self.qk_norm then qkv = self:run_forward(self.qk_norm, qkv) end
  return qkv
end

-- The shared inverse frequencies where t lives (a copy made once for a
-- device): the set for a largest position + 1 of seq_len (nn/rope.lua).
function GQA:freqs_for(t, seq_len)
  local rope = self.rope
  if rope.set_for then rope = rope:set_for(seq_len) end
  if t.device == rope.inv_freq.device then return rope.inv_freq end
  if not rope.on_device then rope.on_device = rope.inv_freq:to(t:device_name()) end
  return rope.on_device
end

-- The largest of pos (i32 [B, T]) + 1: how transformers picks LongRoPE's set.
local function span_of(pos)
  local host = pos:device_name() ~= "cpu" and pos:to("cpu")
  local t = host or pos
  local p, top = ffi.cast("const int32_t *", t.data), -1
  for i = 0, t:numel() - 1 do
    if p[i] > top then top = p[i] end
  end
  if host then host:free() end
  return top + 1
end

-- Turns the q and k heads of t forward or back (sign 1 or -1) into out
-- (default: t itself; v passes), row positions from pos or offset + t;
-- seq_len: the largest position + 1 (which frequencies a LongRoPE model
-- uses).
function GQA:turn(t, sign, pos, offset, seq_len, out)
  local heads, rope = self.n_head + self.n_kv_head, self.rope
  local freqs = self:freqs_for(t, seq_len)
  out = out or t
  if self.opts.rotary_dim or rope.scale then
    local f = sign > 0 and ops.rope_ext_forward or ops.rope_ext_backward
    f(out, t, freqs, pos, heads, self.head_dim, pos and 0 or offset, rope.scale or 0)
  elseif pos then
    local f = sign > 0 and ops.rope_pos_forward or ops.rope_pos_backward
    f(out, t, freqs, pos, heads)
  else
    local f = sign > 0 and ops.rope_freqs_forward or ops.rope_freqs_backward
    f(out, t, freqs, heads, offset)
  end
end

-- The largest position + 1 of this forward (only LongRoPE asks).
function GQA:span(T, pos)
  if not (self.rope.long and pos) then return T end
  return span_of(pos)
end

function GQA:forward(x)
  local B, T = x:dim(1), x:dim(2)
  local qkv = self:project(x)
  local extra = self.ctx.extra
  local pos, seg = extra and extra.pos, extra and extra.seg
  local span = self:span(T, pos)
  self:turn(qkv, 1, pos, 0, span) -- q and k turn in place; v passes
  local y = self:activation({ B, T, self.q_width })
  local lse = self:activation({ B, self.n_head, T })
  self.bf16 = self.ctx.cast_dtype == "bf16" -- bf16 training: the tile products in bf16 too
  if self.bf16 then
    ops.attention_bf16_forward(y, lse, qkv, seg, self.n_head, self.n_kv_head, self.window,
                               self.softcap, self.scale)
  elseif not self.plain then
    ops.attention_opts_forward(y, lse, qkv, seg, self.n_head, self.n_kv_head, self.window,
                               self.softcap, self.scale)
  elseif seg then
    ops.attention_seg_forward(y, lse, qkv, seg, self.n_head, self.n_kv_head)
  else
    ops.attention_gqa_forward(y, lse, qkv, self.n_head, self.n_kv_head)
  end
  self.qkv, self.att_out, self.lse, self.pos, self.seg, self.seq_span = qkv, y, lse, pos, seg, span
  return self:run_forward(self.o_proj, y)
end

function GQA:backward(dy)
  local dy_att = self:run_backward(self.o_proj, dy)
  local qkv = self.qkv
  local dqkv = self:scratch({ qkv:dim(1), qkv:dim(2), self.width })
  if self.bf16 then
    ops.attention_bf16_backward(dqkv, dy_att, qkv, self.att_out, self.lse, self.seg, self.n_head,
                                self.n_kv_head, self.window, self.softcap, self.scale)
  elseif not self.plain then
    ops.attention_opts_backward(dqkv, dy_att, qkv, self.att_out, self.lse, self.seg, self.n_head,
                                self.n_kv_head, self.window, self.softcap, self.scale)
  elseif self.seg then
    ops.attention_seg_backward(dqkv, dy_att, qkv, self.att_out, self.lse, self.seg, self.n_head,
                               self.n_kv_head)
  else
    ops.attention_gqa_backward(dqkv, dy_att, qkv, self.att_out, self.lse, self.n_head,
                               self.n_kv_head)
  end
  -- the gradients of q and k before their turn: in place, or (no q/k norm
  -- between) written as the projection's backward GEMMs read them
  local d = dqkv
  if not self.qk_norm and self:writes_bf16_for(self.qkv_proj) then
    d = self.ctx.cast_arena:tensor(dqkv:sizes(), "bf16")
  end
  self:turn(dqkv, -1, self.pos, 0, self.seq_span, d)
  if self.qk_norm then d = self:run_backward(self.qk_norm, d) end
  return self:run_backward(self.qkv_proj, d)
end

-- Generation: x [B, T, n_embd] holds T new positions of each row, row b
-- starting at position kv.at[b]: q and k turn by those positions, then the
-- keys and values join the cache kv = { k, v, pos, at }
-- (lua/luazero/generate.lua) and each query attends to every cached
-- position up to its own (with a window, its `window` latest: kv.k and
-- kv.v may then be rings of window positions). No backward.
function GQA:forward_cached(x, kv)
  local B, T = x:dim(1), x:dim(2)
  local qkv = self:project(x)
  -- A row's largest position + 1 is at[b] + T: a LongRoPE row turns as
  -- transformers turns that prompt alone.
  local at, same = kv.at, true
  for b = 2, B do same = same and at[b] == at[1] end
  if same then
    self:turn(qkv, 1, nil, at[1], at[1] + T)
  else
    for b = 1, B do
      self:turn(qkv:view((b - 1) * T * self.width, { 1, T, self.width }), 1, nil, at[b], at[b] + T)
    end
  end
  local y = self:activation({ B, T, self.q_width })
  lz.check(lz.C.lz_attention_opts_decode(y, qkv, kv.k, kv.v, kv.pos, self.n_head, self.n_kv_head,
                                         self.window, self.softcap, self.scale))
  return self:run_forward(self.o_proj, y)
end

-- Besides the projections: the attention output and lse; dqkv. The input
-- is the q|k|v projection's.
function GQA:own_memory(B, T)
  return {
    input = lz.arena_bytes(B * T * self.n_embd),
    activations = lz.arena_bytes(B * T * self.q_width) + lz.arena_bytes(B * self.n_head * T),
    scratch = lz.arena_bytes(B * T * self.width),
  }
end

return GQA
