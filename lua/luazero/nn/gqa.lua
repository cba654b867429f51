-- nn/gqa.lua — Llama's self-attention (Hugging Face's LlamaAttention):
-- q_proj, k_proj, v_proj (no biases), rotary embeddings on q and k, causal
-- grouped-query attention (n_kv_head key/value heads, each shared by
-- n_head / n_kv_head query heads), o_proj.
--
-- The module owns the q, k and v weights itself (Hugging Face's names,
-- q_proj.weight, ...): a module's parameters lie one after another in every
-- buffer that binds them (the model's flat buffer, the ZeRO engine's
-- segments), so the three are one [(n_head + 2 n_kv_head) * head_dim, C]
-- matrix, and one GEMM writes the packed q|k|v rows the attention kernel
-- reads. Their gradients lie the same way.
local ffi = require("ffi")
local lz = require("luazero")
local Module = require("luazero.nn.module")
local Linear = require("luazero.nn.linear")
local lora = require("luazero.nn.lora")

local C = lz.C
local ops = lz.ops
local GQA = Module:extend("GroupedQueryAttention")

-- rope: { inv_freq = f32 tensor [head_dim / 2] }, shared by every layer.
-- std: the init std of the four projections.
function GQA.new(n_embd, n_head, n_kv_head, head_dim, rope, std)
  assert(n_head % n_kv_head == 0, "attention: n_head must be a multiple of n_kv_head")
  local self = setmetatable({}, GQA):init()
  self.n_embd, self.n_head, self.n_kv_head, self.head_dim = n_embd, n_head, n_kv_head, head_dim
  self.q_width, self.kv_width = n_head * head_dim, n_kv_head * head_dim
  self.width = self.q_width + 2 * self.kv_width
  self.rope = rope
  local init = { kind = "normal", std = std or 0.02 }
  self:param("q", { self.q_width, n_embd }, init, true, "q_proj.weight")
  self:param("k", { self.kv_width, n_embd }, init, true, "k_proj.weight")
  self:param("v", { self.kv_width, n_embd }, init, true, "v_proj.weight")
  self:add("o_proj", Linear.new(self.q_width, n_embd, { bias = false, std = std }))
  return self
end

local wrap_out = ffi.typeof("lz_tensor *[1]")

-- The q, k, v tensors of `t` (module.p or module.g) as one [width, C]
-- tensor over their memory (borrowed: free it after use).
function GQA:packed(t, what)
  local q, k, v = t.q, t.k, t.v
  local base = ffi.cast("char *", q.data)
  if ffi.cast("char *", k.data) ~= base + q:bytes() or
     ffi.cast("char *", v.data) ~= base + q:bytes() + k:bytes() then
    error(("attention %s: the q, k and v %s are not adjacent in memory; bind a module's " ..
           "parameters one after another"):format(self.path or "?", what), 0)
  end
  local out = wrap_out()
  if C.lz_tensor_wrap(out, q.data, q.dtype, 2, ffi.new("int64_t[2]", self.width, self.n_embd)) ~= 0 then
    error(ffi.string(C.lz_last_error()), 0)
  end
  out[0].device = q.device -- the memory's device (wrap assumes the host's)
  return out[0]
end

-- The shared inverse frequencies where t lives (a copy made once for a device).
function GQA:freqs_for(t)
  local rope = self.rope
  if t.device == rope.inv_freq.device then return rope.inv_freq end
  if not rope.on_device then rope.on_device = rope.inv_freq:to(t:device_name()) end
  return rope.on_device
end

function GQA:forward(x)
  local B, T = x:dim(1), x:dim(2)
  local qkv = self:activation({ B, T, self.width })
  local w = self:packed(self.p, "weights")
  local xw, ww = self:matmul_operands(x, self.lora and (lora.effective(self, w)) or w)
  ops.linear_forward(qkv, xw, ww, nil)
  C.lz_tensor_free(w)
  -- q and k turn in place; v passes.
  ops.rope_freqs_forward(qkv, qkv, self:freqs_for(qkv), self.n_head + self.n_kv_head, 0)
  local y = self:activation({ B, T, self.q_width })
  local lse = self:activation({ B, self.n_head, T })
  ops.attention_gqa_forward(y, lse, qkv, self.n_head, self.n_kv_head)
  self.input, self.qkv, self.att_out, self.lse = xw, qkv, y, lse
  return self:run_forward(self.o_proj, y)
end

function GQA:backward(dy)
  local dy_att = self:run_backward(self.o_proj, dy)
  local qkv, x = self.qkv, self.input
  local B, T = qkv:dim(1), qkv:dim(2)
  local dqkv = self:scratch({ B, T, self.width })
  ops.attention_gqa_backward(dqkv, dy_att, qkv, self.att_out, self.lse, self.n_head,
                             self.n_kv_head)
  -- the gradients of q and k before their turn
  ops.rope_freqs_backward(dqkv, dqkv, self:freqs_for(dqkv), self.n_head + self.n_kv_head, 0)
  local dx = self:scratch({ B, T, self.n_embd })
  local g = self.g
  local frozen = not (g.q or g.k or g.v)
  if not frozen and not (g.q and g.k and g.v) then
    error(("attention %s: q_proj, k_proj and v_proj are one matrix here; freeze all three or " ..
           "none"):format(self.path or "?"), 0)
  end
  local w, gw = self:packed(self.p, "weights"), not frozen and self:packed(g, "gradients") or nil
  local weff, copies = w, nil
  if self.lora then weff, copies = lora.effective(self, w) end
  local dyw, ww = self:matmul_operands(dqkv, weff)
  local dw = copies and lora.grad_workspace(self, self.width, self.n_embd, w:device_name()) or gw
  ops.linear_backward(dx, dw, nil, dyw, x, ww)
  if copies then lora.backward(self, dw, copies) end
  C.lz_tensor_free(w)
  if gw then C.lz_tensor_free(gw) end
  return dx
end

-- Besides o_proj: q|k|v, the attention output and lse; dqkv and dx; the
-- casts of the q|k|v GEMM (as a Linear's).
function GQA:own_memory(B, T, dtype)
  local x, qkv, w = B * T * self.n_embd, B * T * self.width, self.width * self.n_embd
  return {
    input = lz.arena_bytes(x),
    activations = lz.arena_bytes(qkv) + lz.arena_bytes(B * T * self.q_width) +
                  lz.arena_bytes(B * self.n_head * T),
    scratch = lz.arena_bytes(qkv) + lz.arena_bytes(x),
    casts = Module.matmul_cast_bytes(x, w, dtype) + Module.matmul_cast_bytes(qkv, w, dtype),
  }
end

return GQA
