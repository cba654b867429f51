-- models/registry.lua — the model families (one file each in models/, listed
-- once below) and what reads their declarations generically: a named size,
-- a Hugging Face config.json read through its family's field schema, the
-- model built. What scripts/train.lua --model / --model-config and
-- tools/estimate resolve. The table itself is luazero/families.lua, so
-- the layers below models/ (hf.lua, checkpoint export) read it too.
--
--   local models = require("models.registry")
--   local cfg = models.config("llama-tiny", { n_layer = 4 })  -- a named size
--   local cfg = models.from_hf_config("path/config.json")      -- any family's architectures
--   local model = models.new(cfg)
--   models.register(dofile("my_family.lua"))                   -- a family outside models/
local cjson = require("cjson")
local families = require("luazero.families")

local M = {}

-- The families, in the order their sizes are listed: the one list.
local FAMILIES = { require("models.gpt2"), require("models.llama"), require("models.qwen2"),
                   require("models.qwen3"), require("models.mistral"), require("models.gemma"),
                   require("models.gemma2"), require("models.gemma3"), require("models.phi3"),
                   require("models.mixtral"), require("models.qwen2_moe"),
                   require("models.qwen3_moe"), require("models.olmoe") }

M.families = {} -- name -> family
M.names = {}    -- every named size, family by family

local function refresh()
  for k in pairs(M.families) do M.families[k] = nil end
  for i = #M.names, 1, -1 do M.names[i] = nil end
  for _, f in ipairs(families.list()) do
    M.families[f.name] = f
    for _, n in ipairs(f.names) do M.names[#M.names + 1] = n end
  end
end

-- Adds a family declared outside this list (a file of the same form as
-- models/llama.lua); its sizes and architectures are known from then on.
function M.register(fam)
  families.register(fam)
  refresh()
  return fam
end

-- Forgets the family named `name`.
function M.unregister(name)
  families.unregister(name)
  refresh()
end

for _, f in ipairs(FAMILIES) do families.register(f) end
refresh()

-- The family that names `name`, or nil.
function M.family_of(name)
  for _, f in ipairs(families.list()) do
    if f.configs[name] then return f end
  end
end

-- The family of a checked config (cfg.family).
function M.family(cfg) return families.get(cfg.family) end

-- A named size of any family with overrides (nil values are ignored).
function M.config(name, overrides)
  local f = M.family_of(name)
  if not f then
    error(("unknown model '%s' (known: %s)"):format(tostring(name), table.concat(M.names, ", ")),
          0)
  end
  return f.config(name, overrides)
end

function M.new(cfg) return families.get(cfg.family).new(cfg) end

-- The byte-level vocabulary's newline (data.lua's 256 byte tokens).
M.NEWLINE = 10

-- The token a sample starts from: the first a family's sample_start rule
-- gives for this vocabulary (GPT-2's <|endoftext|> for GPT-2's BPE
-- vocabulary), else the byte-level newline (token 0 for a vocabulary too
-- small to hold it).
function M.sample_start(cfg)
  for _, f in ipairs(families.list()) do
    local t = f.sample_start and f.sample_start(cfg)
    if t then return t end
  end
  return cfg.vocab > M.NEWLINE and M.NEWLINE or 0
end

------------------------------------------------------------ config.json

local null = cjson.null
local function present(v) return v ~= nil and v ~= null end

-- A value of the file as JSON text in a message (NaN and infinities, which
-- cjson reads but will not write, as they are: nan, inf).
local function shown(v)
  local ok, text = pcall(cjson.encode, v)
  return ok and text or tostring(v)
end

local KIND_CHECKS = {
  int = function(v) return type(v) == "number" and v == math.floor(v) and v - v == 0 end,
  number = function(v) return type(v) == "number" end,
  bool = function(v) return type(v) == "boolean" end,
  string = function(v) return type(v) == "string" end,
  object = function(v) return type(v) == "table" end,
  -- a token id or a list of them (eos_token_id)
  ids = function(v)
    local function id(x) return type(x) == "number" and x == math.floor(x) and x >= 0 and x < 2 ^ 31 end
    if type(v) == "number" then return id(v) end
    if type(v) ~= "table" or #v == 0 then return false end
    for _, x in ipairs(v) do
      if not id(x) then return false end
    end
    return true
  end,
}
local KIND_WANTS = { int = "; expected a whole number", number = "; expected a number",
                     bool = "; expected true or false", string = "; expected a string",
                     object = " is not an object",
                     ids = "; expected a token id or a list of token ids" }

-- One field of a family's schema (hf.fields: { field, key, kind, default =,
-- optional =, allowed =, refusal =, read =, if_null =, null_is_none = })
-- read from config.json `j`. if_null: the value of an explicit null, where
-- null and absent differ (Mistral's sliding_window: null is none, absent
-- 4096); null_is_none: an explicit null is nil (none), absent the default;
-- read(v, fail, cfg): the value as kept, cfg holding the fields before it;
-- a default function(cfg, get, fail): get(key) the file's value or nil.
local function read_field(e, j, cfg, fail)
  local key, kind = e[2], e[3]
  local v = j[key]
  if v == null and e.null_is_none then return nil end
  if v == null and e.if_null ~= nil then return e.if_null end
  if not present(v) then
    if e.optional then return nil end
    local d = e.default
    if type(d) == "function" then
      d = d(cfg, function(k) return present(j[k]) and j[k] or nil end, fail)
    end
    if d == nil then fail(("field %s is missing"):format(key)) end
    return d
  end
  -- A string with a list of allowed values is checked against the list alone.
  if not (kind == "string" and e.allowed) and not KIND_CHECKS[kind](v) then
    if kind == "object" then fail(("field %s is not an object"):format(key)) end
    fail(("field %s is %s%s"):format(key, shown(v), KIND_WANTS[kind]))
  end
  if e.allowed then
    local ok = false
    for _, a in ipairs(e.allowed) do ok = ok or v == a end
    if not ok then
      local want = {}
      for i, a in ipairs(e.allowed) do want[i] = cjson.encode(a) end
      fail(("field %s is %s; %s"):format(key, shown(v),
           e.refusal or ("expected " .. table.concat(want, " or "))))
    end
  end
  if e.read then v = e.read(v, fail, cfg) end
  return v
end

-- A family's config names in its config.json's words (n_head ->
-- num_attention_heads), for messages about the file.
local function in_file_words(fam, msg)
  local names = {}
  for _, e in ipairs(fam.hf.fields) do
    if e[1] and e[1] ~= e[2] then names[e[1]] = e[2] end
  end
  return (msg:gsub("[%a_]+", function(w) return names[w] end))
end

-- Reads a Hugging Face config.json: its family from architectures[0] (or
-- model_type), then that family's fields (hf.fields). Errors are one line
-- naming the file and the field. opts.file_words: the family's own checks
-- (finish) speak of the file's fields (num_attention_heads), not ours.
function M.from_hf_config(path, overrides, opts)
  local fs = require("luazero.io.fs")
  if fs.is_dir(path) then -- (a Hugging Face folder: its config.json)
    if not fs.exists(path .. "/config.json") then
      error(("model config %s: a folder without a config.json; give a Hugging Face model " ..
             "folder or its config.json"):format(path), 0)
    end
    path = path .. "/config.json"
  end
  local f, why = io.open(path, "rb")
  if not f then error(("model config %s: cannot open it (%s)"):format(path, why), 0) end
  local text = f:read("*a")
  f:close()
  local ok, j = pcall(cjson.decode, text)
  if not ok or type(j) ~= "table" then
    error(("model config %s: not a JSON object (%s)"):format(path, ok and type(j) or j), 0)
  end
  local function fail(msg) error(("model config %s: %s"):format(path, msg), 0) end
  local arch, where = nil, nil
  if type(j.architectures) == "table" and j.architectures[1] ~= nil then
    arch, where = j.architectures[1], "architectures[0]"
  elseif j.model_type ~= nil then
    arch, where = j.model_type, "model_type"
  else
    fail("field architectures (or model_type) is missing; expected " ..
         table.concat(families.architectures(), " or "))
  end
  local fam = families.of_architecture(arch)
  if not fam then
    fail(("field %s is %s: unknown architecture (known: %s)"):format(where, shown(arch),
         table.concat(families.architectures(), ", ")))
  end
  local cfg = { name = path:match("([^/]+/[^/]+)$") or path }
  for _, e in ipairs(fam.hf.fields) do
    local v = read_field(e, j, cfg, fail)
    if e[1] then cfg[e[1]] = v end
  end
  cfg.lr = fam.configs[fam.hf.lr_of].lr
  for k, v in pairs(overrides or {}) do cfg[k] = v end
  local ok_, checked = pcall(fam.finish, cfg)
  if not ok_ then
    fail(opts and opts.file_words and in_file_words(fam, tostring(checked)) or checked)
  end
  return checked
end

return M
