-- luazero/data/random.lua — a batch source of uniform random tokens, for the
-- benchmarks and tests that time or profile steps rather than learn: every
-- next_batch() refills one pair of [B, T] i32 tensors from the given rng.
--   local src = require("luazero.data.random").new(B, T, vocab, rng.new(1))
--   engine:train_batch(src); ...; src:free()
local ffi = require("ffi")
local lz = require("luazero")

local M = {}

local Source = {}
Source.__index = Source

function M.new(B, T, vocab, r)
  local x, y = lz.tensor({ B, T }, "i32"), lz.tensor({ B, T }, "i32")
  return setmetatable({ x = x, y = y, n = B * T, vocab = vocab, r = r,
                        px = ffi.cast("int32_t *", x.data), py = ffi.cast("int32_t *", y.data) },
                      Source)
end

function Source:next_batch()
  local px, py, r, vocab = self.px, self.py, self.r, self.vocab
  for i = 0, self.n - 1 do px[i] = r:int(vocab); py[i] = r:int(vocab) end
  return self.x, self.y
end

function Source:free()
  self.x:free()
  self.y:free()
end

return M
