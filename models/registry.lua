-- models/registry.lua — every model family by name, and Hugging Face
-- config.json files: what scripts/train.lua --model / --model-config and
-- tools/estimate resolve.
--
--   local models = require("models.registry")
--   local cfg = models.config("llama-tiny", { n_layer = 4 })  -- a named size
--   local cfg = models.from_hf_config("path/config.json")      -- GPT2LMHeadModel, LlamaForCausalLM
--   local model = models.new(cfg)
local cjson = require("cjson")
local gpt2 = require("models.gpt2")
local llama = require("models.llama")

local M = {}

M.families = { gpt2 = gpt2, llama = llama }
M.names = {}
for _, f in ipairs({ gpt2, llama }) do
  for _, n in ipairs(f.names) do M.names[#M.names + 1] = n end
end

-- The family that names `name`, or nil.
function M.family_of(name)
  if gpt2.configs[name] then return gpt2 end
  if llama.configs[name] then return llama end
end

-- A named size of any family with overrides (nil values are ignored).
function M.config(name, overrides)
  local f = M.family_of(name)
  if not f then
    error(("unknown model '%s' (known: %s)"):format(tostring(name), table.concat(M.names, ", ")),
          0)
  end
  return f.config(name, overrides)
end

function M.new(cfg)
  return (cfg.family == "llama" and llama or gpt2).new(cfg)
end

-- The byte-level vocabulary's newline (data.lua's 256 byte tokens).
M.NEWLINE = 10

-- The token a sample starts from, by the vocabulary: GPT-2's <|endoftext|>
-- for GPT-2's BPE vocabulary, else the byte-level newline (token 0 for a
-- vocabulary too small to hold it).
function M.sample_start(cfg)
  if cfg.vocab == gpt2.VOCAB then return gpt2.END_OF_TEXT end
  return cfg.vocab > M.NEWLINE and M.NEWLINE or 0
end

------------------------------------------------------------ config.json

local ARCHS = { GPT2LMHeadModel = "gpt2", LlamaForCausalLM = "llama" }

-- Reads a Hugging Face config.json. Errors are one line naming the file and
-- the field.
function M.from_hf_config(path, overrides)
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
    fail("field architectures (or model_type) is missing; expected GPT2LMHeadModel or " ..
         "LlamaForCausalLM")
  end
  local family = ARCHS[arch] or (arch == "gpt2" or arch == "llama") and arch
  if not family then
    fail(("field %s is %s: unknown architecture (known: GPT2LMHeadModel, LlamaForCausalLM)")
         :format(where, cjson.encode(arch)))
  end
  local null = cjson.null
  local function field(key, kind, default)
    local v = j[key]
    if v == nil or v == null then
      if default == nil then fail(("field %s is missing"):format(key)) end
      return default
    end
    if kind == "int" and (type(v) ~= "number" or v ~= math.floor(v)) then
      fail(("field %s is %s; expected a whole number"):format(key, cjson.encode(v)))
    elseif kind == "number" and type(v) ~= "number" then
      fail(("field %s is %s; expected a number"):format(key, cjson.encode(v)))
    elseif kind == "bool" and type(v) ~= "boolean" then
      fail(("field %s is %s; expected true or false"):format(key, cjson.encode(v)))
    end
    return v
  end
  local cfg = { name = path:match("([^/]+/[^/]+)$") or path }
  if family == "gpt2" then
    cfg.n_layer, cfg.n_head = field("n_layer", "int"), field("n_head", "int")
    cfg.n_embd, cfg.vocab = field("n_embd", "int"), field("vocab_size", "int")
    cfg.context = field("n_positions", "int", j.n_ctx ~= null and j.n_ctx or nil)
    cfg.lr = gpt2.configs.gpt2.lr
    if field("tie_word_embeddings", "bool", true) == false then
      fail("field tie_word_embeddings is false; luazero's GPT-2 ties the LM head to wte")
    end
  else
    local F = llama.hf_fields
    for _, k in ipairs({ "n_layer", "n_head", "n_embd", "n_hidden", "context", "vocab" }) do
      cfg[k] = field(F[k], "int")
    end
    cfg.n_kv_head = field(F.n_kv_head, "int", cfg.n_head)
    cfg.eps = field(F.eps, "number", 1e-6)
    cfg.rope_theta = field(F.rope_theta, "number", 10000)
    cfg.tie = field(F.tie, "bool", false)
    cfg.std = field(F.std, "number", 0.02)
    if j.head_dim ~= nil and j.head_dim ~= null then cfg.head_dim = field("head_dim", "int") end
    local act = field("hidden_act", "string", "silu")
    if act ~= "silu" then fail(("field hidden_act is %s; expected \"silu\""):format(cjson.encode(act))) end
    for _, k in ipairs({ "attention_bias", "mlp_bias" }) do
      if field(k, "bool", false) then fail(("field %s is true; luazero's Llama has no biases"):format(k)) end
    end
    local s = j.rope_scaling
    if s ~= nil and s ~= null then
      if type(s) ~= "table" then fail("field rope_scaling is not an object") end
      local rope_type = s.rope_type ~= nil and s.rope_type or s.type
      if rope_type ~= "llama3" then
        fail(("field rope_scaling.rope_type is %s; only \"llama3\" is implemented")
             :format(cjson.encode(rope_type)))
      end
      cfg.rope_scaling = { rope_type = "llama3" }
      for _, k in ipairs({ "factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings" }) do
        if type(s[k]) ~= "number" then fail(("field rope_scaling.%s is missing"):format(k)) end
        cfg.rope_scaling[k] = s[k]
      end
    end
    cfg.lr = llama.configs["llama-100m"].lr
  end
  for k, v in pairs(overrides or {}) do cfg[k] = v end
  local ok_, checked = pcall(M.families[family].finish, cfg)
  if not ok_ then fail(checked) end
  return checked
end

return M
