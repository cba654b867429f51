-- models/gemma2.lua — the Gemma 2 family as Hugging Face's Gemma2ForCausalLM
-- defines it: Gemma's parts (models/gemma.lua: GeGLU, 1 + weight norms,
-- scaled embeddings, a tied head) in a layer of four norms —
--   h = x + post_attention_layernorm(attn(input_layernorm(x)))
--   y = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
-- — attention scaled by query_pre_attn_scalar^-1/2 with its scores
-- soft-capped (attn_logit_softcapping: s -> c tanh(s / c)), a sliding
-- window on the layers layer_types names "sliding_attention" (every other
-- one from the first, by default), and the final logits soft-capped
-- (final_logit_softcapping) in the loss and in generation.
--
-- Parameter names are Hugging Face's: model.embed_tokens.weight,
-- model.layers.N.{input_layernorm,post_attention_layernorm,
-- pre_feedforward_layernorm,post_feedforward_layernorm}.weight,
-- model.layers.N.self_attn.{q,k,v,o}_proj.weight,
-- model.layers.N.mlp.{gate,up,down}_proj.weight, model.norm.weight.
local cjson = require("cjson")
local nn = require("luazero.nn")
local llama = require("models.llama")
local gemma = require("models.gemma")

local M = { name = "gemma2" }

local SLIDING, FULL = "sliding_attention", "full_attention"

------------------------------------------------------------------ configs

M.configs = {
  -- for tests: a window and caps that bite at short lengths
  ["gemma2-tiny"] = { n_layer = 2, n_head = 4, n_kv_head = 2, n_embd = 64, head_dim = 32,
                      n_hidden = 192, context = 256, vocab = 256, eps = 1e-6,
                      rope_theta = 10000, tie = true, query_pre_attn_scalar = 24, window = 8,
                      attn_softcap = 20, final_softcap = 10, lr = 3e-3 },
  -- google/gemma-2-2b's config.json
  ["gemma-2-2b"] = { n_layer = 26, n_head = 8, n_kv_head = 4, n_embd = 2304, head_dim = 256,
                     n_hidden = 9216, context = 8192, vocab = 256000, eps = 1e-6,
                     rope_theta = 10000, tie = true, query_pre_attn_scalar = 256, window = 4096,
                     attn_softcap = 50, final_softcap = 30, lr = 3e-4 },
  -- google/gemma-2-9b's config.json
  ["gemma-2-9b"] = { n_layer = 42, n_head = 16, n_kv_head = 8, n_embd = 3584, head_dim = 256,
                     n_hidden = 14336, context = 8192, vocab = 256000, eps = 1e-6,
                     rope_theta = 10000, tie = true, query_pre_attn_scalar = 256, window = 4096,
                     attn_softcap = 50, final_softcap = 30, lr = 3e-4 },
}
M.names = { "gemma2-tiny", "gemma-2-2b", "gemma-2-9b" }

local function positive(cfg, k)
  local v = cfg[k]
  if v ~= nil and (type(v) ~= "number" or not (v > 0)) then
    error(("%s must be a number > 0 or absent (got %s)"):format(k, tostring(v)), 0)
  end
end

-- family: the family finishing (Gemma 3 finishes its configs here too).
function M.finish(cfg, family)
  if cfg.tie == nil then cfg.tie = true end
  cfg = llama.finish(cfg, family or "gemma2")
  cfg.query_pre_attn_scalar = cfg.query_pre_attn_scalar or cfg.head_dim
  for _, k in ipairs({ "query_pre_attn_scalar", "window", "attn_softcap", "final_softcap" }) do
    positive(cfg, k)
  end
  if cfg.window and cfg.window ~= math.floor(cfg.window) then
    error(("window must be a whole number (got %s)"):format(tostring(cfg.window)), 0)
  end
  local types = cfg.layer_types
  if types == nil then
    -- every pattern-th layer full, the others sliding (Gemma 2: 2)
    local pattern = cfg.sliding_window_pattern or 2
    types = {}
    for i = 1, cfg.n_layer do types[i] = i % pattern == 0 and FULL or SLIDING end
    cfg.layer_types = types
  end
  if #types ~= cfg.n_layer then
    error(("layer_types has %d entries for %d layers"):format(#types, cfg.n_layer), 0)
  end
  for i, t in ipairs(types) do
    if t ~= SLIDING and t ~= FULL then
      error(("layer_types[%d] is %s; expected \"%s\" or \"%s\"")
            :format(i - 1, cjson.encode(t), SLIDING, FULL), 0)
    end
  end
  return cfg
end

M.config = llama.sizes(M)

-------------------------------------------------------------------- model

-- The attention options of layer i (nn/gqa.lua's opts): each absent where it
-- changes nothing (a window the context fits in, the default scale), so such
-- a layer runs the plain attention kernels.
function M.attention_opts(cfg, i)
  local o = {}
  if cfg.layer_types[i] == SLIDING and cfg.window and cfg.window < cfg.context then
    o.window = cfg.window
  end
  o.softcap = cfg.attn_softcap
  if cfg.query_pre_attn_scalar ~= cfg.head_dim then o.scale = cfg.query_pre_attn_scalar ^ -0.5 end
  return o
end

local desc = llama.derive(gemma.description, {
  names = { body = "model", embedding = "embed_tokens", blocks = "layers", norm = "norm",
            head = "lm_head",
            block = { attn_norm = "input_layernorm", attn = "self_attn",
                      attn_post_norm = "post_attention_layernorm",
                      mlp_norm = "pre_feedforward_layernorm", mlp = "mlp",
                      mlp_post_norm = "post_feedforward_layernorm" } },
  final_softcap = function(cfg) return cfg.final_softcap end,
})
-- Layer i's attention with its options (and `more` of a family's own, as
-- Gemma 3's QK-norm), turning by `rope`.
function M.attention(cfg, rope, i, more)
  local opts = M.attention_opts(cfg, i)
  for k, v in pairs(more or {}) do opts[k] = v end
  return nn.GQA.new(cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim, rope, cfg.std, opts)
end

desc.attention = function(cfg, shared, i) return M.attention(cfg, shared.rope, i) end
M.description = desc

local Gemma2 = nn.CausalLM:extend("Gemma2")
M.Gemma2 = Gemma2

function M.new(cfg) return Gemma2:new(M.description, cfg) end

----------------------------------------------------------- Hugging Face

local function config_json(cfg)
  local j = gemma.hf.config_json(cfg)
  j.architectures, j.model_type = { "Gemma2ForCausalLM" }, "gemma2"
  j.query_pre_attn_scalar = cfg.query_pre_attn_scalar
  j.sliding_window = cfg.window or cjson.null
  j.attn_logit_softcapping = cfg.attn_softcap or cjson.null
  j.final_logit_softcapping = cfg.final_softcap or cjson.null
  j.layer_types = cfg.layer_types
  return j
end

function M.read_layer_types(v, fail)
  for i, t in ipairs(v) do
    if t ~= SLIDING and t ~= FULL then
      fail(("field layer_types[%d] is %s; expected \"%s\" or \"%s\"")
           :format(i - 1, cjson.encode(t), SLIDING, FULL))
    end
  end
  return v
end

-- config.json's fields of Gemma 2 and of Gemma 3 (`family`, with `more`
-- of its own): Llama's with Gemma's defaults, no rotary scaling. `absent`:
-- transformers' values of sliding_window, attn_logit_softcapping and
-- final_logit_softcapping where the file leaves them out (an explicit null
-- is none); a key of `absent` set to false is not read (Gemma 3's
-- attention cap, which transformers 5.23 keeps but never applies).
function M.hf_fields(family, more, absent)
  local name = ({ gemma2 = "Gemma 2", gemma3 = "Gemma 3" })[family] or family
  local function capped(field, key)
    if absent[field] == false then
      return { false, key, "number", optional = true }
    end
    return { field, key, "number", default = absent[field], optional = absent[field] == nil,
             null_is_none = true }
  end
  local list = llama.hf_fields(family, { head_dim = 256, tie = true, pad = 0 }, {
    { "query_pre_attn_scalar", "query_pre_attn_scalar", "number", default = 256 },
    { "window", "sliding_window", "int", default = absent.window, null_is_none = true },
    capped("attn_softcap", "attn_logit_softcapping"),
    capped("final_softcap", "final_logit_softcapping"),
    { "layer_types", "layer_types", "object", optional = true, read = M.read_layer_types },
    { false, "hidden_activation", "string", default = "gelu_pytorch_tanh",
      allowed = { "gelu_pytorch_tanh" },
      refusal = ("luazero's %s has the tanh GELU (gelu_pytorch_tanh)"):format(name) },
    { false, "attention_bias", "bool", default = false, allowed = { false },
      refusal = ("luazero's %s has no biases"):format(name) },
    { false, "use_bidirectional_attention", "bool", default = false, allowed = { false },
      refusal = "luazero's Gemma is a causal language model; bidirectional attention " ..
                "(an encoder's) is not supported" },
  })
  for _, e in ipairs(more or {}) do list[#list + 1] = e end
  return list
end

M.hf = llama.hf_of({
  architectures = { "Gemma2ForCausalLM" }, model_type = "gemma2",
  fields = M.hf_fields("gemma2", nil, { window = 4096, attn_softcap = 50, final_softcap = 30 }),
  lr_of = "gemma-2-2b",
  config_json = config_json,
  float_keys = { "rms_norm_eps", "rope_theta", "initializer_range", "attn_logit_softcapping",
                 "final_logit_softcapping" },
})

return M
