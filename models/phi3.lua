-- models/phi3.lua — the Phi-3 family as Hugging Face's Phi3ForCausalLM
-- defines it: Llama's layer (RMSNorm before each branch, rotary embeddings,
-- grouped-query attention, a SwiGLU MLP, no biases) with q, k and v in one
-- tensor (self_attn.qkv_proj: q's rows, then k's, then v's) and gate and up
-- in one (mlp.gate_up_proj: gate's rows, then up's, as Phi3MLP chunks it),
-- a sliding window (sliding_window: a query sees that many keys, its own
-- included, as transformers 5.x masks them), rotary embeddings on the first
-- partial_rotary_factor of each head only, and LongRoPE (rope_scaling or
-- rope_parameters of type longrope, which transformers also reads from
-- "su" and "yarn"): per-frequency short and long factors, the long ones
-- for a forward whose largest position passes
-- original_max_position_embeddings, and an attention factor on cos and sin.
--
--   local phi3 = require("models.phi3")
--   local cfg = phi3.config("phi3-tiny", { n_layer = 4 })
--   local model = phi3.new(cfg)
--
-- Parameter names are Hugging Face's: model.embed_tokens.weight,
-- model.layers.N.input_layernorm.weight, model.layers.N.self_attn.qkv_proj.weight,
-- model.layers.N.self_attn.o_proj.weight, model.layers.N.post_attention_layernorm.weight,
-- model.layers.N.mlp.gate_up_proj.weight, model.layers.N.mlp.down_proj.weight,
-- model.norm.weight, lm_head.weight (absent when tied).
local ffi = require("ffi")
local cjson = require("cjson")
local nn = require("luazero.nn")
local llama = require("models.llama")

local M = { name = "phi3" }

------------------------------------------------------------------ configs

M.configs = {
  -- for tests: GQA, half of each head turning, a window shorter than the context
  ["phi3-tiny"] = { n_layer = 2, n_head = 4, n_kv_head = 2, n_embd = 64, n_hidden = 96,
                    context = 256, vocab = 256, eps = 1e-5, rope_theta = 10000, tie = false,
                    partial_rotary_factor = 0.5, window = 32, lr = 3e-3 },
  -- microsoft/Phi-3-mini-4k-instruct's config.json (transformers 4.40.2)
  ["phi-3-mini"] = { n_layer = 32, n_head = 32, n_kv_head = 32, n_embd = 3072, n_hidden = 8192,
                     context = 4096, vocab = 32064, eps = 1e-5, rope_theta = 10000,
                     tie = false, window = 2047, original_max = 4096, lr = 3e-4 },
}
M.names = { "phi3-tiny", "phi-3-mini" }

local whole = llama.whole

-- A LongRoPE table: its factors, one per turning pair; errors name the key.
local function check_longrope(s, pairs_n)
  for _, k in ipairs({ "short_factor", "long_factor" }) do
    local f = s[k]
    if type(f) ~= "table" or #f ~= pairs_n then
      error(("rope_scaling.%s must be a list of %d numbers (rotary_dim / 2; got %s)")
            :format(k, pairs_n, type(f) == "table" and #f .. " values" or tostring(f)), 0)
    end
    for i, v in ipairs(f) do
      if type(v) ~= "number" or not (v > 0) then
        error(("rope_scaling.%s[%d] must be a number > 0 (got %s)"):format(k, i - 1, tostring(v)),
              0)
      end
    end
  end
  for _, k in ipairs({ "factor", "attention_factor" }) do
    if s[k] ~= nil and (type(s[k]) ~= "number" or not (s[k] > 0)) then
      error(("rope_scaling.%s must be a number > 0 (got %s)"):format(k, tostring(s[k])), 0)
    end
  end
end

-- A complete config from a table of fields (a named size's, or one read
-- from a config.json): Llama's checks and derived sizes (head_dim need not
-- be even: only rotary_dim turns), then the rotary part and the window.
function M.finish(cfg)
  local s = cfg.rope_scaling
  if s and s.original_max_position_embeddings then
    cfg.original_max = cfg.original_max or s.original_max_position_embeddings
    s.original_max_position_embeddings = nil
  end
  llama.shape(cfg, 1e-5)
  cfg.partial_rotary_factor = cfg.partial_rotary_factor or 1
  local prf = cfg.partial_rotary_factor
  if type(prf) ~= "number" or not (prf > 0) then
    error(("partial_rotary_factor must be a number > 0 (got %s)"):format(tostring(prf)), 0)
  end
  -- transformers: int(head_dim * partial_rotary_factor)
  cfg.rotary_dim = math.floor(cfg.head_dim * cfg.partial_rotary_factor)
  if cfg.rotary_dim < 2 or cfg.rotary_dim % 2 ~= 0 or cfg.rotary_dim > cfg.head_dim then
    error(("partial_rotary_factor %g gives %d turning values of a %d-value head; it must give " ..
           "an even number from 2 to head_dim"):format(cfg.partial_rotary_factor, cfg.rotary_dim,
                                                      cfg.head_dim), 0)
  end
  if cfg.window ~= nil then whole(cfg, "window", 1) end
  if cfg.pad_id ~= nil then whole(cfg, "pad_id", 0) end
  cfg.original_max = cfg.original_max or cfg.context
  whole(cfg, "original_max", 1)
  if cfg.rope_scaling then check_longrope(cfg.rope_scaling, cfg.rotary_dim / 2) end
  cfg.family = "phi3"
  return cfg
end

M.config = llama.sizes(M)

------------------------------------------------------- rotary frequencies

local f32 = ffi.new("float[1]")
local function round32(x) f32[0] = x; return f32[0] end

-- The inverse frequencies, rotary_dim / 2 numbers, as transformers 5.x works
-- them out in fp32 (compute_default_rope_parameters, or
-- _compute_longrope_parameters with `factors`): every operation rounded to
-- fp32 as torch does it; theta^e in double, rounded.
local function freqs(cfg, factors)
  local d, theta, out = cfg.rotary_dim, cfg.rope_theta, {}
  for i = 0, d / 2 - 1 do
    local p = round32(theta ^ round32(round32(2 * i) / d))
    if factors then p = round32(round32(factors[i + 1]) * p) end
    out[i + 1] = round32(1 / p)
  end
  return out
end

-- The rope description of a config: { short freqs, long freqs or nil,
-- original_max, scale or nil } (nn/rope.lua). LongRoPE's attention factor,
-- unless the config gives one: sqrt(1 + ln(factor) / ln(original_max)) with
-- factor max_position_embeddings / original_max (or the config's factor),
-- 1 when factor <= 1.
function M.rope(cfg)
  local s = cfg.rope_scaling
  if not s then return { freqs = freqs(cfg) } end
  local scale = s.attention_factor
  if not scale then
    local factor = s.factor or cfg.context / cfg.original_max
    scale = factor <= 1 and 1 or math.sqrt(1 + math.log(factor) / math.log(cfg.original_max))
  end
  return { freqs = freqs(cfg, s.short_factor), long = freqs(cfg, s.long_factor),
           original_max = cfg.original_max, scale = round32(scale) }
end

-------------------------------------------------------------------- model

-- The model as nn.CausalLM builds it, with Hugging Face's names (see the
-- header). Every Linear and the embedding start N(0, initializer_range),
-- RMSNorm weights 1.
M.description = llama.derive(llama.description, {
  shared = function(cfg)
    local r = M.rope(cfg)
    return { rope = nn.Rope.new(r.freqs, r) }
  end,
  attention = function(cfg, shared)
    return nn.GQA.new(cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim, shared.rope, cfg.std,
                      -- a window past the context hides nothing (the 128k files' 262144)
                      { qkv_name = "qkv_proj",
                        window = cfg.window and cfg.window < cfg.context and cfg.window or nil,
                        rotary_dim = cfg.rotary_dim < cfg.head_dim and cfg.rotary_dim or nil })
  end,
  mlp = function(cfg)
    return nn.SwiGLUMLP.new(cfg.n_embd, cfg.n_hidden, cfg.std, { fused = "gate_up_proj" })
  end,
  -- LoRA targets (models/lora.lua): Hugging Face's module names.
  lora_targets = {
    qkv_proj = { "self_attn", part = "qkv_proj" },
    o_proj = { "self_attn.o_proj" },
    gate_up_proj = { "mlp.gate_up_proj" },
    down_proj = { "mlp.down_proj" },
  },
  -- PEFT has no default for phi3; the fused attention projection
  lora_default = { "qkv_proj" },
  -- transformers' Phi3ForCausalLM drops its cache when a sequence first
  -- passes original_max_position_embeddings (LongRoPE's switch to the long
  -- factors) and recomputes the sequence with them
  cache_refill_at = function(cfg) return cfg.original_max end,
})

local Phi3 = nn.CausalLM:extend("Phi3")
M.Phi3 = Phi3

function M.new(cfg) return Phi3:new(M.description, cfg) end

----------------------------------------------------------- Hugging Face

-- LongRoPE's fields of a rope table of config.json (4.x's rope_scaling,
-- 5.x's rope_parameters).
local function read_longrope(s, fail, key)
  local out = {}
  for _, k in ipairs({ "short_factor", "long_factor" }) do
    if type(s[k]) ~= "table" then fail(("field %s.%s is missing"):format(key, k)) end
    out[k] = s[k]
  end
  for _, k in ipairs({ "factor", "attention_factor", "original_max_position_embeddings" }) do
    if s[k] ~= nil and s[k] ~= cjson.null then
      if type(s[k]) ~= "number" then fail(("field %s.%s is not a number"):format(key, k)) end
      out[k] = s[k]
    end
  end
  return out
end

-- A value 5.x writes inside rope_parameters and 4.x at the top.
local function in_rope_parameters(k, default)
  return function(_, get)
    local rp = get("rope_parameters")
    if type(rp) == "table" and type(rp[k]) == "number" then return rp[k] end
    return default
  end
end

-- The config.json (Phi3ForCausalLM) of a config, loadable by transformers
-- 4.x and 5.x (rope_scaling; 5.x reads it into rope_parameters).
local function config_json(cfg)
  local j = llama.config_json_of(cfg, "Phi3ForCausalLM", "phi3")
  j.head_dim = nil
  j.rope_scaling = cjson.null
  if cfg.rope_scaling then
    j.rope_scaling = { type = "longrope", rope_type = "longrope" }
    for k, v in pairs(cfg.rope_scaling) do j.rope_scaling[k] = v end
  end
  j.partial_rotary_factor = cfg.partial_rotary_factor
  j.original_max_position_embeddings = cfg.original_max
  j.sliding_window = cfg.window or cjson.null
  j.attention_bias, j.resid_pdrop, j.embd_pdrop = false, 0, 0
  -- Phi3Config's default (32000) is past a small vocabulary's rows
  j.pad_token_id = cfg.pad_id or cjson.null
  return j
end

-- Llama's fields with Phi-3's: LongRoPE (transformers also reads "su" and
-- "yarn" as it), the rotary part, the window.
M.hf = llama.hf_of({
  architectures = { "Phi3ForCausalLM" }, model_type = "phi3",
  fields = llama.hf_fields("phi3", {
    eps = 1e-5, scalings = { longrope = read_longrope, su = read_longrope, yarn = read_longrope },
    pad = 32000,
  }, {
    { "partial_rotary_factor", "partial_rotary_factor", "number",
      default = in_rope_parameters("partial_rotary_factor", 1) },
    { "original_max", "original_max_position_embeddings", "int",
      default = in_rope_parameters("original_max_position_embeddings", 4096) },
    { "window", "sliding_window", "int", optional = true },
    { false, "hidden_act", "string", default = "silu", allowed = { "silu" } },
    { false, "attention_bias", "bool", default = false, allowed = { false },
      refusal = "luazero's Phi-3 has no biases" },
  }),
  -- the size whose learning rate a config.json's run trains with
  lr_of = "phi-3-mini",
  config_json = config_json,
})

return M
