-- models/qwen3_moe.lua — the Qwen3-MoE family as Hugging Face's
-- Qwen3MoeForCausalLM defines it: Qwen3's layer (models/qwen3.lua: QK-norm
-- over each head, no attention biases, an explicit head_dim) whose MLP is a
-- sparse MoE block (nn/moe.lua) without a shared expert, on the layers
-- decoder_sparse_step picks and mlp_only_layers leaves out;
-- norm_topk_prob as the config says (true in Qwen3-30B-A3B, false by
-- transformers' default).
--
-- Parameter names as the Hub's checkpoints hold them: Qwen3's, and on a
-- sparse layer model.layers.N.mlp.gate.weight and
-- mlp.experts.M.{gate,up,down}_proj.weight.
local nn = require("luazero.nn")
local llama = require("models.llama")
local qwen2 = require("models.qwen2")
local qwen3 = require("models.qwen3")
local qwen2_moe = require("models.qwen2_moe")

local moe = qwen2_moe.moe
local M = { name = "qwen3_moe" }

------------------------------------------------------------------ configs

-- lr: a learning rate that trains the size well, used when --lr is not given.
M.configs = {
  -- for tests: 8 experts, 3 a token, renormalised, head_dim 32 over 4 heads
  ["qwen3-moe-tiny"] = { n_layer = 2, n_head = 4, n_kv_head = 2, head_dim = 32, n_embd = 64,
                         n_hidden = 176, context = 256, vocab = 256, eps = 1e-6,
                         rope_theta = 1000000, tie = false, n_experts = 8, top_k = 3,
                         n_expert_hidden = 32, sparse_step = 1, norm_topk_prob = true,
                         router_logits = true, aux_coef = 0.001, lr = 3e-3 },
  -- Qwen/Qwen3-30B-A3B's config.json
  ["qwen3-30b-a3b"] = { n_layer = 48, n_head = 32, n_kv_head = 4, head_dim = 128, n_embd = 2048,
                        n_hidden = 6144, context = 40960, vocab = 151936, eps = 1e-6,
                        rope_theta = 1000000, tie = false, n_experts = 128, top_k = 8,
                        n_expert_hidden = 768, sparse_step = 1, norm_topk_prob = true,
                        router_logits = false, aux_coef = 0.001, lr = 3e-4 },
}
M.names = { "qwen3-moe-tiny", "qwen3-30b-a3b" }
M.run_fields = qwen2_moe.moe.run_fields

function M.finish(cfg)
  if cfg.rope_scaling then
    error("rope_scaling is not implemented for qwen3_moe; only the default rotary embedding is", 0)
  end
  llama.finish(cfg)
  qwen2.check_windows(cfg)
  cfg.family = M.name
  moe.check(cfg)
  return cfg
end

M.config = llama.sizes(M)

-------------------------------------------------------------------- model

M.description = llama.derive(qwen2_moe.description, {
  attention = function(cfg, shared)
    return nn.GQA.new(cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim, shared.rope, cfg.std,
                      { qk_norm = { eps = cfg.eps, offset = 0 } })
  end,
})

-- LoRA on the attention projections (the lora_targets of
-- models/qwen2_moe.lua): q_proj and v_proj by default, as PEFT 0.21.2's for
-- qwen3 (it has none for qwen3_moe); the router and the experts stay frozen.
M.description.lora_default = { "q_proj", "v_proj" }

local Qwen3Moe = nn.CausalLM:extend("Qwen3Moe")
M.Qwen3Moe = Qwen3Moe

function M.new(cfg) return Qwen3Moe:new(M.description, cfg) end

----------------------------------------------------------- Hugging Face

local function config_json(cfg)
  local j = qwen3.hf.config_json(cfg)
  j.architectures, j.model_type = { "Qwen3MoeForCausalLM" }, "qwen3_moe"
  j.layer_types, j.max_window_layers = nil, nil
  return moe.qwen_json(j, cfg)
end

-- (Qwen3MoeConfig's defaults)
local routing = moe.fields({ top_k = 8, aux_coef = 0.001 })

M.hf = {
  architectures = { "Qwen3MoeForCausalLM" }, model_type = "qwen3_moe",
  fields = qwen2.with_fields(qwen2.with_fields(qwen2.common_fields("qwen3_moe"), routing),
    qwen2.with_fields(moe.qwen_fields, {
      { "head_dim", "head_dim", "int", default = 128 },
      { false, "attention_bias", "bool", default = false, allowed = { false },
        refusal = "luazero's Qwen3-MoE has no attention biases" },
    })),
  lr_of = "qwen3-30b-a3b",
  float_keys = { "router_aux_loss_coef" },
  config_json = config_json,
  vocab_tables = llama.hf.vocab_tables,
  ignored = llama.hf.ignored,
  head = llama.hf.head,
  tied = llama.hf.tied,
}

return M
