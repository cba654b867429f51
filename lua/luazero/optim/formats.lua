-- optim/formats.lua — the formats an optimizer's per-element state and its
-- fp32/bf16 master can be kept in (DESIGN.md decision 9: one table, read by
-- the optimizer table's declarations, the plan's and the estimator's byte
-- counts, and a checkpoint's manifest):
--   f32   4 bytes an element
--   bf16  2 bytes, rounded to nearest even from the fp32 update
--   u8    1 byte, an index into a 256-entry map (bitsandbytes' block-wise
--         8-bit code: optim/quant8.c), times one f32 absmax per block of
--         256 elements (lz_adamw8bit_blocks)
-- A state names its format; the master's is f32 or bf16.
--
--   local formats = require("luazero.optim.formats")
--   formats.bytes("u8", 4096)          -- 4096 + 16 * 4
--   formats.per_element("u8")          -- 1.015625
local M = {}

local BLOCK = 256 -- core/luazero.h's LZ_ADAMW8BIT_BLOCK

-- name -> { dtype (of the elements), bytes (per element), block (elements
-- per f32 scale; nil: none), master (may hold the master weights) }
M.by_name = {
  f32 = { name = "f32", dtype = "f32", bytes = 4, master = true },
  bf16 = { name = "bf16", dtype = "bf16", bytes = 2, master = true },
  u8 = { name = "u8", dtype = "u8", bytes = 1, block = BLOCK, scale_dtype = "f32" },
}
M.names = { "f32", "bf16", "u8" }
M.default = "f32"

local function get(name, what)
  local f = M.by_name[name]
  if not f then
    error(("optim: %s format %s is not one luazero has (it has %s)"):format(
      what or "state", tostring(name), table.concat(M.names, ", ")), 0)
  end
  return f
end
M.get = get

-- Bytes of n elements in a format: the elements, and one f32 scale per
-- (started) block where the format has them.
function M.bytes(name, n)
  local f = get(name)
  local b = n * f.bytes
  if f.block then b = b + math.ceil(n / f.block) * 4 end
  return b
end

-- Bytes per element, scales included (the estimator's rate).
function M.per_element(name)
  local f = get(name)
  return f.bytes + (f.block and 4 / f.block or 0)
end

-- The largest block of the formats in fmts (state name -> format name):
-- the granularity a layout must give each tensor's start and each shard
-- boundary so that no block straddles two tensors or two ranks; nil when
-- no format has blocks.
function M.block_of(fmts)
  local b
  for _, name in pairs(fmts or {}) do
    local f = get(name)
    if f.block and (not b or f.block > b) then b = f.block end
  end
  return b
end

-- The format of the master weights, checked: f32 or bf16.
function M.master(name)
  local f = get(name or M.default, "master")
  if not f.master then
    error(("optim: the master weights cannot be kept in %s (only %s)"):format(
      f.name, "f32 or bf16"), 0)
  end
  return f
end

return M
