-- models/mixtral.lua — the Mixtral family as Hugging Face's
-- MixtralForCausalLM defines it: Mistral's layer (models/mistral.lua: Llama's
-- with sliding-window attention where sliding_window is set) whose MLP is a
-- sparse MoE block (nn/moe.lua) on every layer: num_local_experts SwiGLU
-- experts of intermediate_size, num_experts_per_tok a token, their weights
-- always renormalised (MixtralTopKRouter), router_jitter_noise in training.
--
-- Parameter names as the Hub's checkpoints (and save_pretrained) hold them:
-- Llama's, with model.layers.N.block_sparse_moe.gate.weight [E, hidden] and
-- block_sparse_moe.experts.M.w1 (gate), w3 (up), w2 (down) .weight.
local nn = require("luazero.nn")
local llama = require("models.llama")
local mistral = require("models.mistral")
local qwen2 = require("models.qwen2")
local qwen2_moe = require("models.qwen2_moe")

local moe = qwen2_moe.moe
local M = { name = "mixtral" }

------------------------------------------------------------------ configs

-- lr: a learning rate that trains the size well, used when --lr is not given.
M.configs = {
  -- for tests: 8 experts, 2 a token
  ["mixtral-tiny"] = { n_layer = 2, n_head = 4, n_kv_head = 2, n_embd = 64, n_hidden = 48,
                       context = 256, vocab = 256, eps = 1e-5, rope_theta = 1000000,
                       tie = false, window = 0, n_experts = 8, top_k = 2,
                       router_logits = true, aux_coef = 0.02, lr = 3e-3 },
  -- llama-100m with its MLP replaced by 8 experts of the same width, 2 a token
  ["moe-100m"] = { n_layer = 12, n_head = 12, n_kv_head = 4, n_embd = 768, n_hidden = 2048,
                   context = 1024, vocab = 32000, eps = 1e-5, rope_theta = 10000, tie = true,
                   window = 0, n_experts = 8, top_k = 2, router_logits = true,
                   aux_coef = 0.02, lr = 6e-4 },
  -- mistralai/Mixtral-8x7B-v0.1's config.json
  ["mixtral-8x7b"] = { n_layer = 32, n_head = 32, n_kv_head = 8, n_embd = 4096, n_hidden = 14336,
                       context = 32768, vocab = 32000, eps = 1e-5, rope_theta = 1000000,
                       tie = false, window = 0, n_experts = 8, top_k = 2,
                       router_logits = false, aux_coef = 0.02, lr = 3e-4 },
}
M.names = { "mixtral-tiny", "moe-100m", "mixtral-8x7b" }
M.run_fields = qwen2_moe.moe.run_fields

function M.finish(cfg)
  mistral.finish(cfg)
  cfg.family = M.name
  -- Mixtral's experts are intermediate_size wide, on every layer.
  cfg.n_expert_hidden, cfg.sparse_step, cfg.mlp_only_layers = cfg.n_hidden, 1, {}
  cfg.norm_topk_prob = true
  moe.check(cfg)
  return cfg
end

M.config = llama.sizes(M)

-------------------------------------------------------------------- model

local names = mistral.description.names
M.description = llama.derive(mistral.description, {
  names = llama.derive(names, { block = llama.derive(names.block, { mlp = "block_sparse_moe" }) }),
  mlp = function(cfg, i) return moe.mlp(cfg, i, M.description.expert_names) end,
  router_aux = moe.router_aux,
  expert_names = { "w1", "w3", "w2" },
})
-- LoRA's targets as Qwen2-MoE's (the attention projections, the experts
-- where asked); by default q_proj and v_proj, PEFT 0.21.2's default for
-- mixtral. The router stays frozen. transformers 5.x names the block mlp,
-- which PEFT's adapter names follow.
M.description.lora_targets = qwen2_moe.description.lora_targets
M.description.lora_default = { "q_proj", "v_proj" }
M.description.lora_peft_paths = { { "block_sparse_moe", "mlp" } }

local Mixtral = nn.CausalLM:extend("Mixtral")
M.Mixtral = Mixtral

function M.new(cfg) return Mixtral:new(M.description, cfg) end

----------------------------------------------------------- Hugging Face

local function config_json(cfg)
  local j = mistral.hf.config_json(cfg)
  j.architectures, j.model_type = { "MixtralForCausalLM" }, "mixtral"
  j.num_local_experts, j.num_experts_per_tok = cfg.n_experts, cfg.top_k
  j.output_router_logits, j.router_aux_loss_coef = cfg.router_logits, cfg.aux_coef
  j.router_jitter_noise = cfg.jitter
  return j
end

-- Mistral's fields, but MixtralConfig's sliding_window defaults to none.
local fields_but_window = {}
for _, e in ipairs(mistral.hf.fields) do
  if e[2] == "sliding_window" then
    e = { "window", "sliding_window", "int", default = 0, if_null = 0 }
  end
  fields_but_window[#fields_but_window + 1] = e
end

-- (MixtralConfig's defaults)
local routing = moe.fields({ top_k = 2, aux_coef = 0.001 })

M.hf = {
  architectures = { "MixtralForCausalLM" }, model_type = "mixtral",
  fields = qwen2.with_fields(fields_but_window, qwen2.with_fields(routing, {
    { "n_experts", "num_local_experts", "int", default = 8 },
    { "jitter", "router_jitter_noise", "number", default = 0 },
  })),
  lr_of = "mixtral-8x7b",
  -- written as floats (MixtralConfig checks their type)
  float_keys = { "router_jitter_noise", "router_aux_loss_coef" },
  config_json = config_json,
  vocab_tables = llama.hf.vocab_tables,
  ignored = llama.hf.ignored,
  head = llama.hf.head,
  tied = llama.hf.tied,
}

return M
