-- models/qwen2.lua — the Qwen2 family (Qwen2 and Qwen2.5) as Hugging Face's
-- Qwen2ForCausalLM defines it: Llama's layer (models/llama.lua: RMSNorm
-- before each branch, rotary embeddings, grouped-query attention, a SwiGLU
-- MLP) with a bias on q_proj, k_proj and v_proj (none on o_proj), rope_theta
-- 1e6, the LM head tied to the token embedding on the small sizes.
--
--   local qwen2 = require("models.qwen2")
--   local cfg = qwen2.config("qwen2.5-0.5b", { n_layer = 4 })
--   local model = qwen2.new(cfg)
--
-- Parameter names are Hugging Face's: Llama's, plus
-- model.layers.N.self_attn.{q,k,v}_proj.bias. A config.json is read as
-- transformers 4.x writes it (rope_theta, torch_dtype) and as 5.x does
-- (rope_parameters, dtype, layer_types). Sliding windows
-- (use_sliding_window, or a "sliding_attention" entry of layer_types) are
-- refused: the attention here sees every earlier position.
local cjson = require("cjson")
local nn = require("luazero.nn")
local llama = require("models.llama")

local M = { name = "qwen2" }

------------------------------------------------------------------ configs

-- lr: a learning rate that trains the size well, used when --lr is not given.
M.configs = {
  -- for tests: GQA (2 query heads per key/value head), two layers, tied
  ["qwen2-tiny"] = { n_layer = 2, n_head = 4, n_kv_head = 2, n_embd = 64, n_hidden = 176,
                     context = 256, vocab = 256, eps = 1e-6, rope_theta = 1000000, tie = true,
                     lr = 3e-3 },
  -- llama-100m's shape with Qwen2's biases and rope_theta, for benchmarks
  ["qwen2-100m"] = { n_layer = 12, n_head = 12, n_kv_head = 4, n_embd = 768, n_hidden = 2048,
                     context = 1024, vocab = 32000, eps = 1e-6, rope_theta = 1000000,
                     tie = true, lr = 6e-4 },
  -- Qwen/Qwen2.5-0.5B's config.json
  ["qwen2.5-0.5b"] = { n_layer = 24, n_head = 14, n_kv_head = 2, n_embd = 896, n_hidden = 4864,
                       context = 32768, vocab = 151936, eps = 1e-6, rope_theta = 1000000,
                       tie = true, lr = 3e-4 },
  -- Qwen/Qwen2.5-1.5B's config.json
  ["qwen2.5-1.5b"] = { n_layer = 28, n_head = 12, n_kv_head = 2, n_embd = 1536, n_hidden = 8960,
                       context = 131072, vocab = 151936, eps = 1e-6, rope_theta = 1000000,
                       tie = true, lr = 3e-4 },
  -- Qwen/Qwen2.5-7B's config.json
  ["qwen2.5-7b"] = { n_layer = 28, n_head = 28, n_kv_head = 4, n_embd = 3584, n_hidden = 18944,
                     context = 131072, vocab = 152064, eps = 1e-6, rope_theta = 1000000,
                     tie = false, lr = 3e-4 },
}
M.names = { "qwen2-tiny", "qwen2-100m", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b" }

-- A complete config: Llama's checks and derived sizes, this family's name.
function M.finish(cfg)
  if cfg.rope_scaling then
    error("rope_scaling is not implemented for qwen2; only the default rotary embedding is", 0)
  end
  llama.finish(cfg)
  cfg.family = "qwen2"
  return cfg
end

-- A named size with overrides (any field above).
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

-- Llama's description with a bias on the q|k|v projection.
M.description = {}
for k, v in pairs(llama.description) do M.description[k] = v end
M.description.attention = function(cfg, shared)
  return nn.GQA.new(cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim, shared.rope, cfg.std,
                    { bias = true })
end

local Qwen2 = nn.CausalLM:extend("Qwen2")
M.Qwen2 = Qwen2

function M.new(cfg) return Qwen2:new(M.description, cfg) end

----------------------------------------------------------- Hugging Face

-- config.json's fields both Qwen families read (each adds its own after):
-- transformers 4.x's rope_theta or 5.x's rope_parameters.rope_theta, and no
-- sliding window on any layer. `family`: the name the refusals give.
function M.common_fields(family)
  local function refuse_window(what)
    return ("%s; sliding windows are not implemented for %s (every layer attends to all " ..
            "earlier positions)"):format(what, family)
  end
  return {
    { "n_layer", "num_hidden_layers", "int" },
    { "n_head", "num_attention_heads", "int" },
    { "n_embd", "hidden_size", "int" },
    { "n_hidden", "intermediate_size", "int" },
    { "context", "max_position_embeddings", "int" },
    { "vocab", "vocab_size", "int" },
    { "n_kv_head", "num_key_value_heads", "int", default = function(cfg) return cfg.n_head end },
    { "eps", "rms_norm_eps", "number", default = 1e-6 },
    { false, "rope_parameters", "object", optional = true,
      read = function(rp, fail)
        local t = rp.rope_type ~= nil and rp.rope_type or rp.type
        if t ~= nil and t ~= "default" then
          fail(("field rope_parameters.rope_type is %s; only \"default\" is implemented for %s")
               :format(cjson.encode(t), family))
        end
        return rp
      end },
    { "rope_theta", "rope_theta", "number",
      default = function(_, get)
        local rp = get("rope_parameters")
        return type(rp) == "table" and type(rp.rope_theta) == "number" and rp.rope_theta or 10000
      end },
    { false, "rope_scaling", "object", optional = true,
      read = function(_, fail)
        fail(("field rope_scaling is set; only the default rotary embedding is implemented " ..
              "for %s"):format(family))
      end },
    { "tie", "tie_word_embeddings", "bool", default = false },
    { "std", "initializer_range", "number", default = 0.02 },
    { false, "hidden_act", "string", default = "silu", allowed = { "silu" } },
    { false, "use_sliding_window", "bool", default = false, allowed = { false },
      refusal = refuse_window("expected false") },
    { false, "layer_types", "object", optional = true,
      read = function(types, fail)
        for i, t in ipairs(types) do
          if t ~= "full_attention" then
            fail(refuse_window(("field layer_types[%d] is %s"):format(i - 1, cjson.encode(t))))
          end
        end
        return types
      end },
  }
end

-- list with more entries appended (a new table).
function M.with_fields(list, more)
  local out = {}
  for _, e in ipairs(list) do out[#out + 1] = e end
  for _, e in ipairs(more) do out[#out + 1] = e end
  return out
end

-- The config.json (Qwen2ForCausalLM) of a config, loadable by transformers
-- 4.x and 5.x.
local function config_json(cfg)
  return {
    architectures = { "Qwen2ForCausalLM" }, model_type = "qwen2",
    hidden_size = cfg.n_embd, intermediate_size = cfg.n_hidden,
    num_attention_heads = cfg.n_head, num_key_value_heads = cfg.n_kv_head or cfg.n_head,
    num_hidden_layers = cfg.n_layer, head_dim = cfg.head_dim, rms_norm_eps = cfg.eps,
    rope_theta = cfg.rope_theta,
    vocab_size = cfg.vocab, max_position_embeddings = cfg.context,
    tie_word_embeddings = cfg.tie == true, initializer_range = cfg.std or 0.02,
    hidden_act = "silu", attention_dropout = 0, use_sliding_window = false,
    sliding_window = cjson.null, max_window_layers = cfg.n_layer,
  }
end

-- As models/llama.lua's hf, for Qwen2ForCausalLM.
M.hf = {
  architectures = { "Qwen2ForCausalLM" }, model_type = "qwen2",
  fields = M.with_fields(M.common_fields("qwen2"), {
    -- Qwen2Attention reads head_dim where a config has one
    { "head_dim", "head_dim", "int", optional = true },
  }),
  lr_of = "qwen2-100m",
  config_json = config_json,
  vocab_tables = llama.hf.vocab_tables,
  ignored = llama.hf.ignored,
  head = llama.hf.head,
  tied = llama.hf.tied,
}

return M
