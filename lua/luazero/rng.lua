-- rng.lua — a seeded random number generator in plain LuaJIT (splitmix64 on
-- uint64 cdata), so batches and initial weights depend on --seed only, never
-- on math.random, the C library or the thread count.
local ffi = require("ffi")
local bit = require("bit")

local bxor, rshift = bit.bxor, bit.rshift
local sqrt, log, cos, pi = math.sqrt, math.log, math.cos, math.pi

local Rng = {}
Rng.__index = Rng

local GOLDEN = 0x9E3779B97F4A7C15ULL
local M1, M2 = 0xBF58476D1CE4E5B9ULL, 0x94D049BB133111EBULL
local TWO53 = 2 ^ 53

-- seed: a Lua number or uint64 cdata; stream: an optional number giving
-- independent streams for the same seed (data, init, sampling).
local function new(seed, stream)
  local s = ffi.new("uint64_t[1]")
  s[0] = ffi.cast("uint64_t", seed or 0) * GOLDEN + ffi.cast("uint64_t", stream or 0)
  return setmetatable({ state = s }, Rng)
end

function Rng:u64()
  local s = self.state
  local z = s[0] + GOLDEN
  s[0] = z
  z = bxor(z, rshift(z, 30)) * M1
  z = bxor(z, rshift(z, 27)) * M2
  return bxor(z, rshift(z, 31))
end

-- Uniform in [0, 1) with 53 random bits.
function Rng:uniform()
  return tonumber(rshift(self:u64(), 11)) / TWO53
end

-- Uniform integer in [0, n), n < 2^53.
function Rng:int(n)
  return math.floor(self:uniform() * n)
end

-- Fills a float* with n samples of N(0, std^2) (Box-Muller, both outputs used).
function Rng:fill_normal(ptr, n, std)
  local i = 0
  while i < n do
    local u1 = 1 - self:uniform() -- (0, 1]: log stays finite
    local u2 = self:uniform()
    local r = sqrt(-2 * log(u1)) * std
    ptr[i] = r * cos(2 * pi * u2)
    if i + 1 < n then ptr[i + 1] = r * math.sin(2 * pi * u2) end
    i = i + 2
  end
end

-- A seed keyed by (seed, n), for a family of generators one run's seed
-- keys (one per layer): a whole splitmix64 output, so neighbouring n and
-- neighbouring seeds start far apart (rng.new(seed + 1, s) draws
-- rng.new(seed, s)'s numbers shifted by one).
local function keyed(seed, n)
  return new(seed, n):u64()
end

return { new = new, keyed = keyed }
