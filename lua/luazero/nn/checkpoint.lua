-- nn/checkpoint.lua — where activation checkpointing keeps the inputs of
-- checkpointed modules from their forward until their backward replays it
-- (DeepSpeed's activation_checkpointing block; docs/training.md).
--
--   local store = checkpoint.store(opts, n, bytes, arena)
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
--
-- opts is the activation_checkpointing settings (luazero.config's normalised
-- block, which owns the defaults); a key it lacks is off, as each of
-- DeepSpeed's defaults is.
local lz = require("luazero")

local M = {}

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

-- Where n kept inputs of `bytes` each (arena bytes of the largest) go:
-- the bytes of a buffer of their own and its ledger category, or the bytes
-- they add to the model's arena and no category (the default placement).
function M.store_bytes(opts, n, bytes)
  if opts.contiguous_memory_optimization then
    return (opts.number_checkpoints or n) * bytes,
           opts.cpu_checkpointing and "offload" or "activations"
  end
  if opts.cpu_checkpointing then return n * bytes, "offload" end
  return n * bytes, nil
end

-- n: the modules checkpointed in one forward; bytes: the arena bytes of the
-- largest kept input (f32); arena: the model's activation arena (reset each
-- forward), for the default placement; device: the model's ("cpu").
function M.store(opts, n, bytes, arena, device)
  device = device or "cpu"
  local self = setmetatable({ n = n, slots = {}, owned = {} }, Store)
  -- cpu_checkpointing: on the CPU the host is the device, so the copy is the
  -- same memcpy into host memory counted as offload. A CUDA device puts this
  -- buffer in pinned host memory and copies each input back into device
  -- memory in kept(i), just before its recompute.
  local total, category = M.store_bytes(opts, n, bytes)
  self.category = category or "activations"
  -- Beside a device, cpu_checkpointing keeps the inputs in host memory and
  -- copies each one back into a landing buffer on the device before its
  -- replay; the landing buffer is also the input of the forward that kept it.
  local on_host = opts.cpu_checkpointing and device ~= "cpu"
  if on_host then self.landing = lz.tensor({ bytes / 4 }, "f32", "activations", device) end
  if opts.contiguous_memory_optimization then
    M.check(opts, n)
    self.capacity = opts.number_checkpoints or n
    self.buffer = lz.tensor({ total / 4 }, "f32", category, not on_host and device or nil)
    self.arena = lz.arena_over(self.buffer, 0, total)
    self.owned[#self.owned + 1] = self.arena
  elseif category then
    self.arena = lz.arena(total, category)
    self.owned[#self.owned + 1] = self.arena
  else
    self.arena = arena
  end
  -- Bytes this store adds to the model's arena (the default placement).
  self.arena_bytes = category and 0 or total
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
  if self.landing then return self.landing:view(0, x:sizes()):copy(x) end
  return t
end

function Store:kept(i)
  local t = assert(self.slots[i], "checkpoint: no kept input for this module; run forward first")
  if self.landing then return self.landing:view(0, t:sizes()):copy(t) end
  return t
end

function Store:free()
  for _, a in ipairs(self.owned) do a:free() end
  if self.buffer then self.buffer:free() end
  if self.landing then self.landing:free(); self.landing = nil end
  self.owned, self.buffer, self.arena, self.slots = {}, nil, nil, {}
end

return M
