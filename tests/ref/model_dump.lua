-- tests/ref/model_dump.lua — what the model reference dumps share (not a
-- test): under the ZeRO engine (stage 0, one rank), one forward and backward
-- and 10 AdamW steps on fixed batches, everything the PyTorch side needs to
-- redo and compare written to a folder.
--   dofile("tests/ref/model_dump.lua"){ out = DIR, name = "gpt2_dump",
--     new_model = function() return gpt2.new(cfg) end, vocab = cfg.vocab,
--     config = { ... }  -- extra engine config keys (bf16 = ...)
--     meta = { config = { ... }, ... } }  -- fields meta.json adds
-- DIR/: meta.json (the given fields, the parameter table, batches,
-- hyperparameters, loss and step losses), params0.f32, tokens.i32,
-- logits.f32, grads.f32, params10.f32 (raw little-endian arrays).
local ffi = require("ffi")
local cjson = require("cjson")
local lz = require("luazero")
local optim = require("luazero.optim")
local rng = require("luazero.rng")
local zero = require("luazero.zero")

local B, T, ACCUM, STEPS = 4, 24, 2, 10
local hp = { lr = 3e-3, warmup = 3, min_lr = 3e-4, beta1 = 0.9, beta2 = 0.95, eps = 1e-8,
             weight_decay = 0.1, clip = 1.0 }

return function(o)
  local out = o.out
  local function write(name, ptr, bytes)
    local f = assert(io.open(out .. "/" .. name, "wb"))
    f:write(ffi.string(ptr, bytes))
    f:close()
  end

  -- The engine's config: hp as DeepSpeed keys; accum micro-batches per step.
  local function engine(accum, lr)
    local config = { train_micro_batch_size_per_gpu = B, gradient_accumulation_steps = accum,
                     gradient_clipping = hp.clip,
                     optimizer = { type = "AdamW",
                                   params = { lr = hp.lr, betas = { hp.beta1, hp.beta2 },
                                              eps = hp.eps, weight_decay = hp.weight_decay } } }
    for k, v in pairs(o.config or {}) do config[k] = v end
    return zero.initialize({ model = o.new_model(), seed = 7, batch = { B, T }, lr = lr,
                             comm = require("luazero.comm").init("local"), config = config })
  end

  -- The engine's gradients (padded segments) in canonical order.
  local function canonical_grads(e)
    local g = lz.tensor({ e.L.numel }, "f32", "workspace")
    for _, seg in ipairs(e.L.segments) do
      g:view(seg.entries[1].offset, { seg.numel }):copy(e.grads:view(seg.full_offset, { seg.numel }))
    end
    return g
  end

  local first = engine(1)
  local params0 = first:master_params()
  write("params0.f32", params0.data, params0:bytes())
  params0:free()

  -- STEPS x ACCUM micro-batches; batch k: inputs then targets. Each row is an
  -- arithmetic sequence mod vocab (random start and stride), learnable enough
  -- that the loss moves within 10 steps.
  local vocab = o.vocab
  local n_batches = STEPS * ACCUM
  local tokens = lz.tensor({ n_batches, 2, B, T }, "i32")
  local r = rng.new(99)
  local ids = ffi.cast("int32_t *", tokens.data)
  for k = 0, n_batches - 1 do
    for b = 0, B - 1 do
      local start, stride = r:int(vocab), 1 + r:int(4)
      for t = 0, T - 1 do
        ids[((k * 2) * B + b) * T + t] = (start + t * stride) % vocab
        ids[((k * 2 + 1) * B + b) * T + t] = (start + (t + 1) * stride) % vocab
      end
    end
  end
  write("tokens.i32", tokens.data, tokens:bytes())
  local function batch(k) -- 0-based
    return tokens:view(k * 2 * B * T, { B, T }), tokens:view((k * 2 + 1) * B * T, { B, T })
  end

  -- One forward and backward on batch 0.
  local x, y = batch(0)
  local loss0 = first:forward(x, y)
  local logits = first.model.logits
  write("logits.f32", logits.data, logits:bytes())
  first:backward(loss0)
  local grads = canonical_grads(first)
  write("grads.f32", grads.data, grads:bytes())
  grads:free()
  first:free()

  -- 10 optimizer steps with gradient accumulation over batches 0, 1, 2, ...
  local next_k = 0
  local trainer = engine(ACCUM, optim.schedule.warmup_cosine(hp.lr, hp.warmup, STEPS, hp.min_lr))
  local batches = { next_batch = function() next_k = next_k + 1; return batch(next_k - 1) end }
  local losses, lrs, norms = {}, {}, {}
  for s = 1, STEPS do
    local rec = trainer:train_batch(batches)
    losses[s], lrs[s], norms[s] = rec.loss, rec.lr, rec.grad_norm
  end
  local params10 = trainer:master_params()
  write("params10.f32", params10.data, params10:bytes())
  params10:free()

  local model = trainer.model
  local params = {}
  for i, e in ipairs(model.param_table) do
    params[i] = { name = e.name, shape = e.shape, offset = e.offset, numel = e.numel,
                  decay = e.decay }
  end
  local meta = { params = params, n_params = model.n_params, B = B, T = T, accum = ACCUM,
                 steps = STEPS, hp = hp, loss0 = loss0, losses = losses, lrs = lrs,
                 grad_norms = norms }
  for k, v in pairs(o.meta) do meta[k] = v end
  local f = assert(io.open(out .. "/meta.json", "w"))
  f:write(cjson.encode(meta))
  f:close()
  print(("%s: %d parameters, loss %.6f, wrote %s"):format(o.name, model.n_params, loss0, out))
end
