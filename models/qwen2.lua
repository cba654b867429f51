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
-- (rope_parameters, dtype, layer_types).
--
-- Sliding windows as transformers 5.x's Qwen2 applies them: with
-- use_sliding_window, the layers layer_types names "sliding_attention" (or,
-- without layer_types, layer i >= max_window_layers, from 0) attend to their
-- sliding_window latest keys (their own included); every other layer, and
-- every layer without use_sliding_window, to all earlier positions.
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

-- The window checks both Qwen families share: sliding_window (a whole
-- number >= 0, 0 for none), max_window_layers, layer_types (one
-- "full_attention" or "sliding_attention" per layer).
function M.check_windows(cfg)
  cfg.use_sliding_window = cfg.use_sliding_window == true
  cfg.max_window_layers = cfg.max_window_layers or cfg.n_layer
  cfg.sliding_window = cfg.sliding_window or 0
  local w = cfg.sliding_window
  if type(w) ~= "number" or w < 0 or w ~= math.floor(w) then
    error(("sliding_window must be a whole number >= 0, 0 for none (got %s)"):format(tostring(w)),
          0)
  end
  if cfg.layer_types then
    if #cfg.layer_types ~= cfg.n_layer then
      error(("layer_types has %d entries; it must have one per layer (n_layer %d)")
            :format(#cfg.layer_types, cfg.n_layer), 0)
    end
    for i, t in ipairs(cfg.layer_types) do
      if t ~= "full_attention" and t ~= "sliding_attention" then
        error(("layer_types[%d] is %s; expected \"full_attention\" or \"sliding_attention\"")
              :format(i - 1, tostring(t)), 0)
      end
    end
  end
end

-- The window of layer i (1-based), or nil for none.
function M.window_of(cfg, i)
  if not cfg.use_sliding_window or cfg.sliding_window == 0 then return nil end
  local sliding
  if cfg.layer_types then
    sliding = cfg.layer_types[i] == "sliding_attention"
  else
    sliding = i - 1 >= cfg.max_window_layers
  end
  return sliding and cfg.sliding_window or nil
end

-- A complete config: Llama's checks and derived sizes, the windows, the
-- family's name (`family`: Qwen3 finishes here too).
function M.finish(cfg, family)
  family = family or "qwen2"
  if cfg.rope_scaling then
    error(("rope_scaling is not implemented for %s; only the default rotary embedding is")
          :format(family), 0)
  end
  llama.finish(cfg, family)
  M.check_windows(cfg)
  return cfg
end

M.config = llama.sizes(M)

-------------------------------------------------------------------- model

-- Layer i's attention with its window and `opts`, a Qwen family's own.
function M.attention(cfg, shared, i, opts)
  opts.window = M.window_of(cfg, i)
  return nn.GQA.new(cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim, shared.rope, cfg.std,
                    opts)
end

-- Llama's description with a bias on the q|k|v projection and the layer's
-- window.
M.description = llama.derive(llama.description, {
  attention = function(cfg, shared, i) return M.attention(cfg, shared, i, { bias = true }) end,
})

local Qwen2 = nn.CausalLM:extend("Qwen2")
M.Qwen2 = Qwen2

function M.new(cfg) return Qwen2:new(M.description, cfg) end

----------------------------------------------------------- Hugging Face

-- config.json's fields both Qwen families read (Llama's, only the default
-- rope, and the windows), then `more`, each family's own.
function M.hf_fields(family, head_dim, more)
  local list = llama.hf_fields(family, { head_dim = head_dim }, {
    { false, "hidden_act", "string", default = "silu", allowed = { "silu" } },
    { "use_sliding_window", "use_sliding_window", "bool", default = false },
    -- Qwen2Config's default when absent; null: no window
    { "sliding_window", "sliding_window", "int", default = 4096, if_null = 0 },
    -- Qwen2Config's default
    { "max_window_layers", "max_window_layers", "int", default = 28 },
    { "layer_types", "layer_types", "object", optional = true,
      read = function(types, fail)
        local out = {}
        for i, t in ipairs(types) do
          if t ~= "full_attention" and t ~= "sliding_attention" then
            fail(("field layer_types[%d] is %s; expected \"full_attention\" or " ..
                  "\"sliding_attention\""):format(i - 1, cjson.encode(t)))
          end
          out[i] = t
        end
        return out
      end },
  })
  return M.with_fields(list, more or {})
end

-- The Qwen fields alone (head_dim optional), for families that build on
-- them (the MoE ones): hf_fields(family).
function M.common_fields(family) return M.hf_fields(family) end

-- list with more entries appended (a new table); a later entry of the same
-- field wins.
function M.with_fields(list, more)
  local out = {}
  for _, e in ipairs(list) do out[#out + 1] = e end
  for _, e in ipairs(more) do out[#out + 1] = e end
  return out
end

-- The config.json (Qwen2ForCausalLM) of a config, loadable by transformers
-- 4.x and 5.x.
local function config_json(cfg)
  local j = llama.config_json_of(cfg, "Qwen2ForCausalLM", "qwen2")
  j.use_sliding_window = cfg.use_sliding_window == true
  j.sliding_window = cfg.sliding_window > 0 and cfg.sliding_window or cjson.null
  j.max_window_layers = cfg.max_window_layers or cfg.n_layer
  j.layer_types = cfg.layer_types or cjson.null
  return j
end

-- As models/llama.lua's hf, for Qwen2ForCausalLM (Qwen2Attention reads
-- head_dim where a config has one).
M.hf = llama.hf_of({
  architectures = { "Qwen2ForCausalLM" }, model_type = "qwen2",
  fields = M.hf_fields("qwen2"),
  lr_of = "qwen2-100m",
  config_json = config_json,
})

return M
