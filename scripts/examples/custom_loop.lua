-- scripts/examples/custom_loop.lua — one's own training loop: forward, a loss
-- term of one's own added in Lua, backward, gradient accumulation, the step,
-- a checkpoint every N steps, and a resume from one.
--   luazero scripts/examples/custom_loop.lua corpus.txt STEPS SAVE_DIR [CHECKPOINT]
local ffi = require("ffi")
local config = require("luazero.config")
local data = require("luazero.data")
local zero = require("luazero.zero")
local models = require("models.registry")

local path, steps, save_dir, resume = arg[1], tonumber(arg[2]), arg[3], arg[4]
assert(path and steps and steps >= 1 and steps % 1 == 0 and save_dir,
       "usage: luazero -m examples/custom_loop corpus.txt STEPS SAVE_DIR [CHECKPOINT] (STEPS: a whole number >= 1)")
local mcfg = models.config("gpt2-nano", { n_layer = 2, n_embd = 64, n_head = 4, context = 32 })
local B, T, accum, every = 4, 32, 2, 3
local ds = config.load({ train_micro_batch_size_per_gpu = B, gradient_accumulation_steps = accum,
                         optimizer = { type = "AdamW", params = { lr = 1e-3 } } })
local engine = zero.initialize{ model = models.new(mcfg), config = ds, seed = 7, batch = { B, T } }
local corpus = data.load(path)
local loader = data.loader(corpus, { B = B, T = T, seed = 7, vocab = mcfg.vocab })

local first = 1
if resume then -- the weights, optimizer states and counters, then where the batches were
  local m = engine:load(resume)
  loader:set_position(m.extra.data)
  first = m.global_steps + 1
end

-- z-loss (PaLM): lambda * logsumexp(logits)^2 per position keeps the logits
-- near zero. Its gradient, lambda * 2z * softmax, joins cross-entropy's in backward.
local lambda, Vp, z_sum = 1e-2, mcfg.padded_vocab, 0
local function z_loss(dlogits, logits, dloss)
  local l, d = ffi.cast("float *", logits.data), ffi.cast("float *", dlogits.data)
  for row = 0, logits:numel() / Vp - 1 do
    local o, max, sum = row * Vp, -math.huge, 0
    for j = 0, mcfg.vocab - 1 do max = math.max(max, l[o + j]) end
    for j = 0, mcfg.vocab - 1 do sum = sum + math.exp(l[o + j] - max) end
    local z = max + math.log(sum)
    z_sum = z_sum + lambda * z * z * dloss * accum -- the term's mean over the step
    local k = dloss * 2 * lambda * z
    for j = 0, mcfg.vocab - 1 do d[o + j] = d[o + j] + k * math.exp(l[o + j] - z) end
  end
end

for step = first, steps do
  z_sum = 0
  repeat -- gradient accumulation: `accum` micro-batches, then the step
    local x, y = loader:next_batch()
    local loss = engine:forward(x, y)
    engine:backward(loss, z_loss)
  until engine:is_gradient_accumulation_boundary()
  local r = engine:step()
  print(("step %d loss %.4f z_loss %.5f lr %.2e"):format(step, r.loss, z_sum / accum, r.lr))
  if step % every == 0 then
    print("saved " .. engine:save(save_dir, { data = loader:position() }))
  end
end
print("params_checksum " .. engine:params_checksum())
engine:free(); loader:free(); data.free(corpus)
