-- models/olmoe.lua — the OLMoE family as Hugging Face's OlmoeForCausalLM
-- defines it: Llama's layer with QK-norm over the whole q and k projections
-- (not per head; QKNorm.whole in nn/qk_norm.lua), q, k and v clamped to [-clip_qkv,
-- clip_qkv] where clip_qkv is set, and a sparse MoE block (nn/moe.lua) on
-- every layer: num_experts SwiGLU experts of intermediate_size,
-- num_experts_per_tok a token, norm_topk_prob as the config says (false in
-- OLMoE-1B-7B), no shared expert.
--
-- Parameter names as the Hub's checkpoints hold them: Llama's, with
-- model.layers.N.self_attn.q_norm.weight [hidden], k_norm.weight
-- [kv heads * head_dim], mlp.gate.weight [E, hidden] and
-- mlp.experts.M.{gate,up,down}_proj.weight.
local nn = require("luazero.nn")
local llama = require("models.llama")
local qwen2 = require("models.qwen2")
local qwen2_moe = require("models.qwen2_moe")

local moe = qwen2_moe.moe
local M = { name = "olmoe" }

------------------------------------------------------------------ configs

-- lr: a learning rate that trains the size well, used when --lr is not given.
M.configs = {
  -- for tests: 8 experts, 3 a token, q, k and v clipped
  ["olmoe-tiny"] = { n_layer = 2, n_head = 4, n_kv_head = 4, n_embd = 64, n_hidden = 32,
                     context = 256, vocab = 256, eps = 1e-5, rope_theta = 10000, tie = false,
                     n_experts = 8, top_k = 3, clip_qkv = 4, router_logits = true,
                     aux_coef = 0.01, lr = 3e-3 },
  -- allenai/OLMoE-1B-7B-0924's config.json
  ["olmoe-1b-7b"] = { n_layer = 16, n_head = 16, n_kv_head = 16, n_embd = 2048, n_hidden = 1024,
                      context = 4096, vocab = 50304, eps = 1e-5, rope_theta = 10000,
                      tie = false, n_experts = 64, top_k = 8, router_logits = false,
                      aux_coef = 0.01, lr = 3e-4 },
}
M.names = { "olmoe-tiny", "olmoe-1b-7b" }
M.run_fields = qwen2_moe.moe.run_fields

function M.finish(cfg)
  if cfg.rope_scaling then
    error("rope_scaling is not implemented for olmoe; only the default rotary embedding is", 0)
  end
  llama.finish(cfg)
  cfg.family = M.name
  if cfg.head_dim * cfg.n_head ~= cfg.n_embd then
    error(("olmoe: head_dim %d x %d heads must be hidden_size %d (q_norm spans hidden_size)")
          :format(cfg.head_dim, cfg.n_head, cfg.n_embd), 0)
  end
  -- OLMoE's experts are intermediate_size wide, on every layer.
  cfg.n_expert_hidden, cfg.sparse_step, cfg.mlp_only_layers = cfg.n_hidden, 1, {}
  if cfg.clip_qkv ~= nil and not (type(cfg.clip_qkv) == "number" and cfg.clip_qkv > 0) then
    error(("clip_qkv must be a number > 0, or absent (got %s)"):format(tostring(cfg.clip_qkv)), 0)
  end
  moe.check(cfg)
  return cfg
end

M.config = llama.sizes(M)

-------------------------------------------------------------------- model

M.description = llama.derive(qwen2_moe.description, {
  attention = function(cfg, shared)
    return nn.GQA.new(cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim, shared.rope, cfg.std,
                      { qk_norm_full = { eps = cfg.eps, clip = cfg.clip_qkv } })
  end,
})

-- LoRA on the attention projections (the lora_targets of
-- models/qwen2_moe.lua): q_proj and v_proj by default (PEFT 0.21.2 has no
-- default for olmoe); the router and the experts stay frozen.
M.description.lora_default = { "q_proj", "v_proj" }

local Olmoe = nn.CausalLM:extend("Olmoe")
M.Olmoe = Olmoe

function M.new(cfg) return Olmoe:new(M.description, cfg) end

----------------------------------------------------------- Hugging Face

local cjson = require("cjson")

local function config_json(cfg)
  local j = llama.hf.config_json(cfg)
  j.architectures, j.model_type = { "OlmoeForCausalLM" }, "olmoe"
  j.rope_scaling, j.mlp_bias, j.head_dim = nil, nil, nil
  j.clip_qkv = cfg.clip_qkv or cjson.null
  j.num_experts, j.num_experts_per_tok, j.norm_topk_prob = cfg.n_experts, cfg.top_k,
                                                          cfg.norm_topk_prob
  j.output_router_logits, j.router_aux_loss_coef = cfg.router_logits, cfg.aux_coef
  return j
end

-- (OlmoeConfig's defaults)
local routing = moe.fields({ top_k = 8, aux_coef = 0.01 })

M.hf = {
  architectures = { "OlmoeForCausalLM" }, model_type = "olmoe",
  fields = qwen2.with_fields(qwen2.with_fields(qwen2.common_fields("olmoe"), routing), {
    { "n_experts", "num_experts", "int",
      default = function(_, get) return get("num_local_experts") end },
    { "norm_topk_prob", "norm_topk_prob", "bool", default = false },
    { "clip_qkv", "clip_qkv", "number", optional = true },
    { "pad_id", "pad_token_id", "int", default = 1, null_is_none = true }, -- OlmoeConfig's
    { false, "attention_bias", "bool", default = false, allowed = { false },
      refusal = "luazero's OLMoE has no attention biases" },
  }),
  lr_of = "olmoe-1b-7b",
  float_keys = { "router_aux_loss_coef", "clip_qkv" },
  config_json = config_json,
  vocab_tables = llama.hf.vocab_tables,
  ignored = llama.hf.ignored,
  head = llama.hf.head,
  tied = llama.hf.tied,
}

return M
