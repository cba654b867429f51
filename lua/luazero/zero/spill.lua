-- zero/spill.lua — the reduced gradients on NVMe (DeepSpeed's
-- swap_out_gradients), so no gradient buffer the size of the shard lives
-- in host memory when the optimizer's states are on NVMe.
--
-- The gradient file holds this rank's fp32 gradient shard in shard order,
-- cut into the optimizer's sub-groups (zero/offload.lua). During backward
-- each reduced slice is added into the staging buffers of the sub-groups it
-- falls in (read back first on a later micro-step of an accumulation;
-- zeroed on the first); a sub-group whose every element has arrived in this
-- micro-step is written out at once, asynchronously, and its buffer reused.
-- So host memory holds a few sub-groups, whatever the model's size. The
-- optimizer reads each sub-group's gradients with its master and states.
--
-- The gradient norm's partials (one per segment, engine:exchange) are taken
-- from each segment's final slice as it is added, the same bits the
-- resident gradients give.
--
--   local sp = spill.new{ groups = states.groups, G = states.G, nvme_path = p, ... }
--   sp:begin_micro(first)        -- before a backward
--   sp:add(shard_lo, src, add [, collect])  -- add(dst_view, src_view) adds a reduced slice
--   sp:end_micro()               -- after it: every sub-group written
--   sp:finish()                  -- before the optimizer reads the file
local store = require("luazero.zero.store")

local M = {}

local PAGE = 4096
local F32 = 4

local Spill = {}
Spill.__index = Spill

-- opts: groups ({lo, n} in order), G (elements per group, a multiple of
-- 1024), tier (the store kind of the gradient file, zero/store/: "nvme"),
-- nvme_path, aio (swap options), buffers (host f32 tensors of at
-- least G elements to reuse: the optimizer ring's gradient staging),
-- make_buffer (a function returning another one when those are busy).
function M.new(opts)
  local self = setmetatable({ groups = opts.groups, G = opts.G, region = opts.G * F32,
                              idle = {}, extra = {}, make_buffer = opts.make_buffer,
                              open = {}, filled = {}, writing = {}, touched = {},
                              first = true }, Spill)
  for _, b in ipairs(opts.buffers or {}) do self.idle[#self.idle + 1] = b end
  self.swap = store.get(opts.tier).open(opts.nvme_path,
                                                  math.max(PAGE, #self.groups * self.region),
                                                  "grads", opts.aio)
  return self
end

-- The group holding shard element i.
function Spill:group_of(i) return math.floor(i / self.G) + 1 end

-- A buffer for a group: a free one, one whose write has finished (oldest
-- first), or a new one.
function Spill:take()
  local b = table.remove(self.idle)
  if b then return b end
  local w = table.remove(self.writing, 1)
  if w then
    w.req:wait()
    return w.buf
  end
  b = self.make_buffer()
  self.extra[#self.extra + 1] = b
  return b
end

-- Waits for a group's write in flight, if any (before reading it back).
function Spill:settle(k)
  for i, w in ipairs(self.writing) do
    if w.k == k then
      w.req:wait()
      table.remove(self.writing, i)
      self.idle[#self.idle + 1] = w.buf
      return
    end
  end
end

function Spill:begin_micro(first)
  self.first = first
  self.filled = {}
  if first then self.touched = {} end
end

-- Group k's staging, opened for this micro-step: zero on the first
-- micro-step of an accumulation, else what the file holds.
function Spill:opened(k)
  local b = self.open[k]
  if b then return b end
  local g = self.groups[k]
  b = self:take()
  local v = b:view(0, { g.n })
  if self.first then
    v:zero()
  else
    self:settle(k)
    self.swap:read((k - 1) * self.region, b, self.region, false)
  end
  self.open[k] = b
  self.filled[k] = 0
  self.touched[k] = true
  return b
end

function Spill:close(k)
  local b = self.open[k]
  self.open[k] = nil
  local req = self.swap:write((k - 1) * self.region, b, self.region, true)
  self.writing[#self.writing + 1] = { k = k, buf = b, req = req }
end

-- Adds src (this rank's reduced slice starting at shard element lo) into
-- the groups it covers with add(dst, src); collect(dst, off), if given,
-- sees each piece after its add (off: its place in the slice; the slice's
-- final values on the last micro-step) before a group it completed is
-- written out, so a slice spanning many groups holds two at a time.
function Spill:add(lo, src, add, collect)
  local n = src:numel()
  for k = self:group_of(lo), #self.groups do
    local g = self.groups[k]
    local a, b = math.max(lo, g.lo), math.min(lo + n, g.lo + g.n)
    if b <= a then break end
    local dst, piece = self:opened(k):view(a - g.lo, { b - a }), src:view(a - lo, { b - a })
    add(dst, piece)
    if collect then collect(dst, a - lo) end
    dst:free()
    piece:free()
    self.filled[k] = self.filled[k] + (b - a)
    if self.filled[k] == g.n then self:close(k) end
  end
end

-- After a micro-step's backward: the groups still open are written (a
-- segment that got no gradient leaves its elements as they were), and on
-- the first micro-step the groups nothing reached are written as zeros.
function Spill:end_micro()
  for k = 1, #self.groups do
    if self.first and not self.touched[k] then self:opened(k) end
  end
  for k in pairs(self.open) do self:close(k) end
end

-- Every write has landed: the optimizer may read the file.
function Spill:finish()
  for _, w in ipairs(self.writing) do
    w.req:wait()
    self.idle[#self.idle + 1] = w.buf
  end
  self.writing = {}
end

-- The request reading group k's gradients into buf (async).
function Spill:read(k, buf) return self.swap:read((k - 1) * self.region, buf, self.region, true) end

function Spill:io_bytes()
  local s = self.swap:stats()
  return s.bytes_read, s.bytes_written
end

function Spill:staging_bytes()
  local n = 0
  for _, b in ipairs(self.extra) do n = n + b:bytes() end
  return n
end

function Spill:free()
  for _, w in ipairs(self.writing) do pcall(w.req.wait, w.req) end
  self.writing = {}
  for _, b in ipairs(self.extra) do b:free() end
  self.extra, self.idle = {}, {}
  if self.swap then self.swap:close(); self.swap = nil end
end

return M
