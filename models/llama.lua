-- models/llama.lua — the Llama family as Hugging Face's LlamaForCausalLM
-- defines it: RMSNorm before each branch, rotary position embeddings
-- (rope_theta; Llama 3's rope_scaling), grouped-query attention
-- (num_key_value_heads), a SwiGLU MLP, no biases, an LM head untied or tied
-- to the token embedding (tie_word_embeddings).
--
--   local llama = require("models.llama")
--   local cfg = llama.config("llama-tiny", { n_layer = 4 })
--   local model = llama.new(cfg)   -- then as models/gpt2.lua: allocate,
--                                  -- init_weights, prepare, forward, backward
-- (nn/causal_lm.lua runs it; this file describes it: its sizes and parts.)
--
-- Parameter names are Hugging Face's, in its order: model.embed_tokens.weight,
-- model.layers.N.input_layernorm.weight, model.layers.N.self_attn.{q,k,v,o}_proj.weight,
-- model.layers.N.post_attention_layernorm.weight,
-- model.layers.N.mlp.{gate,up,down}_proj.weight, model.norm.weight,
-- lm_head.weight (absent when tied). The embedding and LM head have rows
-- up to a multiple of 64 (the real vocab first; 32000 and 128256 need none).
local ffi = require("ffi")
local cjson = require("cjson")
local nn = require("luazero.nn")
local families = require("luazero.families")

local M = { name = "llama" }

------------------------------------------------------------------ configs

local llama3_scaling = { rope_type = "llama3", factor = 8.0, low_freq_factor = 1.0,
                         high_freq_factor = 4.0, original_max_position_embeddings = 8192 }

-- lr: a learning rate that trains the size well, used when --lr is not given.
M.configs = {
  -- for tests: GQA (2 query heads per key/value head), two layers
  ["llama-tiny"] = { n_layer = 2, n_head = 4, n_kv_head = 2, n_embd = 64, n_hidden = 176,
                     context = 256, vocab = 256, eps = 1e-5, rope_theta = 10000, tie = false,
                     lr = 3e-3 },
  -- about 100M parameters (tied), for benchmarks
  ["llama-100m"] = { n_layer = 12, n_head = 12, n_kv_head = 4, n_embd = 768, n_hidden = 2048,
                     context = 1024, vocab = 32000, eps = 1e-5, rope_theta = 10000, tie = true,
                     lr = 6e-4 },
  -- TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T's config.json
  ["tinyllama-1.1b"] = { n_layer = 22, n_head = 32, n_kv_head = 4, n_embd = 2048,
                         n_hidden = 5632, context = 2048, vocab = 32000, eps = 1e-5,
                         rope_theta = 10000, tie = false, lr = 4e-4 },
  -- meta-llama/Meta-Llama-3-8B's config.json
  ["llama3-8b"] = { n_layer = 32, n_head = 32, n_kv_head = 8, n_embd = 4096, n_hidden = 14336,
                    context = 8192, vocab = 128256, eps = 1e-5, rope_theta = 500000,
                    tie = false, lr = 3e-4 },
  -- meta-llama/Llama-3.1-8B: Llama 3's shape, scaled rotary frequencies
  ["llama3.1-8b"] = { n_layer = 32, n_head = 32, n_kv_head = 8, n_embd = 4096, n_hidden = 14336,
                      context = 131072, vocab = 128256, eps = 1e-5, rope_theta = 500000,
                      tie = false, rope_scaling = llama3_scaling, lr = 3e-4 },
}
M.names = { "llama-tiny", "llama-100m", "tinyllama-1.1b", "llama3-8b", "llama3.1-8b" }

local function padded(vocab) return math.ceil(vocab / 64) * 64 end
M.padded = padded

local function whole(cfg, k, lo)
  local v = cfg[k]
  if type(v) ~= "number" or v < lo or v ~= math.floor(v) then
    error(("%s must be a whole number >= %d (got %s)"):format(k, lo, tostring(v)), 0)
  end
end
M.whole = whole

-- Checks a rope_scaling table (Llama 3's, or linear's: the frequencies
-- divided by factor); errors name the key.
local function check_scaling(s)
  if s.rope_type == "linear" then
    if type(s.factor) ~= "number" or not (s.factor > 0) then
      error(("rope_scaling.factor must be a number > 0 (got %s)"):format(tostring(s.factor)), 0)
    end
    return
  end
  if s.rope_type ~= "llama3" then
    error(("rope_scaling.rope_type must be \"llama3\" or \"linear\" (got %s); other scalings " ..
           "are not implemented"):format(tostring(s.rope_type)), 0)
  end
  for _, k in ipairs({ "factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings" }) do
    if type(s[k]) ~= "number" or not (s[k] > 0) then
      error(("rope_scaling.%s must be a number > 0 (got %s)"):format(k, tostring(s[k])), 0)
    end
  end
  if not (s.high_freq_factor > s.low_freq_factor) then
    error(("rope_scaling.high_freq_factor %g must be above low_freq_factor %g")
          :format(s.high_freq_factor, s.low_freq_factor), 0)
  end
end

-- The checks and derived sizes of every family built on Llama's layer: the
-- whole sizes, n_kv_head (default n_head) dividing n_head, head_dim
-- (default n_embd / n_head), eps (default `eps`, else 1e-6), rope_theta,
-- std, tie, the padded vocabulary. rope_scaling false (a config.json's
-- default rope) is none.
function M.shape(cfg, eps)
  for _, k in ipairs({ "n_layer", "n_head", "n_embd", "n_hidden", "context", "vocab" }) do
    whole(cfg, k, 1)
  end
  cfg.n_kv_head = cfg.n_kv_head or cfg.n_head
  whole(cfg, "n_kv_head", 1)
  if cfg.n_head % cfg.n_kv_head ~= 0 then
    error(("n_head %d is not a multiple of n_kv_head %d"):format(cfg.n_head, cfg.n_kv_head), 0)
  end
  if not cfg.head_dim then
    if cfg.n_embd % cfg.n_head ~= 0 then
      error(("n_embd %d is not a multiple of n_head %d"):format(cfg.n_embd, cfg.n_head), 0)
    end
    cfg.head_dim = math.floor(cfg.n_embd / cfg.n_head)
  end
  whole(cfg, "head_dim", 2)
  cfg.eps = cfg.eps or eps or 1e-6
  cfg.rope_theta = cfg.rope_theta or 10000
  cfg.std = cfg.std or 0.02
  if cfg.tie == nil then cfg.tie = false end
  for _, k in ipairs({ "eps", "rope_theta", "std" }) do
    if type(cfg[k]) ~= "number" or not (cfg[k] > 0) then
      error(("%s must be a number > 0 (got %s)"):format(k, tostring(cfg[k])), 0)
    end
  end
  if cfg.rope_scaling == false then cfg.rope_scaling = nil end
  cfg.padded_vocab = padded(cfg.vocab)
  return cfg
end

-- A complete config from a table of fields (a named size's, or one read
-- from a config.json): checked, with the derived sizes. `family`: the
-- family finishing (the ones built on Llama's layer finish here).
function M.finish(cfg, family)
  M.shape(cfg)
  if cfg.head_dim % 2 ~= 0 then
    error(("head_dim %d must be even (rotary embeddings turn pairs)"):format(cfg.head_dim), 0)
  end
  if cfg.rope_scaling then check_scaling(cfg.rope_scaling) end
  cfg.family = family or "llama"
  return cfg
end

-- The config(name, overrides) of a family `fam` (luazero/families.lua's).
M.sizes = families.sizes

M.config = M.sizes(M)

------------------------------------------------------- rotary frequencies

local f32 = ffi.new("float[1]")
local function round32(x) f32[0] = x; return f32[0] end

-- The inverse frequencies of the rotary embeddings, head_dim / 2 numbers,
-- as Hugging Face works them out in fp32 (_compute_default_rope_parameters,
-- then _compute_llama3_parameters for rope_scaling llama3): every operation
-- rounded to fp32 as torch does it; theta^e in double, rounded.
function M.inv_freq(cfg)
  local d, theta, s = cfg.head_dim, cfg.rope_theta, cfg.rope_scaling
  local out = {}
  for i = 0, d / 2 - 1 do
    local e = round32(round32(2 * i) / d)
    out[i + 1] = round32(1 / round32(theta ^ e))
  end
  if not s then return out end
  if s.rope_type == "linear" then -- (_compute_linear_scaling_rope_parameters: inv_freq / factor)
    local factor = round32(s.factor)
    for i, f in ipairs(out) do out[i] = round32(f / factor) end
    return out
  end
  local factor, low, high = round32(s.factor), round32(s.low_freq_factor),
                            round32(s.high_freq_factor)
  local old = s.original_max_position_embeddings
  local low_wavelen = round32(old / s.low_freq_factor)
  local high_wavelen = round32(old / s.high_freq_factor)
  local span = round32(s.high_freq_factor - s.low_freq_factor)
  local two_pi = round32(2 * math.pi)
  for i, f in ipairs(out) do
    local wavelen = round32(two_pi / f)
    local g = wavelen > low_wavelen and round32(f / factor) or f
    if not (wavelen < high_wavelen) and not (wavelen > low_wavelen) then
      local smooth = round32(round32(round32(round32(old) / wavelen) - low) / span)
      local a = round32(round32(round32(1 - smooth) * g) / factor)
      g = round32(a + round32(smooth * g))
    end
    out[i] = g
  end
  return out
end

-------------------------------------------------------------------- model

-- The model as nn.CausalLM builds it, with Hugging Face's names (see the
-- header). Every Linear and the embedding start N(0, initializer_range)
-- (Hugging Face's _init_weights), RMSNorm weights 1.
M.description = {
  names = { body = "model", embedding = "embed_tokens", blocks = "layers", norm = "norm",
            head = "lm_head",
            block = { attn_norm = "input_layernorm", attn = "self_attn",
                      mlp_norm = "post_attention_layernorm", mlp = "mlp" } },
  -- The rotary frequencies, one table for every layer.
  shared = function(cfg) return { rope = nn.Rope.new(M.inv_freq(cfg)) } end,
  embedding = function(cfg)
    return nn.TokenEmbedding.new(cfg.padded_vocab, cfg.n_embd, cfg.std, nil, cfg.pad_id)
  end,
  norm = function(cfg) return nn.RMSNorm.new(cfg.n_embd, cfg.eps) end,
  attention = function(cfg, shared)
    return nn.GQA.new(cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim, shared.rope, cfg.std)
  end,
  mlp = function(cfg) return nn.SwiGLUMLP.new(cfg.n_embd, cfg.n_hidden, cfg.std) end,
  -- tie_word_embeddings: the head reads the token table; else a Linear of its own.
  head = function(cfg)
    if cfg.tie then return nil end
    return nn.Linear.new(cfg.n_embd, cfg.padded_vocab, { bias = false, std = cfg.std })
  end,
  -- LoRA targets (models/lora.lua): a module name -> the Linears it names,
  -- as the ends of their paths; part: a part of the packed q|k|v projection.
  lora_targets = {
    q_proj = { "self_attn", part = "q_proj" },
    k_proj = { "self_attn", part = "k_proj" },
    v_proj = { "self_attn", part = "v_proj" },
    o_proj = { "self_attn.o_proj" },
    gate_proj = { "mlp.gate_proj" },
    up_proj = { "mlp.up_proj" },
    down_proj = { "mlp.down_proj" },
  },
  -- what LoRA adapts when no targets are given (PEFT's default for llama)
  lora_default = { "q_proj", "v_proj" },
}

-- A family's description: `base`'s parts with `changes` in their place.
function M.derive(base, changes)
  local d = {}
  for k, v in pairs(base) do d[k] = v end
  for k, v in pairs(changes) do d[k] = v end
  return d
end

local Llama = nn.CausalLM:extend("Llama")
M.Llama = Llama

function M.new(cfg) return Llama:new(M.description, cfg) end

----------------------------------------------------------- Hugging Face

-- The rope of a config.json as transformers 4.x writes it (rope_theta and
-- rope_scaling at the top) and as 5.x does (rope_parameters: rope_type,
-- rope_theta and the scaling's fields in one table). `scalings`: rope_type
-- -> read(table, fail, key), the scalings the family implements, each
-- giving cfg.rope_scaling; "default" is none (rope_scaling false). Fields
-- of hf.fields: rope_theta, rope_scaling; `theta`: rope_theta's default.
local function rope_kind(s)
  if s.rope_type ~= nil then return s.rope_type end
  return s.type
end

function M.rope_fields(family, scalings, theta)
  scalings = scalings or {}
  local known = {}
  for k in pairs(scalings) do known[#known + 1] = cjson.encode(k) end
  table.sort(known)
  local listed = #known == 0 and '"default"' or table.concat(known, ", ") .. ' or "default"'
  local function reader(key)
    return function(s, fail)
      local kind = rope_kind(s)
      if kind == nil or kind == "default" then return false end
      if not scalings[kind] then
        fail(("field %s.%s is %s; only %s is implemented for %s")
             :format(key, s.rope_type ~= nil and "rope_type" or "type", cjson.encode(kind), listed,
                     family))
      end
      return scalings[kind](s, fail, key)
    end
  end
  local from_parameters = reader("rope_parameters")
  local function parameters(get)
    local rp = get("rope_parameters")
    return type(rp) == "table" and rp or nil
  end
  return {
    { false, "rope_parameters", "object", optional = true, read = from_parameters },
    { "rope_theta", "rope_theta", "number", default = function(_, get)
        local rp = parameters(get)
        return rp and type(rp.rope_theta) == "number" and rp.rope_theta or theta or 10000
      end },
    { "rope_scaling", "rope_scaling", "object", read = reader("rope_scaling"),
      default = function(_, get)
        local rp = parameters(get)
        return rp and from_parameters(rp, function(msg) error(msg, 0) end) or false
      end },
  }
end

-- Llama 3's scaling, from rope_scaling or rope_parameters.
local function read_llama3(s, fail, key)
  local out = { rope_type = "llama3" }
  for _, k in ipairs({ "factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings" }) do
    if type(s[k]) ~= "number" then fail(("field %s.%s is missing"):format(key, k)) end
    out[k] = s[k]
  end
  return out
end

-- Linear scaling, from rope_scaling or rope_parameters: the rotary
-- frequencies divided by factor.
function M.read_linear(s, fail, key)
  if type(s.factor) ~= "number" or not (s.factor > 0) then
    fail(("field %s.factor must be a number > 0 (got %s)"):format(key, cjson.encode(s.factor)))
  end
  return { rope_type = "linear", factor = s.factor }
end

-- A rope_scaling table as config.json holds it: linear's as transformers
-- 4.x validates it ({type, factor} and nothing else; 5.x reads it too).
function M.scaling_json(s)
  if type(s) ~= "table" then return cjson.null end
  if s.rope_type == "linear" then return { type = "linear", factor = s.factor } end
  local j = {}
  for k, v in pairs(s) do j[k] = v end
  return j
end

-- hf.fields every family built on Llama's layer reads (as llama.hf.fields
-- below), then `more`: opts.eps, opts.tie, opts.theta the defaults of
-- rms_norm_eps, tie_word_embeddings and rope_theta, opts.head_dim
-- head_dim's (nil: optional), opts.scalings as rope_fields', opts.pad
-- pad_token_id's (transformers' class default; nil: none), the token
-- table's padding_idx.
function M.hf_fields(family, opts, more)
  local list = {
    { "n_layer", "num_hidden_layers", "int" },
    { "n_head", "num_attention_heads", "int" },
    { "n_embd", "hidden_size", "int" },
    { "n_hidden", "intermediate_size", "int" },
    { "context", "max_position_embeddings", "int" },
    { "vocab", "vocab_size", "int" },
    { "n_kv_head", "num_key_value_heads", "int", default = function(cfg) return cfg.n_head end },
    { "head_dim", "head_dim", "int", default = opts.head_dim, optional = opts.head_dim == nil },
    { "eps", "rms_norm_eps", "number", default = opts.eps or 1e-6 },
    { "tie", "tie_word_embeddings", "bool", default = opts.tie or false },
    { "std", "initializer_range", "number", default = 0.02 },
    { "pad_id", "pad_token_id", "int", default = opts.pad, optional = opts.pad == nil,
      null_is_none = true },
    -- (kept to be exported: transformers' generate stops at eos_token_id)
    { "bos_id", "bos_token_id", "ids", optional = true },
    { "eos_id", "eos_token_id", "ids", optional = true },
  }
  for _, e in ipairs(M.rope_fields(family, opts.scalings, opts.theta)) do list[#list + 1] = e end
  for _, e in ipairs(more or {}) do list[#list + 1] = e end
  return list
end

-- The config.json keys every family built on Llama's layer writes, under
-- the family's architecture and model_type; the family adds its own.
function M.config_json_of(cfg, architecture, model_type)
  return {
    architectures = { architecture }, model_type = model_type,
    hidden_size = cfg.n_embd, intermediate_size = cfg.n_hidden,
    num_attention_heads = cfg.n_head, num_key_value_heads = cfg.n_kv_head or cfg.n_head,
    num_hidden_layers = cfg.n_layer, head_dim = cfg.head_dim,
    rms_norm_eps = cfg.eps, rope_theta = cfg.rope_theta,
    vocab_size = cfg.vocab, max_position_embeddings = cfg.context,
    tie_word_embeddings = cfg.tie == true, initializer_range = cfg.std or 0.02,
    hidden_act = "silu", attention_dropout = 0, pad_token_id = cfg.pad_id or cjson.null,
    bos_token_id = cfg.bos_id, eos_token_id = cfg.eos_id,
  }
end

-- The config.json (LlamaForCausalLM) of a config, loadable by transformers.
local function config_json(cfg)
  local j = M.config_json_of(cfg, "LlamaForCausalLM", "llama")
  j.rope_scaling = M.scaling_json(cfg.rope_scaling)
  j.attention_bias, j.mlp_bias = false, false
  return j
end

-- A family's hf table (as llama.hf below): `t` with the token tables, the
-- ignored names, the head and its tying of Llama's layout where t has none.
function M.hf_of(t)
  for _, k in ipairs({ "vocab_tables", "ignored", "head", "tied" }) do
    if t[k] == nil then t[k] = M.hf[k] end
  end
  return t
end

local NO_BIAS = "luazero's Llama has no biases"

-- What Hugging Face calls this family (registry.lua and hf.lua read it):
-- the config.json it reads and writes, its tensors' names (ours, as they
-- are), the token tables (the file holds the real vocabulary's rows), and
-- the LM head a tied model's file may hold but that is not a parameter.
M.hf = {
  architectures = { "LlamaForCausalLM" }, model_type = "llama",
  -- config.json fields in the order read: { ours (false: only checked),
  -- the file's key, kind, default (or required), allowed values }
  fields = M.hf_fields("llama", { scalings = { llama3 = read_llama3, linear = M.read_linear } }, {
    { false, "hidden_act", "string", default = "silu", allowed = { "silu" } },
    { false, "attention_bias", "bool", default = false, allowed = { false }, refusal = NO_BIAS },
    { false, "mlp_bias", "bool", default = false, allowed = { false }, refusal = NO_BIAS },
  }),
  -- the size whose learning rate a config.json's run trains with
  lr_of = "llama-100m",
  config_json = config_json,
  float_keys = { "rope_scaling.factor" }, -- (transformers 4.x refuses an int factor)
  vocab_tables = { "model.embed_tokens.weight", "lm_head.weight" },
  ignored = { "%.rotary_emb%.inv_freq$" },
  head = "lm_head.weight",
  tied = function(cfg) return cfg.tie == true end,
}

return M
