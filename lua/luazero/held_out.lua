-- held_out.lua — a whole file as validation data (scripts/train.lua
-- --val-data, scripts/eval.lua): a data.loader whose validation batches walk
-- the file from its first token, in consecutive non-overlapping windows, as
-- they walk the held-out tail of a training file; instruction data holds
-- out all its examples, in file order.
--   local held_out = require("luazero.held_out")
--   local loader = held_out.loader(data.load(path), { B = 8, T = 256, vocab = 256 })
--   for i = 1, loader.val_batches do engine:forward(loader:val_batch(i)) end
local data = require("luazero.data")

local M = {}

-- corpus: data.load's. opts: as data.loader's (B, T, vocab, seed).
function M.loader(corpus, opts)
  local B, T = opts.B, opts.T
  if corpus.kind == "instruct" then
    -- Instruction data: every example is held out, laid into rows (pack or
    -- pad) and masked as training masks it.
    local o = {}
    for k, v in pairs(opts) do o[k] = v end
    o.val_fraction = 1
    local loader = data.loader(corpus, o)
    if loader.val_batches < 1 then
      error(("data: %s: %d examples fill %d rows, too few for one validation batch of %d " ..
             "rows; use a longer file or a smaller --micro-batch"):format(corpus.path,
             corpus.docs, #loader.val_rows - 1, (opts.world or 1) * B), 0)
    end
    return loader
  end
  local W = opts.world or 1
  if corpus.count < W * B * T + 1 then
    error(("data: %s: %d tokens, too few for one validation batch of %d x %d (needs %d); use " ..
           "a longer file or a smaller --micro-batch / --seq-len")
          :format(corpus.path, corpus.count, W * B, T, W * B * T + 1), 0)
  end
  local o = {}
  for k, v in pairs(opts) do o[k] = v end
  o.val_fraction = 0
  local loader = data.loader(corpus, o)
  -- Nothing of it trains: the held-out part is all of it.
  loader.n_train, loader.n_val = 0, corpus.count
  loader.val_batches = math.floor((corpus.count - 1) / (W * B * T))
  return loader
end

return M
