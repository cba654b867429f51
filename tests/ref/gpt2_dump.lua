-- tests/ref/gpt2_dump.lua — the luazero side of the GPT-2 reference test
-- (tests/ref/test_gpt2.py): a small GPT-2 through tests/ref/model_dump.lua
-- (the engine at stage 0, one forward and backward, 10 AdamW steps).
--   luazero tests/ref/gpt2_dump.lua OUT_DIR
-- OUT_DIR/: meta.json (config, parameter table, batches, hyperparameters,
-- loss and step losses), params0.f32, tokens.i32, logits.f32, grads.f32,
-- params10.f32 (raw little-endian arrays).
local lz = require("luazero")
local gpt2 = require("models.gpt2")

local out = assert(arg[1], "usage: luazero tests/ref/gpt2_dump.lua OUT_DIR")

-- vocab 250 pads to 256: the padded rows and columns take part.
local cfg = gpt2.config("gpt2-nano", { n_layer = 2, n_head = 4, n_embd = 64, context = 32,
                                       vocab = 250 })
dofile(lz.root .. "/tests/ref/model_dump.lua"){
  out = out, name = "gpt2_dump", vocab = cfg.vocab,
  new_model = function() return gpt2.new(cfg) end,
  meta = { config = { n_layer = cfg.n_layer, n_head = cfg.n_head, n_embd = cfg.n_embd,
                      context = cfg.context, vocab = cfg.vocab, padded_vocab = cfg.padded_vocab } },
}
