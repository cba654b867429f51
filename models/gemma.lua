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
  return llama.finish(cfg, "gemma")
end

M.config = llama.sizes(M)

-------------------------------------------------------------------- model

-- Llama's description with Gemma's parts. Linears and the embedding start
-- N(0, initializer_range), norm weights 0 (a factor of 1).
M.description = llama.derive(llama.description, {
  embedding = function(cfg)
    return nn.TokenEmbedding.new(cfg.padded_vocab, cfg.n_embd, cfg.std, math.sqrt(cfg.n_embd),
                                 cfg.pad_id)
  end,
  norm = function(cfg) return nn.RMSNorm.new(cfg.n_embd, cfg.eps, 1) end,
  mlp = function(cfg)
    return nn.SwiGLUMLP.new(cfg.n_embd, cfg.n_hidden, cfg.std, { act = "gelu_tanh" })
  end,
})

local Gemma = nn.CausalLM:extend("Gemma")
M.Gemma = Gemma

function M.new(cfg) return Gemma:new(M.description, cfg) end

----------------------------------------------------------- Hugging Face

-- The config.json (GemmaForCausalLM) of a config, loadable by transformers.
local function config_json(cfg)
  local j = llama.config_json_of(cfg, "GemmaForCausalLM", "gemma")
  j.hidden_act, j.hidden_activation = "gelu_pytorch_tanh", "gelu_pytorch_tanh"
  j.attention_bias = false
  return j
end

-- transformers reads hidden_act "gelu" as the tanh GELU when
-- hidden_activation is absent (GemmaMLP); an explicit one is what it runs.
local TANH = "luazero's Gemma has the tanh GELU (gelu_pytorch_tanh)"

-- Llama's fields with Gemma's defaults (head_dim 256, a tied head), no
-- rotary scaling, the tanh GELU.
M.hf = llama.hf_of({
  architectures = { "GemmaForCausalLM" }, model_type = "gemma",
  fields = llama.hf_fields("gemma", { head_dim = 256, tie = true, pad = 0 }, {
    { false, "hidden_act", "string", default = "gelu_pytorch_tanh",
      allowed = { "gelu", "gelu_pytorch_tanh" }, refusal = TANH },
    { false, "hidden_activation", "string", optional = true, allowed = { "gelu_pytorch_tanh" },
      refusal = TANH },
    { false, "attention_bias", "bool", default = false, allowed = { false },
      refusal = "luazero's Gemma has no biases" },
  }),
  lr_of = "gemma-2b",
  config_json = config_json,
})

return M
