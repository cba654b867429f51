-- models/mistral.lua — the Mistral family as Hugging Face's
-- MistralForCausalLM defines it: Llama's layer (RMSNorm, rotary embeddings,
-- grouped-query attention, SwiGLU, no biases) with sliding-window attention:
-- a query at position t sees the keys t - W < s <= t (`sliding_window` W,
-- its own included, as transformers 5.x masks it; null: all of them).
-- generate.lua's cache then keeps W positions a layer (a ring).
--
--   local mistral = require("models.mistral")
--   local cfg = mistral.config("mistral-tiny", { window = 8 })
--   local model = mistral.new(cfg)
--
-- Parameter names are Llama's (model.layers.N.self_attn.q_proj.weight, ...).
local cjson = require("cjson")
local nn = require("luazero.nn")
local llama = require("models.llama")

local M = { name = "mistral" }

-- window: sliding_window (0: none). lr as Llama's sizes.
M.configs = {
  -- for tests: Llama-tiny's shape with a window shorter than the test sequences
  ["mistral-tiny"] = { n_layer = 2, n_head = 4, n_kv_head = 2, n_embd = 64, n_hidden = 176,
                       context = 256, vocab = 256, eps = 1e-5, rope_theta = 10000, tie = false,
                       window = 8, lr = 3e-3 },
  -- mistralai/Mistral-7B-v0.1's config.json
  ["mistral-7b"] = { n_layer = 32, n_head = 32, n_kv_head = 8, n_embd = 4096, n_hidden = 14336,
                     context = 32768, vocab = 32000, eps = 1e-5, rope_theta = 10000,
                     tie = false, window = 4096, lr = 3e-4 },
}
M.names = { "mistral-tiny", "mistral-7b" }

-- Llama's checks, then the window.
function M.finish(cfg)
  cfg.window = cfg.window or 0
  local w = cfg.window
  if type(w) ~= "number" or w < 0 or w ~= math.floor(w) then
    error(("window must be a whole number >= 0, 0 for none (got %s)"):format(tostring(w)), 0)
  end
  return llama.finish(cfg, M.name)
end

M.config = llama.sizes(M)

-- Llama's description with the window in every layer's attention, and
-- PEFT 0.21.2's default LoRA targets for mistral.
M.description = llama.derive(llama.description, {
  attention = function(cfg, shared)
    local opts = cfg.window > 0 and { window = cfg.window } or nil
    return nn.GQA.new(cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim, shared.rope, cfg.std,
                      opts)
  end,
  lora_default = { "q_proj", "v_proj" },
})

function M.new(cfg) return llama.Llama:new(M.description, cfg) end

----------------------------------------------------------- Hugging Face

local function config_json(cfg)
  local j = llama.config_json_of(cfg, "MistralForCausalLM", "mistral")
  j.sliding_window = cfg.window > 0 and cfg.window or cjson.null
  return j
end

-- As models/llama.lua's hf, for MistralForCausalLM: only the plain rotary
-- embedding.
M.hf = llama.hf_of({
  architectures = { "MistralForCausalLM" }, model_type = "mistral",
  fields = llama.hf_fields("mistral", {}, {
    -- absent: transformers' default 4096; null: none
    { "window", "sliding_window", "int", default = 4096, if_null = 0 },
    { false, "hidden_act", "string", default = "silu", allowed = { "silu" } },
  }),
  lr_of = "mistral-7b",
  config_json = config_json,
})

return M
