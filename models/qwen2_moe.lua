-- models/qwen2_moe.lua — the Qwen2-MoE family (Qwen1.5-MoE, Qwen2-MoE) as
-- Hugging Face's Qwen2MoeForCausalLM defines it: Qwen2's layer
-- (models/qwen2.lua: q/k/v biases as qkv_bias says) whose MLP is a sparse
-- MoE block (nn/moe.lua) on the layers decoder_sparse_step picks and
-- mlp_only_layers leaves out: num_experts SwiGLU experts of
-- moe_intermediate_size, num_experts_per_tok a token, norm_topk_prob, and a
-- shared expert of shared_expert_intermediate_size behind a sigmoid gate.
-- The other layers keep a dense MLP of intermediate_size.
--
-- Parameter names as the Hub's checkpoints hold them: Qwen2's, and on a
-- sparse layer model.layers.N.mlp.gate.weight [E, hidden],
-- mlp.experts.M.{gate,up,down}_proj.weight, mlp.shared_expert.*_proj.weight,
-- mlp.shared_expert_gate.weight [1, hidden].
--
-- The MoE fields (M.moe) are shared by the MoE families: every routing
-- option is read from the config (norm_topk_prob, decoder_sparse_step,
-- mlp_only_layers, output_router_logits, router_aux_loss_coef).
local cjson = require("cjson")
local nn = require("luazero.nn")
local llama = require("models.llama")
local qwen2 = require("models.qwen2")

local M = { name = "qwen2_moe" }

------------------------------------------------------------ MoE, shared

local moe = {}
M.moe = moe

-- The MoE fields that are the run's settings, not the architecture: a
-- resume may change them (how ZeRO-3 gathers the experts, whether the
-- load-balancing loss joins and its weight, the router's jitter). Every
-- MoE family declares these as its run_fields (luazero/families.lua).
moe.run_fields = { "moe_gather", "router_logits", "aux_coef", "jitter" }

-- The MoE fields of a config: n_experts, top_k, n_expert_hidden (each
-- expert's width), n_shared_hidden (0: no shared expert), norm_topk_prob,
-- sparse_step, mlp_only_layers (0-based, as the file has them),
-- router_logits (output_router_logits: the load-balancing loss joins the
-- loss), aux_coef, jitter; moe_gather, how ZeRO-3 gathers the experts:
-- "block" (default) or "expert" (nn/moe_experts.lua).
function moe.check(cfg)
  for _, k in ipairs({ "n_experts", "top_k", "n_expert_hidden", "sparse_step" }) do
    local v = cfg[k]
    if type(v) ~= "number" or v < 1 or v ~= math.floor(v) then
      error(("%s must be a whole number >= 1 (got %s)"):format(k, tostring(v)), 0)
    end
  end
  if cfg.top_k > cfg.n_experts then
    error(("top_k %d is more than the %d experts (n_experts); set top_k to at most %d")
          :format(cfg.top_k, cfg.n_experts, cfg.n_experts), 0)
  end
  cfg.n_shared_hidden = cfg.n_shared_hidden or 0
  cfg.norm_topk_prob = cfg.norm_topk_prob == true
  cfg.mlp_only_layers = cfg.mlp_only_layers or {}
  cfg.router_logits = cfg.router_logits == true
  cfg.aux_coef = cfg.aux_coef or 0.001
  cfg.jitter = cfg.jitter or 0
  if not (cfg.jitter >= 0 and cfg.jitter < 1) then
    error(("jitter (router_jitter_noise) must be in [0, 1) (got %s)"):format(tostring(cfg.jitter)),
          0)
  end
  cfg.moe_gather = cfg.moe_gather or "block"
  if cfg.moe_gather ~= "block" and cfg.moe_gather ~= "expert" then
    error(("moe_gather must be \"block\" or \"expert\" (got %s)"):format(tostring(cfg.moe_gather)),
          0)
  end
  if cfg.use_sliding_window then
    error(("use_sliding_window is not implemented for %s; set it false"):format(cfg.family), 0)
  end
end

-- Whether layer i (1-based) is sparse: transformers' rule.
function moe.sparse(cfg, i)
  for _, l in ipairs(cfg.mlp_only_layers or {}) do
    if l == i - 1 then return false end
  end
  return i % cfg.sparse_step == 0
end

-- Layer i's MLP: the MoE block where the layer is sparse, else the dense
-- SwiGLU. names: the experts' projections in the checkpoint.
function moe.mlp(cfg, i, names)
  if not moe.sparse(cfg, i) then return nn.SwiGLUMLP.new(cfg.n_embd, cfg.n_hidden, cfg.std) end
  return nn.MoE.new(cfg.n_embd, {
    n_experts = cfg.n_experts, top_k = cfg.top_k, n_hidden = cfg.n_expert_hidden, std = cfg.std,
    norm_topk_prob = cfg.norm_topk_prob, expert_names = names, jitter = cfg.jitter, layer = i,
    shared = cfg.n_shared_hidden > 0 and { n_hidden = cfg.n_shared_hidden } or nil,
    gather = cfg.moe_gather,
  })
end

-- The coefficient the description's router_aux gives (nn/causal_lm.lua).
function moe.router_aux(cfg) return cfg.router_logits and cfg.aux_coef or nil end

-- config.json's routing fields every MoE family has (each names its own
-- expert count and width), with the defaults its transformers config class
-- gives where the file leaves them out: d.top_k (num_experts_per_tok) and
-- d.aux_coef (router_aux_loss_coef).
function moe.fields(d)
  return {
    { "top_k", "num_experts_per_tok", "int", default = d.top_k },
    { "router_logits", "output_router_logits", "bool", default = false },
    { "aux_coef", "router_aux_loss_coef", "number", default = d.aux_coef },
  }
end

-- Qwen-MoE's own: sparse layers, shared expert, renormalisation.
moe.qwen_fields = {
  -- the Hub's files say num_experts; transformers 5.x's Qwen3-MoE writes
  -- num_local_experts
  { "n_experts", "num_experts", "int",
    default = function(_, get) return get("num_local_experts") end },
  { "n_expert_hidden", "moe_intermediate_size", "int" },
  { "norm_topk_prob", "norm_topk_prob", "bool", default = false },
  { "sparse_step", "decoder_sparse_step", "int", default = 1 },
  { "mlp_only_layers", "mlp_only_layers", "object", default = function() return {} end,
    if_null = {},
    read = function(list, fail)
      local out = {}
      for i, v in ipairs(list) do
        if type(v) ~= "number" or v ~= math.floor(v) then
          fail(("field mlp_only_layers[%d] is %s; expected a layer index"):format(i - 1,
               cjson.encode(v)))
        end
        out[i] = v
      end
      return out
    end },
}

-- The MoE fields of config.json for a config (Qwen-MoE's spelling).
function moe.qwen_json(j, cfg)
  j.num_experts, j.num_experts_per_tok = cfg.n_experts, cfg.top_k
  j.moe_intermediate_size, j.norm_topk_prob = cfg.n_expert_hidden, cfg.norm_topk_prob
  j.decoder_sparse_step = cfg.sparse_step
  -- (a checkpoint's manifest keeps no empty list)
  local only = cfg.mlp_only_layers or {}
  j.mlp_only_layers = #only > 0 and only or cjson.empty_array
  j.output_router_logits, j.router_aux_loss_coef = cfg.router_logits, cfg.aux_coef
  return j
end

------------------------------------------------------------------ configs

-- lr: a learning rate that trains the size well, used when --lr is not given.
M.configs = {
  -- for tests: 8 experts, 2 a token, a shared expert, the second layer dense
  ["qwen2-moe-tiny"] = { n_layer = 3, n_head = 4, n_kv_head = 2, n_embd = 64, n_hidden = 176,
                         context = 256, vocab = 256, eps = 1e-6, rope_theta = 1000000,
                         tie = false, n_experts = 8, top_k = 2, n_expert_hidden = 32,
                         n_shared_hidden = 64, sparse_step = 1, mlp_only_layers = { 1 },
                         router_logits = true, aux_coef = 0.001, lr = 3e-3 },
  -- Qwen/Qwen1.5-MoE-A2.7B's config.json
  ["qwen1.5-moe-a2.7b"] = { n_layer = 24, n_head = 16, n_kv_head = 16, n_embd = 2048,
                            n_hidden = 5632, context = 8192, vocab = 151936, eps = 1e-6,
                            rope_theta = 1000000, tie = false, n_experts = 60, top_k = 4,
                            n_expert_hidden = 1408, n_shared_hidden = 5632, sparse_step = 1,
                            norm_topk_prob = false, router_logits = false, aux_coef = 0.001,
                            lr = 3e-4 },
}
M.names = { "qwen2-moe-tiny", "qwen1.5-moe-a2.7b" }
M.run_fields = moe.run_fields

function M.finish(cfg)
  if cfg.rope_scaling then
    error("rope_scaling is not implemented for qwen2_moe; only the default rotary embedding is", 0)
  end
  llama.finish(cfg)
  qwen2.check_windows(cfg)
  cfg.family = M.name
  if cfg.qkv_bias == nil then cfg.qkv_bias = true end
  moe.check(cfg)
  return cfg
end

M.config = llama.sizes(M)

-------------------------------------------------------------------- model

M.description = llama.derive(llama.description, {
  attention = function(cfg, shared)
    return nn.GQA.new(cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim, shared.rope, cfg.std,
                      { bias = cfg.qkv_bias })
  end,
  mlp = function(cfg, i) return moe.mlp(cfg, i, M.description.expert_names) end,
  router_aux = moe.router_aux,
  -- the experts' gate, up and down projections in the checkpoint
  -- (mlp.experts.N.<name>.weight), which --merge-lora folds adapters into
  expert_names = { "gate_proj", "up_proj", "down_proj" },
})
-- LoRA on the attention projections: q_proj and v_proj by default, as PEFT
-- 0.21.2's for qwen2 (it has none for qwen2_moe); on the experts where asked
-- (nn/lora_experts.lua: PEFT's target_parameters over the fused
-- experts.gate_up_proj and experts.down_proj). The router (mlp.gate), the
-- shared expert's gate and the dense layers are no target, so they stay
-- frozen. Mixtral, Qwen3-MoE and OLMoE take this table.
M.description.lora_targets = {
  q_proj = { "self_attn", part = "q_proj" },
  k_proj = { "self_attn", part = "k_proj" },
  v_proj = { "self_attn", part = "v_proj" },
  o_proj = { "self_attn.o_proj" },
  ["experts.gate_up_proj"] = { experts = "gate_up_proj" },
  ["experts.down_proj"] = { experts = "down_proj" },
}
M.description.lora_default = { "q_proj", "v_proj" }

local Qwen2Moe = nn.CausalLM:extend("Qwen2Moe")
M.Qwen2Moe = Qwen2Moe

function M.new(cfg) return Qwen2Moe:new(M.description, cfg) end

----------------------------------------------------------- Hugging Face

local function config_json(cfg)
  local j = qwen2.hf.config_json(cfg)
  j.architectures, j.model_type = { "Qwen2MoeForCausalLM" }, "qwen2_moe"
  j.qkv_bias = cfg.qkv_bias
  j.shared_expert_intermediate_size = cfg.n_shared_hidden
  j.layer_types = nil
  return moe.qwen_json(j, cfg)
end

-- (Qwen2MoeConfig's defaults)
local routing = moe.fields({ top_k = 4, aux_coef = 0.001 })

M.hf = {
  architectures = { "Qwen2MoeForCausalLM" }, model_type = "qwen2_moe",
  fields = qwen2.with_fields(qwen2.with_fields(qwen2.common_fields("qwen2_moe"), routing),
    qwen2.with_fields(moe.qwen_fields, {
      { "n_shared_hidden", "shared_expert_intermediate_size", "int" },
      { "qkv_bias", "qkv_bias", "bool", default = true },
      { "head_dim", "head_dim", "int", optional = true },
    })),
  lr_of = "qwen1.5-moe-a2.7b",
  float_keys = { "router_aux_loss_coef" },
  config_json = config_json,
  vocab_tables = llama.hf.vocab_tables,
  ignored = llama.hf.ignored,
  head = llama.hf.head,
  tied = llama.hf.tied,
}

return M
