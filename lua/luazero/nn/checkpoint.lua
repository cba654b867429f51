-- nn/checkpoint.lua — where activation checkpointing keeps the inputs of
-- checkpointed modules from their forward until their backward replays it
-- (DeepSpeed's activation_checkpointing block; docs/training.md).
--
--   local store = checkpoint.store(opts, n, elems, arena)
--   store:reset()                 -- at the start of each forward
--   local kept = store:keep(i, x) -- a copy of x, the i-th checkpointed input
--   local x = store:kept(i)       -- what the i-th recompute starts from
--   store:free()
--
-- Where the copies live:
--   default                        per-module tensors in the model's activation arena
--   cpu_checkpointing              an arena of its own on the ledger's "offload" category
--   contiguous_memory_optimization one buffer preallocated for number_checkpoints inputs
--                                  (default: n), the kept inputs packed in it in order
-- partition_activations splits each kept input across the model-parallel
-- group; luazero has no model parallelism (that group is each rank alone),
-- so the whole input stays on its rank. It never splits across data-parallel
-- ranks: their activations differ.
local lz = require("luazero")

local M = {}

M.defaults = require("luazero.config").activation_checkpointing_defaults

local ALIGN = 64
local function aligned(bytes) return math.ceil(bytes / ALIGN) * ALIGN end

-- Settings errors that depend on the model: n modules checkpointed per forward.
function M.check(opts, n)
  local slots = opts.number_checkpoints
  if opts.contiguous_memory_optimization and slots and slots < n then
    error(("activation_checkpointing.number_checkpoints is %d but the model checkpoints %d " ..
           "blocks; raise it to %d or leave it null"):format(slots, n, n), 0)
  end
end

local Store = {}
Store.__index = Store

-- opts: the activation_checkpointing settings (nil: the defaults); n: the
-- modules checkpointed in one forward; elems: the most f32 elements of one
-- kept input; arena: the model's activation arena (reset each forward), for
-- the default placement.
function M.store(opts, n, elems, arena)
  opts = opts or M.defaults
  local self = setmetatable({ n = n, slots = {}, owned = {} }, Store)
  -- cpu_checkpointing: on the CPU the host is the device, so the copy is the
  -- same memcpy into host memory counted as offload. A CUDA device puts this
  -- buffer in pinned host memory and copies each input back into device
  -- memory in kept(i), just before its recompute.
  local category = opts.cpu_checkpointing and "offload" or "activations"
  self.category = category
  if opts.contiguous_memory_optimization then
    M.check(opts, n)
    local slots = opts.number_checkpoints or n
    self.capacity = slots
    self.buffer = lz.tensor({ slots * aligned(elems * 4) / 4 }, "f32", category)
    self.arena = lz.arena_over(self.buffer, 0, self.buffer:bytes())
    self.owned[#self.owned + 1] = self.arena
  elseif opts.cpu_checkpointing then
    self.arena = lz.arena(n * aligned(elems * 4), category)
    self.owned[#self.owned + 1] = self.arena
  else
    self.arena = arena
  end
  -- Bytes this store adds to the model's arena (the default placement).
  self.arena_bytes = self.arena == arena and n * aligned(elems * 4) or 0
  return self
end

function Store:reset()
  if self.arena ~= nil and #self.owned > 0 then self.arena:reset() end
  self.count = 0
end

function Store:keep(i, x)
  self.count = self.count + 1
  if self.capacity and self.count > self.capacity then
    error(("activation_checkpointing.number_checkpoints is %d but this forward checkpoints " ..
           "more inputs; raise it or leave it null"):format(self.capacity), 0)
  end
  local t = self.arena:tensor(x:sizes(), "f32")
  t:copy(x)
  self.slots[i] = t
  return t
end

function Store:kept(i)
  return assert(self.slots[i], "checkpoint: no kept input for this module; run forward first")
end

function Store:free()
  for _, a in ipairs(self.owned) do a:free() end
  if self.buffer then self.buffer:free() end
  self.owned, self.buffer, self.arena, self.slots = {}, nil, nil, {}
end

return M
