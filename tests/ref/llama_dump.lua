-- tests/ref/llama_dump.lua — the luazero side of the Llama reference test
-- (tests/ref/test_llama_model.py): a tiny Llama (grouped-query attention,
-- rotary embeddings) through tests/ref/model_dump.lua (the engine at stage
-- 0, one forward and backward, 10 AdamW steps).
--   luazero tests/ref/llama_dump.lua OUT_DIR [f32|bf16] [plain|llama3|tied]
-- llama3: rope_scaling llama3 (factor 8, low 1, high 4, original 64
-- positions: head_dim 16's frequencies fall in all three bands); tied: the
-- LM head tied to the embedding.
-- OUT_DIR/: meta.json (config, parameter table, batches, hyperparameters,
-- loss and step losses), params0.f32, tokens.i32, logits.f32, grads.f32,
-- params10.f32 (raw little-endian arrays).
local lz = require("luazero")
local llama = require("models.llama")

local out = assert(arg[1], "usage: luazero tests/ref/llama_dump.lua OUT_DIR [f32|bf16] " ..
                           "[plain|llama3|tied]")
local dtype, variant = arg[2] or "f32", arg[3] or "plain"

-- vocab 250 pads to 256: the padded rows and columns take part.
local overrides = { n_layer = 2, n_head = 4, n_kv_head = 2, n_embd = 64, n_hidden = 176,
                    context = 32, vocab = 250, eps = 1e-5, rope_theta = 10000 }
if variant == "llama3" then
  overrides.rope_scaling = { rope_type = "llama3", factor = 8, low_freq_factor = 1,
                             high_freq_factor = 4, original_max_position_embeddings = 64 }
elseif variant == "tied" then
  overrides.tie = true
end
local cfg = llama.config("llama-tiny", overrides)
dofile(lz.root .. "/tests/ref/model_dump.lua"){
  out = out, name = "llama_dump", vocab = cfg.vocab,
  new_model = function() return llama.new(cfg) end,
  config = { bf16 = { enabled = dtype == "bf16" } },
  meta = {
    config = { n_layer = cfg.n_layer, n_head = cfg.n_head, n_kv_head = cfg.n_kv_head,
               n_embd = cfg.n_embd, n_hidden = cfg.n_hidden, head_dim = cfg.head_dim,
               context = cfg.context, vocab = cfg.vocab, padded_vocab = cfg.padded_vocab,
               eps = cfg.eps, rope_theta = cfg.rope_theta, rope_scaling = cfg.rope_scaling,
               tie = cfg.tie },
    dtype = dtype, inv_freq = llama.inv_freq(cfg),
  },
}
