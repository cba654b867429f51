-- models/gemma3.lua — Gemma 3's text model as Hugging Face's Gemma3ForCausalLM
-- defines it: Gemma 2's layer (models/gemma2.lua: four norms, GeGLU, 1 + weight
-- norms, scaled embeddings, query_pre_attn_scalar, a tied head) with an
-- RMSNorm over each q and k head before the rotary turn (QK-norm, 1 + weight,
-- nn/qk_norm.lua), and local and global layers: the sliding ones turn by
-- their own RoPE base (rope_local_base_freq, 10000), the full ones by
-- rope_theta (1000000). The final logits are soft-capped where a config sets
-- final_logit_softcapping; attn_logit_softcapping is not read, as
-- transformers 5.23's Gemma3Attention keeps it but never applies it.
--
-- A config.json is read as transformers 4.x writes it (rope_theta,
-- rope_local_base_freq, sliding_window_pattern: every pattern-th layer full)
-- and as 5.x does (layer_types; rope_parameters per layer type).
--
-- Parameter names: Gemma 2's, plus model.layers.N.self_attn.{q,k}_norm.weight.
local cjson = require("cjson")
local nn = require("luazero.nn")
local llama = require("models.llama")
local gemma2 = require("models.gemma2")

local M = { name = "gemma3" }

------------------------------------------------------------------ configs

M.configs = {
  -- for tests: a window that bites at short lengths, two RoPE bases
  ["gemma3-tiny"] = { n_layer = 2, n_head = 4, n_kv_head = 2, n_embd = 64, head_dim = 32,
                      n_hidden = 192, context = 256, vocab = 256, eps = 1e-6,
                      rope_theta = 1000000, rope_local = 10000, tie = true,
                      query_pre_attn_scalar = 32, window = 8, sliding_window_pattern = 2,
                      lr = 3e-3 },
  -- google/gemma-3-1b-pt's config.json
  ["gemma-3-1b"] = { n_layer = 26, n_head = 4, n_kv_head = 1, n_embd = 1152, head_dim = 256,
                     n_hidden = 6912, context = 32768, vocab = 262144, eps = 1e-6,
                     rope_theta = 1000000, rope_local = 10000, tie = true,
                     query_pre_attn_scalar = 256, window = 512, sliding_window_pattern = 6,
                     lr = 3e-4 },
}
M.names = { "gemma3-tiny", "gemma-3-1b" }

function M.finish(cfg)
  cfg.rope_local = cfg.rope_local or 10000
  if type(cfg.rope_local) ~= "number" or not (cfg.rope_local > 0) then
    error(("rope_local must be a number > 0 (got %s)"):format(tostring(cfg.rope_local)), 0)
  end
  cfg.sliding_window_pattern = cfg.sliding_window_pattern or 6
  return gemma2.finish(cfg, "gemma3")
end

M.config = llama.sizes(M)

-------------------------------------------------------------------- model

M.description = llama.derive(gemma2.description, {
  -- The global layers' frequencies and the local ones'.
  shared = function(cfg)
    return { rope = nn.Rope.new(llama.inv_freq(cfg)),
             rope_local = nn.Rope.new(llama.inv_freq({ head_dim = cfg.head_dim,
                                                       rope_theta = cfg.rope_local })) }
  end,
  attention = function(cfg, shared, i)
    local rope = cfg.layer_types[i] == "sliding_attention" and shared.rope_local or shared.rope
    return gemma2.attention(cfg, rope, i, { qk_norm = { eps = cfg.eps, offset = 1 } })
  end,
})

local Gemma3 = nn.CausalLM:extend("Gemma3")
M.Gemma3 = Gemma3

function M.new(cfg) return Gemma3:new(M.description, cfg) end

----------------------------------------------------------- Hugging Face

local function config_json(cfg)
  local j = gemma2.hf.config_json(cfg)
  j.architectures, j.model_type = { "Gemma3ForCausalLM" }, "gemma3_text"
  j.rope_theta = nil
  local full = { rope_type = "default", rope_theta = cfg.rope_theta }
  if type(cfg.rope_scaling) == "table" then -- (linear: Gemma 3 4B and up)
    full = { rope_type = "linear", factor = cfg.rope_scaling.factor, rope_theta = cfg.rope_theta }
  end
  j.rope_parameters = {
    full_attention = full,
    sliding_attention = { rope_type = "default", rope_theta = cfg.rope_local },
  }
  return j
end

-- rope_parameters (5.x) of one layer type: its rope_theta; the default
-- rotary embedding, and on the full layers linear scaling (Gemma 3 4B, 12B
-- and 27B's factor 8; the local layers keep theirs unscaled).
local function theta_of(get, kind, legacy, default, fail)
  local rp = get("rope_parameters")
  local p = type(rp) == "table" and rp[kind]
  if type(p) == "table" then
    local t = p.rope_type or p.type or "default"
    if t ~= "default" and not (t == "linear" and kind == "full_attention") then
      fail(("field rope_parameters.%s.%s is %s; only \"default\"%s is implemented")
           :format(kind, p.rope_type and "rope_type" or "type", cjson.encode(t),
                   kind == "full_attention" and ' or "linear"' or ""))
    end
    if type(p.rope_theta) == "number" then return p.rope_theta end
  end
  return get(legacy) or default
end

-- The full layers' scaling from a rope_scaling (4.x, which scales the
-- global layers only) or rope_parameters.full_attention (5.x) table: false
-- for the default rope, linear's, or refused.
local function scaling_of(p, key, fail)
  local t = p.rope_type or p.type or "default"
  if t == "default" then return false end
  if t ~= "linear" then
    fail(("field %s.%s is %s; only \"default\" or \"linear\" is implemented for gemma3")
         :format(key, p.rope_type and "rope_type" or "type", cjson.encode(t)))
  end
  return llama.read_linear(p, fail, key)
end

-- Gemma 2's fields, the two RoPE bases read per layer type.
local fields = {}
for _, e in ipairs(gemma2.hf_fields("gemma3", {
  { "rope_local", "rope_local_base_freq", "number", default = function(_, get, fail)
      return theta_of(get, "sliding_attention", "rope_local_base_freq", 10000, fail)
    end },
  { "sliding_window_pattern", "sliding_window_pattern", "int", default = 6 },
}, { window = 4096, attn_softcap = false })) do
  if e[1] == "rope_theta" then
    e = { "rope_theta", "rope_theta", "number", default = function(_, get, fail)
            return theta_of(get, "full_attention", "rope_theta", 1000000, fail)
          end }
  elseif e[2] == "rope_parameters" then
    e = { false, "rope_parameters", "object", optional = true }
  elseif e[1] == "rope_scaling" then
    e = { "rope_scaling", "rope_scaling", "object", null_is_none = true,
          read = function(v, fail) return scaling_of(v, "rope_scaling", fail) end,
          default = function(_, get, fail)
            local rp = get("rope_parameters")
            local p = type(rp) == "table" and rp.full_attention
            return type(p) == "table" and scaling_of(p, "rope_parameters.full_attention", fail)
                   or false
          end }
  end
  fields[#fields + 1] = e
end

local float_keys = { "rope_parameters.full_attention.factor" }
for _, k in ipairs(gemma2.hf.float_keys) do float_keys[#float_keys + 1] = k end

M.hf = llama.hf_of({
  architectures = { "Gemma3ForCausalLM" }, model_type = "gemma3_text",
  fields = fields,
  lr_of = "gemma-3-1b",
  config_json = config_json,
  float_keys = float_keys,
})

return M
