-- models/gemma.lua — the Gemma family as Hugging Face's GemmaForCausalLM
-- defines it: Llama's layer (models/llama.lua) with a GeGLU MLP (the gate
-- through the tanh GELU), RMSNorms that scale by 1 + weight (weights start
-- at 0), token embeddings multiplied by sqrt(hidden_size), a head_dim of its
-- own (256 on the real sizes, whatever hidden / heads is), grouped- or
-- multi-query attention (num_key_value_heads; gemma-2b has 1) and an LM
-- head tied to the token table.
--
--   local gemma = require("models.gemma")
--   local cfg = gemma.config("gemma-tiny", { n_layer = 4 })
--   local model = gemma.new(cfg)
--
-- Parameter names are Hugging Face's, as Llama's: model.embed_tokens.weight,
-- model.layers.N.input_layernorm.weight, model.layers.N.self_attn.{q,k,v,o}_proj.weight,
-- model.layers.N.post_attention_layernorm.weight,
-- model.layers.N.mlp.{gate,up,down}_proj.weight, model.norm.weight
-- (lm_head.weight only when untied).
local nn = require("luazero.nn")
local llama = require("models.llama")

local M = { name = "gemma" }

------------------------------------------------------------------ configs

M.configs = {
  -- for tests: head_dim apart from n_embd / n_head, multi-query attention
  ["gemma-tiny"] = { n_layer = 2, n_head = 4, n_kv_head = 1, n_embd = 64, head_dim = 32,
                     n_hidden = 192, context = 256, vocab = 256, eps = 1e-6,
                     rope_theta = 10000, tie = true, lr = 3e-3 },
  -- about 100M parameters (tied), llama-100m's shape with Gemma's parts, for
  -- benchmarks
  ["gemma-100m"] = { n_layer = 12, n_head = 12, n_kv_head = 4, n_embd = 768, head_dim = 64,
                     n_hidden = 2048, context = 1024, vocab = 32000, eps = 1e-6,
                     rope_theta = 10000, tie = true, lr = 6e-4 },
  -- google/gemma-2b's config.json
  ["gemma-2b"] = { n_layer = 18, n_head = 8, n_kv_head = 1, n_embd = 2048, head_dim = 256,
                   n_hidden = 16384, context = 8192, vocab = 256000, eps = 1e-6,
                   rope_theta = 10000, tie = true, lr = 3e-4 },
  -- google/gemma-7b's config.json
  ["gemma-7b"] = { n_layer = 28, n_head = 16, n_kv_head = 16, n_embd = 3072, head_dim = 256,
                   n_hidden = 24576, context = 8192, vocab = 256000, eps = 1e-6,
                   rope_theta = 10000, tie = true, lr = 3e-4 },
}
M.names = { "gemma-tiny", "gemma-100m", "gemma-2b", "gemma-7b" }

-- Llama's checks and derived sizes; Gemma ties its head unless told not to.
function M.finish(cfg)
  if cfg.tie == nil then cfg.tie = true end
  cfg = llama.finish(cfg)
  cfg.family = "gemma"
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

-------------------------------------------------------------------- model

-- Llama's description with Gemma's parts. Linears and the embedding start
-- N(0, initializer_range), norm weights 0 (a factor of 1).
local desc = {}
for k, v in pairs(llama.description) do desc[k] = v end
desc.embedding = function(cfg)
  return nn.TokenEmbedding.new(cfg.padded_vocab, cfg.n_embd, cfg.std, math.sqrt(cfg.n_embd))
end
desc.norm = function(cfg) return nn.RMSNorm.new(cfg.n_embd, cfg.eps, 1) end
desc.mlp = function(cfg)
  return nn.SwiGLUMLP.new(cfg.n_embd, cfg.n_hidden, cfg.std, { act = "gelu_tanh" })
end
M.description = desc

local Gemma = nn.CausalLM:extend("Gemma")
M.Gemma = Gemma

function M.new(cfg) return Gemma:new(M.description, cfg) end

----------------------------------------------------------- Hugging Face

-- The config.json (GemmaForCausalLM) of a config, loadable by transformers.
local function config_json(cfg)
  return {
    architectures = { "GemmaForCausalLM" }, model_type = "gemma",
    hidden_size = cfg.n_embd, intermediate_size = cfg.n_hidden,
    num_attention_heads = cfg.n_head, num_key_value_heads = cfg.n_kv_head or cfg.n_head,
    num_hidden_layers = cfg.n_layer, head_dim = cfg.head_dim,
    rms_norm_eps = cfg.eps, rope_theta = cfg.rope_theta,
    vocab_size = cfg.vocab, max_position_embeddings = cfg.context,
    tie_word_embeddings = cfg.tie == true, initializer_range = cfg.std or 0.02,
    hidden_act = "gelu_pytorch_tanh", hidden_activation = "gelu_pytorch_tanh",
    attention_bias = false, attention_dropout = 0,
  }
end

-- transformers reads hidden_act "gelu" as the tanh GELU when
-- hidden_activation is absent (GemmaMLP); an explicit one is what it runs.
local TANH = "luazero's Gemma has the tanh GELU (gelu_pytorch_tanh)"

M.hf = {
  architectures = { "GemmaForCausalLM" }, model_type = "gemma",
  fields = {
    { "n_layer", "num_hidden_layers", "int" },
    { "n_head", "num_attention_heads", "int" },
    { "n_embd", "hidden_size", "int" },
    { "n_hidden", "intermediate_size", "int" },
    { "context", "max_position_embeddings", "int" },
    { "vocab", "vocab_size", "int" },
    { "n_kv_head", "num_key_value_heads", "int", default = function(cfg) return cfg.n_head end },
    { "head_dim", "head_dim", "int", default = 256 },
    { "eps", "rms_norm_eps", "number", default = 1e-6 },
    -- transformers 5.x writes rope_parameters.rope_theta
    { "rope_theta", "rope_theta", "number", default = function(_, get)
        local rp = get("rope_parameters")
        return type(rp) == "table" and type(rp.rope_theta) == "number" and rp.rope_theta or 10000
      end },
    { "tie", "tie_word_embeddings", "bool", default = true },
    { "std", "initializer_range", "number", default = 0.02 },
    { false, "hidden_act", "string", default = "gelu_pytorch_tanh",
      allowed = { "gelu", "gelu_pytorch_tanh" }, refusal = TANH },
    { false, "hidden_activation", "string", optional = true, allowed = { "gelu_pytorch_tanh" },
      refusal = TANH },
    { false, "attention_bias", "bool", default = false, allowed = { false },
      refusal = "luazero's Gemma has no biases" },
    { false, "rope_scaling", "object", optional = true, allowed = {},
      refusal = "luazero's Gemma has no rotary scaling" },
  },
  lr_of = "gemma-2b",
  config_json = config_json,
  vocab_tables = { "model.embed_tokens.weight", "lm_head.weight" },
  ignored = { "%.rotary_emb%.inv_freq$" },
  head = "lm_head.weight",
  tied = function(cfg) return cfg.tie == true end,
}

return M
