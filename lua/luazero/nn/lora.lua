-- nn/lora.lua — LoRA adapters around a Linear (models/lora.lua puts them in a
-- model): the wrapper holds the frozen Linear and, for each adapted block of
-- its weight's rows, two trainable matrices A [r, in] and B [rows, r]; the
-- Linear computes with the effective weight W + (alpha / r) B A.
--
-- The effective weight is formed in an fp32 workspace (W widened to fp32,
-- scale * B A added into each adapter's rows) and handed to the Linear's
-- forward and backward in place of its own; the gradient the Linear's GEMM
-- writes for it, into another workspace, gives A's and B's.
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

-- linear: the Linear to wrap; adapters: { {name, row0, rows}, ... } in row
-- order (name: the adapted module's name for a part of a packed weight,
-- "" for the whole weight); r: the rank; scale: alpha / r.
function LoRA.new(linear, adapters, r, scale)
  local self = setmetatable({}, LoRA):init()
  self.base, self.n_in, self.n_out, self.r, self.scale = linear, linear.n_in, linear.n_out, r, scale
  self:add(false, linear)
  self.adapters = {}
  local n_in = linear.n_in
  for i, ad in ipairs(adapters) do
    local prefix = ad[1] == "" and "" or (ad[1] .. ".")
    local a_key, b_key = "lora_A_" .. i, "lora_B_" .. i
    self:param(a_key, { r, n_in }, { kind = "normal", std = 1 / math.sqrt(n_in) }, false,
               prefix .. "lora_A.weight")
    self:param(b_key, { ad[3], r }, { kind = "zeros" }, false, prefix .. "lora_B.weight")
    self.adapters[i] = { a = a_key, b = b_key, row0 = ad[2], rows = ad[3] }
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

-- fp32 workspace of the model's (ctx.lora_ws), grown to n elements.
local function workspace(m, slot, n, device)
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

-- The effective weight: the Linear's (any dtype) widened to fp32 with every
-- adapter added into its rows. Returns an f32 tensor in the workspace
-- (valid until the next call) and the adapters' fp32 copies
-- { [i] = {a = A32, b = B32} }.
function LoRA:effective()
  local base = self.base
  local w = base:weight()
  local dev = w:device_name()
  local rows, n_in, r = self.n_out, self.n_in, self.r
  local weff = workspace(self, "weff", rows * n_in, dev):view(0, { rows, n_in }):copy(w)
  base:release(w)
  local copies, off = {}, 0
  local ab = workspace(self, "ab", #self.adapters * r * n_in + r * self:adapted_rows(), dev)
  for i, ad in ipairs(self.adapters) do
    local a = ab:view(off, { r, n_in }):copy(self.p[ad.a])
    off = off + r * n_in
    local b = ab:view(off, { ad.rows, r }):copy(self.p[ad.b])
    off = off + ad.rows * r
    ops.matmul(weff:view(ad.row0 * n_in, { ad.rows, n_in }), b, a, 0, 0, self.scale, 1)
    copies[i] = { a = a, b = b }
  end
  return weff, copies
end

function LoRA:adapted_rows()
  local n = 0
  for _, ad in ipairs(self.adapters) do n = n + ad.rows end
  return n
end

function LoRA:forward(x)
  return self:run_forward(self.base, x, (self:effective()))
end

-- From dweff (the effective weight's gradient): gB += s dW A^T, gA += s B^T dW.
function LoRA:backward(dy)
  local weff, copies = self:effective()
  local n_in = self.n_in
  local dweff = workspace(self, "dweff", self.n_out * n_in, weff:device_name())
                :view(0, { self.n_out, n_in }):fill(0)
  local dx = self:run_backward(self.base, dy, weff, dweff)
  for i, ad in ipairs(self.adapters) do
    local d = dweff:view(ad.row0 * n_in, { ad.rows, n_in })
    ops.matmul(self.g[ad.b], d, copies[i].a, 0, 1, self.scale, 1)
    ops.matmul(self.g[ad.a], copies[i].b, d, 1, 0, self.scale, 1)
  end
  return dx
end

-- The wrapped Linear's report, its GEMMs on the fp32 effective weight: no
-- operand casts, only its bias's (the workspaces lie outside the arenas).
function LoRA:memory(B, T, dtype)
  local r = self.base:memory(B, T, "f32")
  r.casts = self.base.has_bias and Module.param_cast_bytes(self.n_out, dtype) or 0
  return r
end

-- Frees the workspaces of a model's adapters.
function LoRA.free_workspaces(model)
  for _, t in pairs(model.ctx.lora_ws or {}) do t:free() end
  model.ctx.lora_ws = nil
end

return LoRA
