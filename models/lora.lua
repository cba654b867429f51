-- models/lora.lua — LoRA adapters (PEFT's names and scaling) in a model:
-- each chosen Linear is wrapped (nn/lora.lua) with two trainable matrices
-- A [r, in] and B [out, r] beside its weight W [out, in]; it computes with
-- W + (alpha / r) B A, and everything else in the model is frozen.
--
--   local lora = require("models.lora")
--   lora.apply(model, { r = 8, alpha = 16, targets = { "q_proj", "v_proj" } })
--   -- then the engine: only the adapters train, get gradients and states
--
-- Targets name modules as Hugging Face does. Where each name's Linears are
-- is the family's table (model.lora_targets: its description's, e.g.
-- models/llama.lua's): name -> { path end, ... [, part = packed part] }, e.g.
--   gate_proj = { "mlp.gate_proj" }                -- every layer's mlp.gate_proj
--   c_proj = { "attn.c_proj", "mlp.c_proj" }       -- two Linears per layer
--   q_proj = { "self_attn", part = "q_proj" }      -- q's rows of the packed q|k|v
--   ["experts.down_proj"] = { experts = "down_proj" } -- every MoE block's experts
--                                                  -- (nn/lora_experts.lua)
-- so adapting a new module is one entry there; the description's
-- lora_default lists the targets when none are given. Parameter names follow PEFT:
-- <module>.lora_A.weight, <module>.lora_B.weight. A starts normal with std
-- 1/sqrt(in), B at zero, so the adapted model starts as the base one.
local nn = require("luazero.nn")
local families = require("luazero.families")
local LoraExperts = require("luazero.nn.lora_experts")

local M = {}
local experts_target

-- The targets LoRA adapts in `model` when none are given: its family's.
function M.default_targets(model)
  local fam = families.get((model.cfg or {}).family)
  return fam.description.lora_default or {}
end

-- Whether m is a Linear (or a subclass of it, as PackedLinear).
local function is_linear(m)
  local cls = getmetatable(m)
  while cls do
    if cls == nn.Linear then return true end
    local meta = getmetatable(cls)
    cls = meta and meta.__index
  end
  return false
end

local function ends_with(path, tail)
  return path == tail or path:sub(-(#tail + 1)) == "." .. tail
end

-- A target as PEFT matches it: a name of `where`, or a dotted path whose
-- last part is one (self_attn.q_proj, model.layers.0.mlp.down_proj): that
-- name where the adapted weight's full name ends with the path. Returns
-- the name and the path (nil: every module of that name).
local function split_target(where, t)
  if where[t] then return t, nil end
  local short = t:match("%.([^.]+)$")
  if short and where[short] and not where[short].experts then return short, t end
  return t, nil
end

-- The adapters each Linear of the model gets for `targets` (names of
-- `where`, or dotted paths: split_target): { [linear] = {parent, adapters =
-- { {name, row0, rows}, ... }} } in the model's order, and how many weights
-- each target found.
local function plan(model, targets, where)
  local found, by_linear, order = {}, {}, {}
  local function visit(m, path)
    for _, c in ipairs(m.children) do
      local child = c.module
      local cpath = (not c.name or c.name == "") and path or
                    (path == "" and c.name or (path .. "." .. c.name))
      if is_linear(child) then
        for _, t in ipairs(targets) do
          local key, path_tail = split_target(where, t)
          local entry = where[key]
          for _, tail in ipairs(entry) do
            if ends_with(cpath, tail) then
              local ad
              if entry.part then
                local part = child.parts and child.parts[entry.part]
                if part then ad = { entry.part, part.row0, part.rows } end
              else
                ad = { "", 0, child.n_out }
              end
              local full = ad and (ad[1] == "" and cpath or (cpath .. "." .. ad[1]))
              if ad and path_tail and not ends_with(full, path_tail) then ad = nil end
              if ad then
                if not by_linear[child] then
                  by_linear[child] = { parent = m, adapters = {}, path = cpath }
                  order[#order + 1] = child
                end
                local list = by_linear[child].adapters
                list[#list + 1] = ad
                found[t] = (found[t] or 0) + 1
              end
            end
          end
        end
      end
      visit(child, cpath)
    end
  end
  visit(model, "")
  return by_linear, order, found
end

-- A target as the family's table names it: PEFT's target_parameters may
-- give an expert kind's longer path (mlp.experts.gate_up_proj for the
-- table's experts.gate_up_proj).
experts_target = function(where, t)
  if where[t] then return t end
  for k, e in pairs(where) do
    if e.experts and t:sub(-(#k + 1)) == "." .. k then return k end
  end
  return t
end

local function known(where)
  local names = {}
  for k in pairs(where) do names[#names + 1] = k end
  table.sort(names)
  return table.concat(names, ", ")
end

-- opts: r (rank), alpha (scale alpha / r; default r: scale 1), targets (list
-- of module names; default the family's lora_default), where (the targets' table;
-- default model.lora_targets), rslora (scale alpha / sqrt(r), PEFT's
-- use_rslora), rank_of / alpha_of (functions of an adapted module's full
-- name, e.g. model.layers.0.self_attn.q_proj, giving its own r or alpha or
-- nil: PEFT's rank_pattern and alpha_pattern). Wraps the Linears, rebuilds
-- the model's parameter table and freezes every parameter but the
-- adapters. Returns the number of adapted weights.
function M.apply(model, opts)
  local r = assert(opts.r, "lora: r is required")
  if r < 1 or r ~= math.floor(r) then
    error(("lora: r must be a whole number >= 1 (got %s)"):format(r), 0)
  end
  if model.lora then error("lora: the model has adapters already; apply them once", 0) end
  local function scale_of(ar, alpha)
    return alpha / (opts.rslora and math.sqrt(ar) or ar)
  end
  local scale = scale_of(r, opts.alpha or r)
  local targets, seen = {}, {}
  local chosen = opts.targets or M.default_targets(model)
  local where = opts.where or model.lora_targets or {}
  for _, t in ipairs(chosen) do
    t = experts_target(where, t)
    if not seen[t] then seen[t] = true; targets[#targets + 1] = t end
  end
  for _, t in ipairs(targets) do
    if not where[(split_target(where, t))] then
      error(("lora: no module named %s to adapt (--lora-targets); this model has %s")
            :format(t, known(where)), 0)
    end
  end
  local linear_targets, expert_targets = {}, {}
  for _, t in ipairs(targets) do
    local list = where[(split_target(where, t))].experts and expert_targets or linear_targets
    list[#list + 1] = t
  end
  local by_linear, order, found = plan(model, linear_targets, where)
  local adapted_experts = {}
  model:walk(function(m, path)
    if not LoraExperts.is_experts(m) then return end
    for _, t in ipairs(expert_targets) do
      local kind = where[t].experts
      local ar = opts.rank_of and opts.rank_of(path .. "." .. kind) or r
      local alpha = opts.alpha_of and opts.alpha_of(path .. "." .. kind) or opts.alpha or r
      adapted_experts[#adapted_experts + 1] = { m, kind, ar, scale_of(ar, alpha) }
      found[t] = (found[t] or 0) + 1
    end
  end)
  for _, t in ipairs(targets) do
    if not found[t] then
      error(("lora: no module named %s to adapt (--lora-targets); this model has %s")
            :format(t, known(where)), 0)
    end
  end
  local n = 0
  for _, linear in ipairs(order) do
    local p = by_linear[linear]
    table.sort(p.adapters, function(a, b) return a[2] < b[2] end)
    if opts.rank_of or opts.alpha_of then
      for _, ad in ipairs(p.adapters) do
        local name = ad[1] == "" and p.path or (p.path .. "." .. ad[1])
        local ar = opts.rank_of and opts.rank_of(name) or r
        ad[4], ad[5] = ar, scale_of(ar, opts.alpha_of and opts.alpha_of(name) or opts.alpha or r)
      end
    end
    p.parent:replace(linear, nn.LoRA.new(linear, p.adapters, r, scale))
    n = n + #p.adapters
  end
  for _, a in ipairs(adapted_experts) do n = n + LoraExperts.attach(a[1], a[2], a[3], a[4]) end
  model.param_table, model.n_params = model:parameter_table()
  model:set_context(model.ctx)
  model:freeze(function(name) return not name:find("lora_[AB]%.weight$") end)
  model.lora = { r = r, alpha = opts.alpha or r, targets = chosen }
  return n
end

return M
