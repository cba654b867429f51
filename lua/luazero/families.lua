-- families.lua — the table of model families. Each family is one file in
-- models/ (models/gpt2.lua, models/llama.lua) that declares everything about
-- it: its sizes, its config.json fields, how it builds the model, its
-- Hugging Face tensor names, its config.json writer, its tied-head rule and
-- its LoRA targets (docs/extending.md, "Adding a model family").
-- models/registry.lua registers the families it lists; the layers below
-- models/ (hf.lua, checkpoint/export.lua) find a family here by the name a
-- model config or a checkpoint's manifest carries (cfg.family), so they hold
-- no family names and never reach up to models/. A family may also declare
-- run_fields: the fields of its configs that are the run's settings, not
-- its architecture, which a resume may change (the MoE families' routing
-- options).
--
--   local families = require("luazero.families")
--   families.register(require("models.llama"))
--   families.get("llama")                      -- the declaration, or an error
--   families.of_architecture("LlamaForCausalLM") -- or a model_type ("llama"), or nil
--   families.list()                            -- in the order registered
--   families.run_fields("mixtral")             -- its run_fields, or {}
local M = {}

local by_name, order = {}, {}

-- The fields a family's configs may hold: its sizes' own, what its finish
-- derives from them, and what its config.json fields fill (once a family).
local known_cache = setmetatable({}, { __mode = "k" })
local function known_fields(fam)
  if known_cache[fam] then return known_cache[fam] end
  local known = { name = true }
  for _, n in ipairs(fam.names) do
    local cfg = { name = n }
    for k, v in pairs(fam.configs[n]) do cfg[k], known[k] = v, true end
    local ok, done = pcall(fam.finish, cfg)
    if ok and type(done) == "table" then for k in pairs(done) do known[k] = true end end
  end
  for _, e in ipairs(fam.hf and fam.hf.fields or {}) do
    if type(e[1]) == "string" then known[e[1]] = true end
  end
  known_cache[fam] = known
  return known
end

-- The config(name, overrides) a family declares, over its configs, names
-- and finish: a named size with overrides (any field of its sizes; another
-- is refused, naming the one it likely meant).
function M.sizes(fam)
  return function(name, overrides)
    local base = fam.configs[name]
    if not base then
      error(("unknown model '%s' (known: %s)"):format(tostring(name),
            table.concat(fam.names, ", ")), 0)
    end
    local cfg = { name = name }
    for k, v in pairs(base) do cfg[k] = v end
    local known = known_fields(fam)
    for k, v in pairs(overrides or {}) do
      if not known[k] then
        error(("model %s: no field %s in a %s config%s"):format(name, tostring(k), fam.name,
              require("luazero.config.values").did_you_mean(k, known)), 0)
      end
      cfg[k] = v
    end
    return fam.finish(cfg)
  end
end

-- What every family declares (models/gpt2.lua is the smallest example).
local REQUIRED = { "name", "names", "configs", "config", "finish", "new", "description", "hf" }
local REQUIRED_HF = { "architectures", "model_type", "fields", "config_json", "tied", "lr_of" }

-- Whether t is a list of strings and nothing else (a family's run_fields).
local function is_name_list(t)
  if type(t) ~= "table" then return false end
  local n = 0
  for _ in pairs(t) do n = n + 1 end
  if n ~= #t then return false end
  for _, k in ipairs(t) do
    if type(k) ~= "string" then return false end
  end
  return true
end

local function check(fam)
  if type(fam) ~= "table" then
    error(("families: a family is a table (got %s); a family file returns its declaration")
          :format(type(fam)), 0)
  end
  for _, k in ipairs(REQUIRED) do
    if fam[k] == nil then
      error(("families: family %s declares no %s; see docs/extending.md, \"Adding a model " ..
             "family\""):format(tostring(fam.name), k), 0)
    end
  end
  if fam.run_fields ~= nil and not is_name_list(fam.run_fields) then
    error(("families: family %s's run_fields must be a list of config field names " ..
           "({ \"jitter\", ... })"):format(tostring(fam.name)), 0)
  end
  for _, k in ipairs(REQUIRED_HF) do
    if fam.hf[k] == nil then
      error(("families: family %s declares no hf.%s; see docs/extending.md, \"Adding a " ..
             "model family\""):format(fam.name, k), 0)
    end
  end
end

-- Adds a family (or replaces the one of its name, in its place). Returns it.
function M.register(fam)
  check(fam)
  for _, other in ipairs(order) do
    if other.name ~= fam.name then
      for _, n in ipairs(fam.names) do
        if other.configs[n] then
          error(("families: family %s names size %s, which family %s names already; " ..
                 "rename one"):format(fam.name, n, other.name), 0)
        end
      end
    end
  end
  if not by_name[fam.name] then order[#order + 1] = fam end
  for i, other in ipairs(order) do
    if other.name == fam.name then order[i] = fam end
  end
  by_name[fam.name] = fam
  return fam
end

-- Removes the family named `name` (a test's toy family, after the test).
function M.unregister(name)
  by_name[name] = nil
  for i, fam in ipairs(order) do
    if fam.name == name then table.remove(order, i); break end
  end
end

-- The registered families, in the order registered (a copy).
function M.list()
  local out = {}
  for i, fam in ipairs(order) do out[i] = fam end
  return out
end

-- The family named `name`; an error naming the known ones otherwise.
function M.get(name)
  local fam = by_name[name]
  if fam then return fam end
  local known = {}
  for i, f in ipairs(order) do known[i] = f.name end
  error(("model family %s is unknown (known: %s); register its file (models/registry.lua)")
        :format(tostring(name), table.concat(known, ", ")), 0)
end

-- The run_fields the family named `name` declares ({} for none, or for a
-- model of no registered family).
function M.run_fields(name)
  local fam = name and by_name[name]
  return fam and fam.run_fields or {}
end

-- The family whose config.json says `arch` (one of its architectures, or
-- its model_type), or nil.
function M.of_architecture(arch)
  for _, fam in ipairs(order) do
    if arch == fam.hf.model_type then return fam end
    for _, a in ipairs(fam.hf.architectures) do
      if arch == a then return fam end
    end
  end
end

-- Every registered family's architectures, in order.
function M.architectures()
  local out = {}
  for _, fam in ipairs(order) do
    for _, a in ipairs(fam.hf.architectures) do out[#out + 1] = a end
  end
  return out
end

return M
