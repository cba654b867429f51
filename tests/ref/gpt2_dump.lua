-- tests/ref/gpt2_dump.lua — the luazero side of the GPT-2 reference test
-- (tests/ref/test_gpt2.py): builds a small GPT-2, runs one forward and
-- backward and 10 AdamW steps on fixed batches, and writes everything the
-- PyTorch side needs to redo and compare it.
--   luazero tests/ref/gpt2_dump.lua OUT_DIR
-- OUT_DIR/: meta.json (config, parameter table, batches, hyperparameters,
-- loss and step losses), params0.f32, tokens.i32, logits.f32, grads.f32,
-- params10.f32 (raw little-endian arrays).
local ffi = require("ffi")
local cjson = require("cjson")
local lz = require("luazero")
local optim = require("luazero.optim")
local rng = require("luazero.rng")
local Trainer = require("luazero.trainer")
local gpt2 = require("models.gpt2")

local out = assert(arg[1], "usage: luazero tests/ref/gpt2_dump.lua OUT_DIR")

-- vocab 250 pads to 256: the padded rows and columns take part.
local cfg = gpt2.config("gpt2-nano", { n_layer = 2, n_head = 4, n_embd = 64, context = 32,
                                       vocab = 250 })
local B, T, ACCUM, STEPS = 4, 24, 2, 10
local hp = { lr = 3e-3, warmup = 3, min_lr = 3e-4, beta1 = 0.9, beta2 = 0.95, eps = 1e-8,
             weight_decay = 0.1, clip = 1.0 }

local function write(name, ptr, bytes)
  local f = assert(io.open(out .. "/" .. name, "wb"))
  f:write(ffi.string(ptr, bytes))
  f:close()
end

local model = gpt2.new(cfg):allocate():init_weights(7)
model:prepare(B, T)
write("params0.f32", model.params_flat.data, model.params_flat:bytes())

-- STEPS x ACCUM micro-batches; batch k: inputs then targets. Each row is an
-- arithmetic sequence mod vocab (random start and stride), learnable enough
-- that the loss moves within 10 steps.
local n_batches = STEPS * ACCUM
local tokens = lz.tensor({ n_batches, 2, B, T }, "i32")
local r = rng.new(99)
local ids = ffi.cast("int32_t *", tokens.data)
for k = 0, n_batches - 1 do
  for b = 0, B - 1 do
    local start, stride = r:int(cfg.vocab), 1 + r:int(4)
    for t = 0, T - 1 do
      ids[((k * 2) * B + b) * T + t] = (start + t * stride) % cfg.vocab
      ids[((k * 2 + 1) * B + b) * T + t] = (start + (t + 1) * stride) % cfg.vocab
    end
  end
end
write("tokens.i32", tokens.data, tokens:bytes())
local function batch(k) -- 0-based
  return tokens:view(k * 2 * B * T, { B, T }), tokens:view((k * 2 + 1) * B * T, { B, T })
end

-- One forward and backward on batch 0.
model:zero_grad()
local x, y = batch(0)
local loss0, logits = model:forward(x, y)
write("logits.f32", logits.data, logits:bytes())
model:backward(1)
write("grads.f32", model.grads_flat.data, model.grads_flat:bytes())

-- 10 optimizer steps with gradient accumulation over batches 0, 1, 2, ...
local optimizer = optim.AdamW.new(model.params_flat, model.grads_flat, model.param_table, hp)
local next_k = 0
local trainer = Trainer.new({
  model = model, optimizer = optimizer, grad_accum = ACCUM,
  lr = optim.schedule.warmup_cosine(hp.lr, hp.warmup, STEPS, hp.min_lr),
  batches = { next_batch = function() next_k = next_k + 1; return batch(next_k - 1) end },
})
local losses, lrs, norms = {}, {}, {}
for s = 1, STEPS do losses[s], lrs[s], norms[s] = trainer:step() end
write("params10.f32", model.params_flat.data, model.params_flat:bytes())

local params = {}
for i, e in ipairs(model.param_table) do
  params[i] = { name = e.name, shape = e.shape, offset = e.offset, numel = e.numel,
                decay = e.decay }
end
local meta = {
  config = { n_layer = cfg.n_layer, n_head = cfg.n_head, n_embd = cfg.n_embd,
             context = cfg.context, vocab = cfg.vocab, padded_vocab = cfg.padded_vocab },
  params = params, n_params = model.n_params, B = B, T = T, accum = ACCUM, steps = STEPS,
  hp = hp, loss0 = loss0, losses = losses, lrs = lrs, grad_norms = norms,
}
local f = assert(io.open(out .. "/meta.json", "w"))
f:write(cjson.encode(meta))
f:close()
print(("gpt2_dump: %d parameters, loss %.6f, wrote %s"):format(model.n_params, loss0, out))
