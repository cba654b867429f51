-- models/mistral.lua — the Mistral family as Hugging Face's
-- MistralForCausalLM defines it: Llama's layer (RMSNorm, rotary embeddings,
-- grouped-query attention, SwiGLU, no biases) with sliding-window attention:
-- a query at position t sees the keys t - W < s <= t (`sliding_window` W,
-- its own included, as transformers 5.x masks it; null: all of them).
-- generate.lua's cache then keeps W positions a layer (a ring).
--
--   local mistral = require("models.mistral")
--   local cfg = mistral.config("mistral-tiny", { window = 8 })
--   local model = mistral.new(cfg)
--
-- Parameter names are Llama's (model.layers.N.self_attn.q_proj.weight, ...).
local cjson = require("cjson")
local nn = require("luazero.nn")
local llama = require("models.llama")

local M = { name = "mistral" }

-- window: sliding_window (0: none). lr as Llama's sizes.
M.configs = {
  -- for tests: Llama-tiny's shape with a window shorter than the test sequences
  ["mistral-tiny"] = { n_layer = 2, n_head = 4, n_kv_head = 2, n_embd = 64, n_hidden = 176,
                       context = 256, vocab = 256, eps = 1e-5, rope_theta = 10000, tie = false,
                       window = 8, lr = 3e-3 },
  -- mistralai/Mistral-7B-v0.1's config.json
  ["mistral-7b"] = { n_layer = 32, n_head = 32, n_kv_head = 8, n_embd = 4096, n_hidden = 14336,
                     context = 32768, vocab = 32000, eps = 1e-5, rope_theta = 10000,
                     tie = false, window = 4096, lr = 3e-4 },
}
M.names = { "mistral-tiny", "mistral-7b" }

-- Llama's checks, then the window.
function M.finish(cfg)
  cfg.window = cfg.window or 0
  local w = cfg.window
  if type(w) ~= "number" or w < 0 or w ~= math.floor(w) then
    error(("window must be a whole number >= 0, 0 for none (got %s)"):format(tostring(w)), 0)
  end
  cfg = llama.finish(cfg)
  cfg.family = M.name
  return cfg
end

function M.config(name, overrides)
  local base = M.configs[name]
  if not base then
    error(("unknown model '%s' (known: %s)"):format(tostring(name), table.concat(M.names, ", ")),
          0)
  end
  local cfg = { name = name }
  for k, v in pairs(base) do cfg[k] = v end
  for k, v in pairs(overrides or {}) do cfg[k] = v end
  return M.finish(cfg)
end

-- Llama's description with the window in every layer's attention, and
-- PEFT 0.21.2's default LoRA targets for mistral.
M.description = {}
for k, v in pairs(llama.description) do M.description[k] = v end
M.description.attention = function(cfg, shared)
  local opts = cfg.window > 0 and { window = cfg.window } or nil
  return nn.GQA.new(cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim, shared.rope, cfg.std, opts)
end
M.description.lora_default = { "q_proj", "v_proj" }

function M.new(cfg) return llama.Llama:new(M.description, cfg) end

----------------------------------------------------------- Hugging Face

local function config_json(cfg)
  local j = llama.hf.config_json(cfg)
  j.architectures, j.model_type = { "MistralForCausalLM" }, "mistral"
  j.sliding_window = cfg.window > 0 and cfg.window or cjson.null
  j.attention_bias, j.mlp_bias, j.rope_scaling = nil, nil, nil
  return j
end

-- transformers 5.x writes rope_parameters { rope_type, rope_theta }; only
-- the plain rotary embedding is Mistral's.
local function read_rope_parameters(p, fail)
  local t = p.rope_type ~= nil and p.rope_type or p.type
  if t ~= nil and t ~= "default" then
    fail(("field rope_parameters.rope_type is %s; Mistral's is \"default\""):format(
      cjson.encode(t)))
  end
  return p
end

local function refuse_scaling(_, fail)
  fail("field rope_scaling is set; Mistral's rotary embedding has no scaling (remove it)")
end

-- rope_theta, or rope_parameters.rope_theta as 5.x writes it.
local function rope_theta(_, get)
  local p = get("rope_parameters")
  return type(p) == "table" and type(p.rope_theta) == "number" and p.rope_theta or 10000
end

M.hf = {
  architectures = { "MistralForCausalLM" }, model_type = "mistral",
  fields = {
    { "n_layer", "num_hidden_layers", "int" },
    { "n_head", "num_attention_heads", "int" },
    { "n_embd", "hidden_size", "int" },
    { "n_hidden", "intermediate_size", "int" },
    { "context", "max_position_embeddings", "int" },
    { "vocab", "vocab_size", "int" },
    { "n_kv_head", "num_key_value_heads", "int", default = function(cfg) return cfg.n_head end },
    { "eps", "rms_norm_eps", "number", default = 1e-6 },
    { false, "rope_parameters", "object", optional = true, read = read_rope_parameters },
    { "rope_theta", "rope_theta", "number", default = rope_theta },
    { "tie", "tie_word_embeddings", "bool", default = false },
    { "std", "initializer_range", "number", default = 0.02 },
    { "head_dim", "head_dim", "int", optional = true },
    -- absent: transformers' default 4096; null: none
    { "window", "sliding_window", "int", default = 4096, if_null = 0 },
    { false, "hidden_act", "string", default = "silu", allowed = { "silu" } },
    { false, "rope_scaling", "object", optional = true, read = refuse_scaling },
  },
  lr_of = "mistral-7b",
  config_json = config_json,
  vocab_tables = llama.hf.vocab_tables,
  ignored = llama.hf.ignored,
  head = llama.hf.head,
  tied = llama.hf.tied,
}

return M
