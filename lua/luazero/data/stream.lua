-- data/stream.lua — batches from a token stream (a token file or text):
-- windows of T + 1 tokens at random positions, a held-out validation tail,
-- deterministic for a seed.
local ffi = require("ffi")
local bit = require("bit")
local lz = require("luazero")
local rng = require("luazero.rng")
local fail = require("luazero.data.files").fail

local M = {}

local Loader = {}
Loader.__index = Loader

-- A 64-bit state as 16 hex digits and back (checkpoint manifests hold it).
function M.hex_u64(v) return bit.tohex(v, 16) end
function M.u64_hex(hex)
  local v = ffi.new("uint64_t", 0)
  for i = 1, #hex do v = v * 16 + tonumber(hex:sub(i, i), 16) end
  return v
end

-- data: from data.load. opts: B, T, seed, vocab (the model's: every id must be
-- below it; vocab_fixed: what fixes it, for the refusal's words),
-- val_fraction (0.1), rank and world (default 0 and 1): each batch draws
-- world * B windows, the same on every rank, and rank r takes windows
-- r*B+1 .. (r+1)*B, so the global batch does not depend on the world size.
-- The last val_fraction of the tokens is held out; training windows start at
-- random positions of the rest.
function M.loader(data, opts)
  local B, T = opts.B, opts.T
  local path = data.path
  require("luazero.data.files").check_vocab(path, data.max_id, opts.vocab, nil, opts.vocab_fixed,
                                            data.made_with)
  local n = data.count
  local n_val = math.floor(n * (opts.val_fraction or 0.1))
  local n_train = n - n_val
  -- Each window needs T + 1 tokens: T inputs and the T targets shifted by one.
  if n_train < T + 1 then
    fail(path, ("%d tokens: too few for sequences of %d (need at least %d for training); " ..
                "use a longer text or a smaller --seq-len"):format(n, T,
                math.ceil((T + 1) / (1 - (opts.val_fraction or 0.1)))))
  end
  local self = setmetatable({
    data = data, B = B, T = T, n_train = n_train, n_val = n_val,
    ids = data.ids or ffi.cast("uint16_t *", data.tokens.data),
    rng = rng.new(opts.seed or 0, 2),
    rank = opts.rank or 0, world = opts.world or 1,
    inputs = lz.tensor({ B, T }, "i32", "workspace"),
    targets = lz.tensor({ B, T }, "i32", "workspace"),
  }, Loader)
  -- Validation windows: consecutive, non-overlapping, from the held-out part;
  -- a validation batch is world * B of them, rank r's the r-th B (as a
  -- training batch is), so it does not depend on the world size either.
  self.val_batches = math.floor(math.max(n_val - 1, 0) / (self.world * B * T))
  return self
end

local function fill(self, starts)
  local ids, T = self.ids, self.T
  local x = ffi.cast("int32_t *", self.inputs.data)
  local y = ffi.cast("int32_t *", self.targets.data)
  for b = 0, self.B - 1 do
    local s = starts[b + 1]
    for t = 0, T - 1 do
      x[b * T + t] = ids[s + t]
      y[b * T + t] = ids[s + t + 1]
    end
  end
  return self.inputs, self.targets
end

-- The next training batch: inputs, targets (i32 [B, T], reused each call).
function Loader:next_batch()
  local starts, span = {}, self.n_train - self.T
  local first = self.rank * self.B
  for i = 0, self.world * self.B - 1 do
    local s = self.rng:int(span)
    if i >= first and i < first + self.B then starts[i - first + 1] = s end
  end
  return fill(self, starts)
end

-- Validation batch i (1-based, i <= val_batches): this rank's windows of it.
function Loader:val_batch(i)
  require("luazero.data.files").check_val_batch(i, self.val_batches)
  local starts, base = {}, self.n_train + ((i - 1) * self.world + self.rank) * self.B * self.T
  for b = 1, self.B do starts[b] = base + (b - 1) * self.T end
  return fill(self, starts)
end

-- Where the loader is, for a checkpoint's manifest (extra.data), and back.
function Loader:position() return { rng_state = M.hex_u64(self.rng.state[0]) } end

function Loader:set_position(pos)
  require("luazero.data.files").check_position(pos)
  if pos.packing then
    error(("data: the checkpoint was saved training on instruction data (--packing %s); " ..
           "resume with the same --data"):format(pos.packing), 0)
  end
  self.rng.state[0] = M.u64_hex(pos.rng_state)
end

function Loader:free()
  self.inputs:free()
  self.targets:free()
end

return M
