-- models/lora.lua — LoRA adapters (PEFT's names and scaling): beside each
-- chosen weight W [out, in], two trainable matrices A [r, in] and B [out, r];
-- the layer computes with W + (alpha / r) B A, and everything else in the
-- model is frozen. Written on the existing kernels: the effective weight is
-- formed in an fp32 workspace before the layer's GEMM, and its gradient
-- (from the same GEMM's backward) gives A's and B's.
--
--   local lora = require("models.lora")
--   lora.apply(model, { r = 8, alpha = 16, targets = { "q_proj", "v_proj" } })
--   -- then the engine: only the adapters train, get gradients and states
--
-- Targets name the weights' modules as Hugging Face does: a Linear whose
-- path ends in the target (o_proj, gate_proj, up_proj, down_proj, c_fc,
-- c_proj, ...), or a Llama attention's q_proj, k_proj, v_proj (one packed
-- matrix here: adapters add into its rows). Parameter names follow PEFT:
-- <module>.lora_A.weight, <module>.lora_B.weight. A starts normal with std
-- 1/sqrt(in), B at zero, so the adapted model starts as the base one.
local nn = require("luazero.nn")

local M = {}

local function last(path) return path:match("([^.]+)$") or path end

-- Declares an adapter on module m for its weight `key` (rows [row0, row0 +
-- out) of it; name: the weight's HF module name, "" for the module's own).
local function add(m, key, name, n_in, n_out, row0, r, scale)
  local prefix = name == "" and "" or (name .. ".")
  local a_key, b_key = "lora_A_" .. key, "lora_B_" .. key
  m:param(a_key, { r, n_in }, { kind = "normal", std = 1 / math.sqrt(n_in) }, false,
          prefix .. "lora_A.weight")
  m:param(b_key, { n_out, r }, { kind = "zeros" }, false, prefix .. "lora_B.weight")
  m.lora = m.lora or {}
  m.lora[#m.lora + 1] = { key = key, a = a_key, b = b_key, n_in = n_in, n_out = n_out,
                          row0 = row0, r = r, scale = scale }
end

-- opts: r (rank), alpha (scale alpha / r; default r: scale 1), targets (list
-- of module names). Rebuilds the model's parameter table and freezes every
-- parameter but the adapters. Returns the number of adapted weights.
function M.apply(model, opts)
  local r = assert(opts.r, "lora: r is required")
  if r < 1 or r ~= math.floor(r) then error(("lora: r must be a whole number >= 1 (got %s)"):format(r), 0) end
  local scale = (opts.alpha or r) / r
  local want = {}
  for _, t in ipairs(opts.targets or { "q_proj", "v_proj" }) do want[t] = false end
  local n = 0
  model:walk(function(m, path)
    if getmetatable(m) == nn.Linear and want[last(path)] ~= nil then
      add(m, "weight", "", m.n_in, m.n_out, 0, r, scale)
      want[last(path)] = true
      n = n + 1
    elseif getmetatable(m) == nn.GQA then
      local rows = { q = { 0, m.q_width }, k = { m.q_width, m.kv_width },
                     v = { m.q_width + m.kv_width, m.kv_width } }
      for _, key in ipairs({ "q", "k", "v" }) do
        local proj = key .. "_proj"
        if want[proj] ~= nil then
          add(m, key, proj, m.n_embd, rows[key][2], rows[key][1], r, scale)
          want[proj] = true
          n = n + 1
        end
      end
    end
  end)
  for t, found in pairs(want) do
    if not found then
      error(("lora: no module named %s to adapt (--lora-targets); Llama has q_proj, k_proj, " ..
             "v_proj, o_proj, gate_proj, up_proj, down_proj; GPT-2 c_attn, c_proj, c_fc"):format(t), 0)
    end
  end
  model.param_table, model.n_params = model:parameter_table()
  model:freeze(function(name) return not name:find("lora_[AB]%.weight$") end)
  model.lora = { r = r, alpha = opts.alpha or r, targets = opts.targets }
  return n
end

return M
