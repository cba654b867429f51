-- scripts/examples/schedule.lua — a schedule written as a script: the
-- learning rate is a Lua function of the step, and a callback every few
-- steps looks at the validation loss and halves it when the loss stops
-- falling (what a fixed scheduler in a config file cannot say).
--   luazero scripts/examples/schedule.lua corpus.txt [steps]
local config = require("luazero.config")
local data = require("luazero.data")
local zero = require("luazero.zero")
local models = require("models.registry")

local path, steps = arg[1], tonumber(arg[2] or "30")
assert(path and steps and steps >= 1 and steps % 1 == 0,
       "usage: luazero -m examples/schedule corpus.txt [steps] (steps: a whole number >= 1, default 30)")
local mcfg = models.config("llama-tiny", { context = 64 })
local B, T, check_every = 4, 32, 5

-- The learning rate the engine asks for at each optimizer step: a linear
-- warmup to `peak`, then `peak`, which the callback below may lower.
local peak, warmup = 2e-2, 5
local function lr(step)
  if step <= warmup then return peak * step / warmup end
  return peak
end

local ds = config.load({ train_micro_batch_size_per_gpu = B })
local engine = zero.initialize{ model = models.new(mcfg), config = ds, seed = 3,
                                batch = { B, T }, lr = lr }
local corpus = data.load(path)
local loader = data.loader(corpus, { B = B, T = T, seed = 3, vocab = mcfg.vocab })
local n_val = math.min(2, loader.val_batches)

-- The callback: after every `check_every` steps, the validation loss; less
-- than 10% below the best so far halves the peak.
local best = math.huge
local function on_check(step)
  local val = engine:evaluate(loader, n_val)
  if val > 0.9 * best then peak = peak / 2 end
  best = math.min(best, val)
  print(("step %d val_loss %.4f best %.4f peak lr now %.2e"):format(step, val, best, peak))
end

for step = 1, steps do
  local r = engine:train_batch(loader)
  print(("step %d loss %.4f lr %.2e"):format(step, r.loss, r.lr))
  if step % check_every == 0 then on_check(step) end
end
print("params_checksum " .. engine:params_checksum())
engine:free(); loader:free(); data.free(corpus)
