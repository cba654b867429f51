-- models/qwen3.lua — the Qwen3 family (dense) as Hugging Face's
-- Qwen3ForCausalLM defines it: Qwen2's layer (models/qwen2.lua) without the
-- q, k, v biases and with QK-norm — an RMSNorm over each head of q and of k
-- before the rotary turn (nn/qk_norm.lua) — and an explicit head_dim that
-- need not be hidden_size / num_attention_heads (qwen3-0.6b: 1024 / 16 heads
-- of 128). The LM head is tied on the small sizes.
--
--   local qwen3 = require("models.qwen3")
--   local cfg = qwen3.config("qwen3-0.6b", { n_layer = 4 })
--   local model = qwen3.new(cfg)
--
-- Parameter names are Hugging Face's: Llama's, plus
-- model.layers.N.self_attn.q_norm.weight and k_norm.weight [head_dim].
-- config.json as transformers 4.x and 5.x write it, sliding windows as
-- there (models/qwen2.lua).
local nn = require("luazero.nn")
local llama = require("models.llama")
local qwen2 = require("models.qwen2")

local M = { name = "qwen3" }

------------------------------------------------------------------ configs

-- lr: a learning rate that trains the size well, used when --lr is not given.
M.configs = {
  -- for tests: GQA, head_dim 32 with n_embd 64 over 4 heads (not 16), tied
  ["qwen3-tiny"] = { n_layer = 2, n_head = 4, n_kv_head = 2, head_dim = 32, n_embd = 64,
                     n_hidden = 176, context = 256, vocab = 256, eps = 1e-6,
                     rope_theta = 1000000, tie = true, lr = 3e-3 },
  -- llama-100m's shape with Qwen3's QK-norm and rope_theta, for benchmarks
  ["qwen3-100m"] = { n_layer = 12, n_head = 12, n_kv_head = 4, head_dim = 64, n_embd = 768,
                     n_hidden = 2048, context = 1024, vocab = 32000, eps = 1e-6,
                     rope_theta = 1000000, tie = true, lr = 6e-4 },
  -- Qwen/Qwen3-0.6B's config.json
  ["qwen3-0.6b"] = { n_layer = 28, n_head = 16, n_kv_head = 8, head_dim = 128, n_embd = 1024,
                     n_hidden = 3072, context = 40960, vocab = 151936, eps = 1e-6,
                     rope_theta = 1000000, tie = true, lr = 3e-4 },
  -- Qwen/Qwen3-8B's config.json
  ["qwen3-8b"] = { n_layer = 36, n_head = 32, n_kv_head = 8, head_dim = 128, n_embd = 4096,
                   n_hidden = 12288, context = 40960, vocab = 151936, eps = 1e-6,
                   rope_theta = 1000000, tie = false, lr = 3e-4 },
}
M.names = { "qwen3-tiny", "qwen3-100m", "qwen3-0.6b", "qwen3-8b" }

-- A complete config: Qwen2's checks, this family's name.
function M.finish(cfg) return qwen2.finish(cfg, "qwen3") end

M.config = llama.sizes(M)

-------------------------------------------------------------------- model

-- Llama's description with QK-norm in the attention (Qwen3RMSNorm over
-- head_dim with the model's rms_norm_eps, the weight used as is: offset 0)
-- and the layer's window.
M.description = llama.derive(llama.description, {
  attention = function(cfg, shared, i)
    return qwen2.attention(cfg, shared, i, { qk_norm = { eps = cfg.eps, offset = 0 } })
  end,
})

local Qwen3 = nn.CausalLM:extend("Qwen3")
M.Qwen3 = Qwen3

function M.new(cfg) return Qwen3:new(M.description, cfg) end

----------------------------------------------------------- Hugging Face

-- The config.json (Qwen3ForCausalLM) of a config, loadable by transformers 5.x.
local function config_json(cfg)
  local j = qwen2.hf.config_json(cfg)
  j.architectures, j.model_type = { "Qwen3ForCausalLM" }, "qwen3"
  j.attention_bias = false
  return j
end

-- As models/llama.lua's hf, for Qwen3ForCausalLM (Qwen3Config's head_dim
-- default when a file has none: 128).
M.hf = llama.hf_of({
  architectures = { "Qwen3ForCausalLM" }, model_type = "qwen3",
  fields = qwen2.hf_fields("qwen3", 128, {
    { false, "attention_bias", "bool", default = false, allowed = { false },
      refusal = "luazero's Qwen3 has no attention biases" },
  }),
  lr_of = "qwen3-100m",
  config_json = config_json,
})

return M
