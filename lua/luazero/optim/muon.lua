-- optim/muon.lua — Muon (Keller Jordan's, as torch.optim.Muon defines it
-- in torch 2.15) for the 2-D weight matrices of the hidden layers, AdamW for
-- everything else (embeddings, the head, norms, biases), as DeepSpeed and
-- Moonlight run it: its declaration in the optimizer table
-- (optim/registry.lua).
--
-- A matrix's step, with g = grad * grad_scale:
--   B = B + (1 - mu) (g - B)                     (torch: buf.lerp_(g, 1 - mu))
--   U = B - (B - g)(1 - mu) if nesterov, else B  (torch: g.lerp(B, mu))
--   O = NS(U)                                    5 Newton-Schulz steps, fp32
--                                                or bf16 (ns_dtype), as torch
--   p = p (1 - lr wd) - adjust(lr, A, B) O
-- The engine runs it in three passes (zero/matrices.lua): prepare (the
-- momentum, on any slice of the matrix), orthogonalize (the whole matrix,
-- on the rank that owns it) and step (the update, on every slice again).
-- torch runs Newton-Schulz in bf16; here it is fp32 with the engine's GEMM
-- unless ns_dtype is "bfloat16": then torch's bf16 iteration, rounding where
-- torch rounds, on the engine's bf16 GEMM (fp32 accumulation).
--
-- States: m is Muon's momentum buffer on a matrix's elements and AdamW's m
-- elsewhere; v is AdamW's v elsewhere and, on a matrix's elements, the
-- step's update U then O (written before it is read in every step, so a
-- resume or a reshard reads nothing stale from it).
local bit = require("bit")
local ffi = require("ffi")
local lz = require("luazero")
local schema = require("luazero.optim.schema")

local ops = lz.ops

-- torch.optim.Muon's adjust_lr_fn: the learning rate of an A x B matrix.
local ADJUST = {
  original = function(lr, A, B) return lr * math.sqrt(math.max(1, A / B)) end,
  match_rms_adamw = function(lr, A, B) return lr * 0.2 * math.sqrt(math.max(A, B)) end,
  spectral_unclamped = function(lr, A, B) return lr * math.sqrt(A / B) end,
}

-- Newton-Schulz coefficients (torch's DEFAULT_A, _B, _C).
local NS_A, NS_B, NS_C = 3.4445, -4.7750, 2.0315

-- The scratch each Newton-Schulz makes for an A x B matrix (k: the
-- smaller side), as { shape, dtype } in the order it makes them: one
-- declaration that the iteration allocates from and the estimator counts
-- (orthogonalize_scratch below).
local SCRATCH = {
  float32 = function(A, B, k) -- gram, poly, the next X
    return { { { k, k }, "f32" }, { { k, k }, "f32" }, { { A, B }, "f32" } }
  end,
  bfloat16 = function(A, B, k) -- X in bf16, gram (f32), gram and poly in bf16
    return { { { A, B }, "bf16" }, { { k, k }, "f32" }, { { k, k }, "bf16" }, { { k, k }, "bf16" } }
  end,
}

local ELEMENT_BYTES = { f32 = 4, bf16 = 2 }

-- The scratch tensors of ns_dtype's Newton-Schulz for an A x B matrix on dev.
local function scratch(ns_dtype, A, B, dev)
  local out = {}
  for i, t in ipairs(SCRATCH[ns_dtype](A, B, math.min(A, B))) do
    out[i] = lz.tensor(t[1], t[2], "workspace", dev)
  end
  return unpack(out)
end

-- X <- NS(X) in place, X an f32 A x B matrix. torch works on the wide
-- orientation (rows <= cols): for a tall X it runs on X^T, which here is
-- the same products with the GEMM's transpose flags, never a copy.
local function newton_schulz(X, A, B, steps, eps)
  local tall = A > B
  local norm = math.sqrt(X:sq_norm())
  ops.scale(X, 1 / math.max(norm, eps))
  local gram, poly, nxt = scratch("float32", A, B, X:device_name())
  local cur, out = X, nxt
  for _ = 1, steps do
    -- gram = Y Y^T, with Y = X (wide) or X^T (tall)
    if tall then ops.matmul(gram, cur, cur, 1, 0, 1, 0) else ops.matmul(gram, cur, cur, 0, 1, 1, 0) end
    -- poly = b gram + c gram gram
    poly:copy(gram)
    ops.matmul(poly, gram, gram, 0, 0, NS_C, NS_B)
    -- Y <- a Y + poly Y; for a tall X: X <- a X + X poly^T
    out:copy(cur)
    if tall then ops.matmul(out, cur, poly, 0, 1, 1, NS_A) else ops.matmul(out, poly, cur, 0, 0, 1, NS_A) end
    cur, out = out, cur
  end
  if cur ~= X then X:copy(cur) end
  gram:free(); poly:free(); nxt:free()
end

-- A number rounded to bf16 (to nearest, ties to even): what a 0-d bf16
-- tensor holds.
local bits = ffi.new("union { float f; uint32_t u; }")
local function round_bf16(x)
  bits.f = x
  local u = bits.u
  bits.u = bit.band(u + 0x7fff + bit.band(bit.rshift(u, 16), 1), 0xffff0000)
  return bits.f
end

-- torch.optim.Muon's Newton-Schulz itself: X in bf16, each product in bf16
-- from an fp32 accumulation (the engine's bf16 GEMM writes fp32, rounded
-- once here as torch's bf16 addmm rounds its result), the norm of the bf16
-- values rounded to bf16 (a bf16 tensor's norm(); summed in double here,
-- in fp32 by torch). torch divides by the norm where this multiplies by its
-- inverse. Both differ from torch's in the last fp32 bit at most, which the
-- rounding to bf16 hides but for values within that bit of a tie.
local function newton_schulz_bf16(X, A, B, steps, eps)
  local tall = A > B
  local x, gram, gram_h, poly_h = scratch("bfloat16", A, B, X:device_name())
  x:copy(X)
  local norm = round_bf16(math.max(round_bf16(math.sqrt(x:sq_norm())), eps))
  X:copy(x)
  ops.scale(X, 1 / norm)
  x:copy(X)
  for _ = 1, steps do
    if tall then ops.matmul(gram, x, x, 1, 0, 1, 0) else ops.matmul(gram, x, x, 0, 1, 1, 0) end
    gram_h:copy(gram)
    -- gram (its bf16 value) becomes b gram + c gram gram
    gram:copy(gram_h)
    ops.matmul(gram, gram_h, gram_h, 0, 0, NS_C, NS_B)
    poly_h:copy(gram)
    X:copy(x)
    if tall then ops.matmul(X, x, poly_h, 0, 1, 1, NS_A) else ops.matmul(X, poly_h, x, 0, 0, 1, NS_A) end
    x:copy(X)
  end
  X:copy(x)
  x:free(); gram:free(); gram_h:free(); poly_h:free()
end

-- ns_dtype -> the Newton-Schulz that runs in it.
local NEWTON_SCHULZ = { float32 = newton_schulz, bfloat16 = newton_schulz_bf16 }

return {
  name = "Muon",
  types = { "Muon" },
  -- torch.optim.Muon's defaults; betas and adam_eps: the AdamW that the
  -- other parameters get (Moonlight's: the same lr and weight_decay).
  params = {
    { "lr", "number", min = 0, default = 1e-3 },
    { "momentum", "number", min = 0, below = 1, default = 0.95 },
    { "nesterov", "boolean", default = true },
    { "ns_steps", "count", min = 1, below = 100, default = 5 },
    -- Newton-Schulz's dtype: torch.optim.Muon's (and Keller Jordan's,
    -- Moonlight's, DeepSpeed's) is bfloat16; float32 is the default here.
    { "ns_dtype", "choice", values = { "float32", "bfloat16" }, prefix = "torch.",
      default = "float32" },
    { "eps", "number", min = 0, default = 1e-7 },
    { "weight_decay", "number", min = 0, default = 0.1 },
    { "adjust_lr_fn", "choice", values = { "original", "match_rms_adamw", "spectral_unclamped" },
      default = "original" },
    { "betas", "betas", default = { 0.9, 0.95 } },
    { "adam_eps", "number", min = 0, default = 1e-8 },
  },
  states = { { name = "m", format = "f32" }, { name = "v", format = "f32" } },
  matrix_state = 2,

  -- bf16_stochastic_round (torchao's flag, as AdamW's): no fp32 master.
  accepted = { bf16_stochastic_round = true },
  read_config = function(p, key)
    return { decoupled_weight_decay = true, master_format = schema.master_format(p, key) }
  end,

  init = function(self) self.args = lz.adamw_args({}) end,

  -- Which parameters are Muon's: a 2-D weight of a hidden layer (entry:
  -- the engine's parameter entry; hidden: it lies in the model's blocks).
  matrix = function(entry, hidden) return hidden and #entry.shape == 2 end,

  -- A matrix piece's momentum and its update U (into v); g is scaled in
  -- place (it is read once). torch.lerp's two forms, operation for
  -- operation: start + w (end - start) for a weight w below 1/2, else
  -- end - (end - start)(1 - w).
  prepare = function(self, call, _, grad_scale)
    local g, m, u = call.g, call.s[1], call.s[2]
    local w = 1 - self.momentum
    if grad_scale ~= 1 then ops.scale(g, grad_scale) end
    local function lerp(out, start, finish, weight) -- out = start.lerp(finish, weight)
      if weight < 0.5 then
        u:copy(finish)
        ops.axpy(u, -1, start)
        if out ~= start then out:copy(start) end
        ops.axpy(out, weight, u)
      else
        u:copy(finish)
        ops.axpy(u, -1, start)
        ops.scale(u, -(1 - weight))
        ops.axpy(u, 1, finish)
        if out ~= u then out:copy(u) end
      end
    end
    lerp(m, m, g, w)
    if self.nesterov then lerp(u, g, m, self.momentum) else u:copy(m) end
  end,

  -- The whole matrix u (an f32 A x B view of the gathered U) becomes O.
  orthogonalize = function(self, u, A, B)
    NEWTON_SCHULZ[self.ns_dtype](u, A, B, self.ns_steps, self.eps)
  end,

  -- The workspace bytes orthogonalize makes and frees for an A x B matrix.
  orthogonalize_scratch = function(self, A, B)
    local bytes = 0
    for _, t in ipairs(SCRATCH[self.ns_dtype](A, B, math.min(A, B))) do
      bytes = bytes + t[1][1] * t[1][2] * ELEMENT_BYTES[t[2]]
    end
    return bytes
  end,

  -- call: p, g, s = { m, v }, w, decay, matrix ({ A, B } for a Muon piece,
  -- whose v holds O by now; nil: AdamW's piece).
  step = function(self, call, step, lr, grad_scale)
    local mat = call.matrix
    if mat then
      ops.scale(call.p, 1 - lr * self.weight_decay)
      ops.axpy(call.p, -ADJUST[self.adjust_lr_fn](lr, mat[1], mat[2]), call.s[2])
      if call.w then call.w:convert(call.p) end
      return
    end
    local a = self.args
    a.lr, a.beta1, a.beta2, a.eps = lr, self.beta1, self.beta2, self.adam_eps
    a.grad_scale, a.step = grad_scale, step
    a.weight_decay = call.decay and self.weight_decay or 0
    ops.adamw_step(call.p, call.g, call.s[1], call.s[2], call.w, a)
  end,
}
