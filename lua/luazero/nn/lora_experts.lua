-- nn/lora_experts.lua — LoRA adapters on the experts of an MoE block
-- (nn/moe_experts.lua), as PEFT 0.21.2 puts them on transformers 5.x's
-- fused expert tensors (LoraConfig target_parameters experts.gate_up_proj,
-- experts.down_proj). For expert e, with s = alpha / r:
--   gate_up_proj: [gate | up] += s (x A_e^T) B_e^T   A_e [r, C], B_e [2H, r]
--                 (B_e's first H rows the gate's, the next H the up's: one
--                 A_e for both, as the fused [2H, C] weight has one input)
--   down_proj:    y += s (h A_e^T) B_e^T              A_e [r, H], B_e [C, r]
-- Each expert's adapters are parameters of the module that holds its
-- weights, so ZeRO gathers and reduces them with the expert's unit, named
-- <experts>.<e>.gate_up_proj.lora_A.weight (and lora_B, and down_proj's).
-- They compute in fp32 (A and B widened into nn/lora.lua's workspaces).
--
-- PEFT's file holds one pair per block and kind (M.peft_names):
-- lora_A [E * r, in] (expert e's rows e*r .. e*r + r - 1) and lora_B
-- [out, r * E] (expert e's columns e, e + E, ...: PEFT reshapes it to
-- [out, r, E]); with both kinds on a block PEFT nests its wrappers, gate_up
-- inside: <experts>.base_layer.lora_A.weight is gate_up_proj's,
-- <experts>.lora_A.weight down_proj's.
local lz = require("luazero")
local LoRA = require("luazero.nn.lora")

local ops = lz.ops
local M = {}

M.KINDS = { gate_up_proj = true, down_proj = true }

function M.is_experts(m) return m.is_moe_experts == true end

-- Adapters of `kind` on every expert of `experts` (an nn/moe_experts.lua
-- module), rank r, scale s; returns the number of experts adapted.
function M.attach(experts, kind, r, s)
  local C, H = experts.n_embd, experts.n_hidden
  local n_in, n_out = C, 2 * H
  if kind == "down_proj" then n_in, n_out = H, C end
  for e = 1, experts.n_experts do
    local u = experts.units[e]
    local m = u.module
    local prefix = m == experts and ((e - 1) .. ".") or ""
    local a, b = ("lora_%s_A%d"):format(kind, e), ("lora_%s_B%d"):format(kind, e)
    -- (keyed: the same numbers under gather "block", where the adapters
    -- follow every expert's weights, and "expert", where each follows its own)
    m:param(a, { r, n_in }, { kind = "normal", std = 1 / math.sqrt(n_in), keyed = true }, true,
            prefix .. kind .. ".lora_A.weight")
    m:param(b, { n_out, r }, { kind = "zeros" }, true, prefix .. kind .. ".lora_B.weight")
    u.lora = u.lora or {}
    u.lora[kind] = { a = a, b = b, r = r, scale = s, n_in = n_in, n_out = n_out }
  end
  return experts.n_experts
end

-- Adapter ad's fp32 A [r, in] and B [out, r], and T = x A^T [n, r].
local function operands(m, u, ad, x, n)
  local dev = x:device_name()
  local r, n_in, n_out = ad.r, ad.n_in, ad.n_out
  local ab = LoRA.workspace(m, "experts_ab", r * n_in + n_out * r, dev)
  local a = ab:view(0, { r, n_in }):copy(u.module.p[ad.a])
  local b = ab:view(r * n_in, { n_out, r }):copy(u.module.p[ad.b])
  local t = LoRA.workspace(m, "experts_t", n * r, dev):view(0, { n, r })
  ops.matmul(t, x:view(0, { n, n_in }), a, 0, 1, 1, 0)
  return a, b, t
end

-- Forward, expert unit u on its n rows: x [n, C]; gate, up [n, H] (the
-- base projections' outputs, the adapters' added in place).
function M.gate_up_forward(m, u, x, gate, up, n)
  local ad = u.lora and u.lora.gate_up_proj
  if not ad then return end
  local H = ad.n_out / 2
  local _, b, t = operands(m, u, ad, x, n)
  ops.matmul(gate:view(0, { n, H }), t, b:view(0, { H, ad.r }), 0, 1, ad.scale, 1)
  ops.matmul(up:view(0, { n, H }), t, b:view(H * ad.r, { H, ad.r }), 0, 1, ad.scale, 1)
end

-- h [n, H]; y [n, C] (the down projection's output, the adapter's added).
function M.down_forward(m, u, h, y, n)
  local ad = u.lora and u.lora.down_proj
  if not ad then return end
  local _, b, t = operands(m, u, ad, h, n)
  ops.matmul(y:view(0, { n, ad.n_out }), t, b, 0, 1, ad.scale, 1)
end

-- Backward of down_forward: dy [n, C] the rows' output gradient; dh [n, H]
-- (dy W2 already) gains the adapter's part; the adapter's gradients accumulate.
function M.down_backward(m, u, dy, h, dh, n)
  local ad = u.lora and u.lora.down_proj
  if not ad then return end
  local s, g_ = ad.scale, u.module.g
  local a, b, t = operands(m, u, ad, h, n)
  local dy2 = dy:view(0, { n, ad.n_out })
  local g = LoRA.workspace(m, "experts_g", n * ad.r, dy:device_name()):view(0, { n, ad.r })
  ops.matmul(g, dy2, b, 0, 0, 1, 0)                                 -- G = dy B
  ops.matmul(g_[ad.b], dy2, t, 1, 0, s, 1)                          -- gB += s dy^T T
  ops.matmul(g_[ad.a], g, h:view(0, { n, ad.n_in }), 1, 0, s, 1)    -- gA += s G^T h
  ops.matmul(dh:view(0, { n, ad.n_in }), g, a, 0, 0, s, 1)          -- dh += s G A
end

-- Backward of gate_up_forward: dgate, dup [n, H] the gradients at the
-- projections' outputs; dx [n, C] (the base part already) gains the adapter's.
function M.gate_up_backward(m, u, x, dgate, dup, dx, n)
  local ad = u.lora and u.lora.gate_up_proj
  if not ad then return end
  local s, r, g_ = ad.scale, ad.r, u.module.g
  local H = ad.n_out / 2
  local a, b, t = operands(m, u, ad, x, n)
  local dg2, du2 = dgate:view(0, { n, H }), dup:view(0, { n, H })
  local g = LoRA.workspace(m, "experts_g", n * r, x:device_name()):view(0, { n, r })
  ops.matmul(g, dg2, b:view(0, { H, r }), 0, 0, 1, 0)              -- G = dgate Bg + dup Bu
  ops.matmul(g, du2, b:view(H * r, { H, r }), 0, 0, 1, 1)
  ops.matmul(g_[ad.b]:view(0, { H, r }), dg2, t, 1, 0, s, 1)       -- gB += s [dgate | dup]^T T
  ops.matmul(g_[ad.b]:view(H * r, { H, r }), du2, t, 1, 0, s, 1)
  ops.matmul(g_[ad.a], g, x:view(0, { n, ad.n_in }), 1, 0, s, 1)    -- gA += s G^T x
  ops.matmul(dx:view(0, { n, ad.n_in }), g, a, 0, 0, s, 1)          -- dx += s G A
end

------------------------------------------------------------ PEFT's names

-- An expert adapter's name: its block's experts path, expert, kind, A or B.
local function parse(name)
  local path, e, kind, ab = name:match("^(.*%.experts)%.(%d+)%.([%w_]+)%.lora_([AB])%.weight$")
  if path and M.KINDS[kind] then return path, tonumber(e), kind, ab end
end

-- For a parameter table's expert adapters ({name, shape} entries, in any
-- order), PEFT's: name -> { key (PEFT's name, without base_model.model.),
-- e (0-based), E, ab ("A" or "B"), r }. renames: the family's
-- lora_peft_paths, { {from, to}, ... } path parts where transformers 5.x
-- names the block otherwise (Mixtral's block_sparse_moe is its mlp).
function M.peft_names(params, renames)
  local blocks, out = {}, {}
  for _, p in ipairs(params) do
    local path, e, kind, ab = parse(p.name)
    if path then
      local b = blocks[path] or { kinds = {}, E = 0 }
      blocks[path] = b
      b.kinds[kind] = true
      b.E = math.max(b.E, e + 1)
      out[p.name] = { path = path, e = e, kind = kind, ab = ab,
                      r = ab == "A" and p.shape[1] or p.shape[2] }
    end
  end
  for _, v in pairs(out) do
    local b = blocks[v.path]
    local path = v.path
    for _, rn in ipairs(renames or {}) do
      path = path:gsub("%." .. rn[1]:gsub("%p", "%%%0") .. "%.", "." .. rn[2] .. ".")
    end
    local inner = v.kind == "gate_up_proj" and b.kinds.down_proj
    v.key = ("%s%s.lora_%s.weight"):format(path, inner and ".base_layer" or "", v.ab)
    v.E = b.E
  end
  return out
end

-- Whether a parameter's name is an expert adapter's.
function M.is_adapter(name) return parse(name) ~= nil end

-- Where --merge-lora folds the expert adapters of a parameter list ({name,
-- shape, ...} entries, the others skipped): base weight name -> { A, B (the
-- entries), row (B's first row that adapts it), rows }. names: the
-- family's expert projections in the checkpoint, { gate, up, down } (its
-- description's expert_names). gate_up_proj's B holds the gate's rows then
-- the up's over one A, so expert e's gate weight gains s B[0:H] A and its
-- up weight s B[H:2H] A, as the forward adds them; down_proj's B the down
-- projection's.
function M.merge_targets(params, names)
  local found, out = {}, {}
  for _, p in ipairs(params) do
    local path, e, kind, ab = parse(p.name)
    if path then
      local key = ("%s.%d.%s"):format(path, e, kind)
      found[key] = found[key] or { base = ("%s.%d."):format(path, e), kind = kind }
      found[key][ab] = p
    end
  end
  for _, f in pairs(found) do
    local n_out = f.B.shape[1]
    if f.kind == "gate_up_proj" then
      out[f.base .. names[1] .. ".weight"] = { A = f.A, B = f.B, row = 0, rows = n_out / 2 }
      out[f.base .. names[2] .. ".weight"] = { A = f.A, B = f.B, row = n_out / 2, rows = n_out / 2 }
    else
      out[f.base .. names[3] .. ".weight"] = { A = f.A, B = f.B, row = 0, rows = n_out }
    end
  end
  return out
end

-- Element j (0-based, row-major) of expert e's A or B within PEFT's fused
-- tensor: A [E * r, in] stacks the experts' rows; B [out, r * E] interleaves
-- their columns (column k * E + e is expert e's k-th).
function M.fused_index(v, shape, j)
  if v.ab == "A" then return v.e * (v.r * shape[2]) + j end
  local o, k = math.floor(j / v.r), j % v.r
  return o * (v.r * v.E) + k * v.E + v.e
end

return M
