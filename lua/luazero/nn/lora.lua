-- nn/lora.lua — LoRA adapters around a Linear (models/lora.lua puts them in a
-- model): the wrapper holds the frozen Linear and, for each adapted block of
-- its weight's rows, two trainable matrices A [r, in] and B [rows, r]:
--   y = x W^T + b + scale * (x A^T) B^T     (scale = alpha / r)
-- PEFT's own order. The Linear runs as it would unadapted (its GEMMs in the
-- working dtype, bf16 included, and no gradient for its frozen weight); the
-- adapters add their rank-r products in fp32 (A and B widened to fp32, the
-- input kept in fp32): per adapter, forward y += s T Bp^T with T = x A^T,
-- backward dx += s G A, gA += s G^T x, gB += s (dy^T T)[its rows], with G =
-- dy Bp, where Bp is B placed in its rows of an [out, r] matrix of zeros
-- (so every operand is one contiguous matrix; the zero rows cost r x out
-- multiply-adds per position).
--
-- The Linear is added with name false: its path, and so its parameters'
-- names, are the wrapper's; the adapters are named <prefix>lora_A.weight,
-- <prefix>lora_B.weight (PEFT's names). The wrapper lists the Linear's
-- parameters before its own (walk), so wrapping keeps every parameter's
-- place in the canonical order and the adapters follow the weight they adapt.
local lz = require("luazero")
local Module = require("luazero.nn.module")

local ops = lz.ops
local LoRA = Module:extend("LoRA")

-- linear: the Linear to wrap; adapters: { {name, row0, rows [, r, scale]},
-- ... } in row order (name: the adapted module's name for a part of a
-- packed weight, "" for the whole weight; r and scale: that adapter's own,
-- as PEFT's rank_pattern and alpha_pattern give them); r: the rank; scale:
-- alpha / r (or alpha / sqrt(r): rsLoRA).
function LoRA.new(linear, adapters, r, scale)
  local self = setmetatable({}, LoRA):init()
  self.base, self.n_in, self.n_out, self.r, self.scale = linear, linear.n_in, linear.n_out, r, scale
  self:add(false, linear)
  self.adapters = {}
  local n_in = linear.n_in
  for i, ad in ipairs(adapters) do
    local prefix = ad[1] == "" and "" or (ad[1] .. ".")
    local a_key, b_key = "lora_A_" .. i, "lora_B_" .. i
    local ar = ad[4] or r
    self.r = math.max(self.r, ar) -- the workspaces' width
    -- (2-D weights: decayed, as DeepSpeed decays every parameter and the
    -- Trainer every one but biases and norms)
    self:param(a_key, { ar, n_in }, { kind = "normal", std = 1 / math.sqrt(n_in) }, true,
               prefix .. "lora_A.weight")
    self:param(b_key, { ad[3], ar }, { kind = "zeros" }, true, prefix .. "lora_B.weight")
    self.adapters[i] = { a = a_key, b = b_key, row0 = ad[2], rows = ad[3], r = ar,
                         scale = ad[5] or scale }
  end
  return self
end

-- The wrapped Linear first, then the adapters (see the header).
function LoRA:walk(fn, prefix)
  prefix = prefix or ""
  self.path = prefix
  for _, c in ipairs(self.children) do c.module:walk(fn, prefix) end
  fn(self, prefix)
end

-- fp32 workspace `slot` of the model's (ctx.lora_ws), grown to n elements;
-- nn/lora_experts.lua's adapters use it too, so free_workspaces frees all.
function LoRA.workspace(m, slot, n, device)
  local ws = m.ctx.lora_ws or {}
  m.ctx.lora_ws = ws
  local t = ws[slot]
  if not t or t:numel() < n or t:device_name() ~= device then
    if t then t:free() end
    t = lz.tensor({ n }, "f32", "workspace", device)
    ws[slot] = t
  end
  return t
end

-- Adapter i's fp32 operands: A [r, in] and Bp [out, r] (B in its rows, zeros
-- elsewhere), in the workspace (valid until the next call).
function LoRA:operands(ad, dev)
  local r, n_in, n_out = ad.r, self.n_in, self.n_out
  local ab = LoRA.workspace(self, "ab", r * n_in + n_out * r, dev)
  local a = ab:view(0, { r, n_in }):copy(self.p[ad.a])
  local bp = ab:view(r * n_in, { n_out, r })
  if ad.rows ~= n_out then bp:fill(0) end
  bp:view(ad.row0 * r, { ad.rows, r }):copy(self.p[ad.b])
  return a, bp
end

-- T = x A^T [rows of x, r] in the workspace (r: the adapter's).
function LoRA:down(x, a, dev, r)
  local n = x:numel() / self.n_in
  local t = LoRA.workspace(self, "t", n * r, dev):view(0, { n, r })
  ops.matmul(t, x:view(0, { n, self.n_in }), a, 0, 1, 1, 0)
  return t
end

function LoRA:forward(x)
  local y = self:run_forward(self.base, x)
  self.x = x
  local dev = y:device_name()
  local rows = x:numel() / self.n_in
  local y2 = y:view(0, { rows, self.n_out })
  for _, ad in ipairs(self.adapters) do
    local a, bp = self:operands(ad, dev)
    ops.matmul(y2, self:down(x, a, dev, ad.r), bp, 0, 1, ad.scale, 1)
  end
  return y
end

function LoRA:backward(dy)
  local dx = self:run_backward(self.base, dy)
  local x, dev = self.x, dy:device_name()
  local rows = x:numel() / self.n_in
  local x2, dy2 = x:view(0, { rows, self.n_in }), dy:view(0, { rows, self.n_out })
  local dx2 = dx:view(0, { rows, self.n_in })
  for _, ad in ipairs(self.adapters) do
    local r, s = ad.r, ad.scale
    local a, bp = self:operands(ad, dev)
    local t = self:down(x, a, dev, r)
    local g = LoRA.workspace(self, "g", rows * r, dev):view(0, { rows, r })
    ops.matmul(g, dy2, bp, 0, 0, 1, 0)                          -- G = dy Bp
    local gbp = LoRA.workspace(self, "gbp", self.n_out * r, dev):view(0, { self.n_out, r })
    ops.matmul(gbp, dy2, t, 1, 0, 1, 0)                         -- dy^T T
    ops.axpy(self.g[ad.b], s, gbp:view(ad.row0 * r, { ad.rows, r }))
    ops.matmul(self.g[ad.a], g, x2, 1, 0, s, 1)                 -- gA += s G^T x
    ops.matmul(dx2, g, a, 0, 0, s, 1)                           -- dx += s G A
  end
  return dx
end

-- The wrapped Linear's report in the working dtype (its operand casts);
-- the adapters' operands lie in workspaces outside the arenas.
function LoRA:memory(B, T, dtype)
  return self.base:memory(B, T, dtype)
end

-- Frees the workspaces of a model's adapters.
function LoRA.free_workspaces(model)
  for _, t in pairs(model.ctx.lora_ws or {}) do t:free() end
  model.ctx.lora_ws = nil
end

return LoRA
