-- nn/lora.lua — the arithmetic of LoRA adapters (models/lora.lua adds them
-- to a model): a module with adapters (m.lora, a list of {key, a, b, n_in,
-- n_out, row0, r, scale}) computes with an effective weight, its weight
-- widened to fp32 plus scale * B A in each adapter's rows, formed in an fp32
-- workspace of the model's before the layer's GEMM; the GEMM's weight
-- gradient, into another workspace, gives A's and B's.
local lz = require("luazero")

local ops = lz.ops
local M = {}

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

-- The effective weight of module m: w (its weight, [rows, in], any dtype)
-- widened to fp32 with every adapter added into its rows. Returns an f32
-- tensor in the workspace (valid until the next call) and the adapters'
-- fp32 copies { [i] = {a = A32, b = B32} }.
function M.effective(m, w)
  local dev = w:device_name()
  local rows, n_in = w:dim(1), w:dim(2)
  local weff = workspace(m, "weff", rows * n_in, dev):view(0, { rows, n_in }):copy(w)
  local copies = {}
  local off = 0
  local ab = workspace(m, "ab", M.adapter_elems(m), dev)
  for i, ad in ipairs(m.lora) do
    local a = ab:view(off, { ad.r, ad.n_in }):copy(m.p[ad.a])
    off = off + ad.r * ad.n_in
    local b = ab:view(off, { ad.n_out, ad.r }):copy(m.p[ad.b])
    off = off + ad.n_out * ad.r
    ops.matmul(weff:view(ad.row0 * n_in, { ad.n_out, n_in }), b, a, 0, 0, ad.scale, 1)
    copies[i] = { a = a, b = b }
  end
  return weff, copies
end

function M.adapter_elems(m)
  local n = 0
  for _, ad in ipairs(m.lora) do n = n + ad.r * (ad.n_in + ad.n_out) end
  return n
end

-- The gradient of the effective weight for backward (zeroed).
function M.grad_workspace(m, rows, n_in, device)
  return workspace(m, "dweff", rows * n_in, device):view(0, { rows, n_in }):fill(0)
end

-- From dweff (the effective weight's gradient): gB += s dW A^T, gA += s B^T dW.
function M.backward(m, dweff, copies)
  local n_in = dweff:dim(2)
  for i, ad in ipairs(m.lora) do
    local d = dweff:view(ad.row0 * n_in, { ad.n_out, n_in })
    ops.matmul(m.g[ad.b], d, copies[i].a, 0, 1, ad.scale, 1)
    ops.matmul(m.g[ad.a], copies[i].b, d, 1, 0, ad.scale, 1)
  end
end

-- Frees the workspaces of a model.
function M.free(model)
  for _, t in pairs(model.ctx.lora_ws or {}) do t:free() end
  model.ctx.lora_ws = nil
end

return M
