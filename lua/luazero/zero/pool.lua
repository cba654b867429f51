-- zero/pool.lua — reusable communication buffers (category comm): gradient
-- staging for reduce-scatter and stage-3 gather targets. A buffer returned
-- with put() is handed out again for the same size and dtype, so the hot
-- loop allocates only until it reaches its high-water mark, which the
-- ledger then shows as comm bytes.
local lz = require("luazero")

local Pool = {}
Pool.__index = Pool

local esize = require("luazero.zero.plan").esize

-- device: where the buffers live ("cpu" default, "sim", "cuda"); host
-- buffers beside an accelerator (device "pinned") are pinned, category offload.
function Pool.new(device)
  -- held: bytes of every buffer made; idle: those put back, oldest first
  -- (kept only under a cap).
  return setmetatable({ free_lists = {}, all = {}, idle = {}, held = 0, device = device or "cpu" },
                      Pool)
end

-- Idle buffers are kept while all the pool holds stays within cap bytes
-- (nil: no limit); past it, a miss first frees idle ones, oldest first.
function Pool:set_cap(bytes) self.cap = bytes end

local function trim(self, need)
  local freed = false
  while self.cap and self.held + need > self.cap and #self.idle > 0 do
    local t = table.remove(self.idle, 1)
    local list = self.free_lists[t:dtype_name() .. ":" .. t:numel()]
    for i = #list, 1, -1 do if list[i] == t then table.remove(list, i) end end
    for i = #self.all, 1, -1 do if self.all[i] == t then table.remove(self.all, i) end end
    self.held = self.held - t:bytes()
    t:free()
    freed = true
  end
  -- A buffer's memory goes when its last view does: views the engine
  -- dropped are collected now rather than whenever the GC gets to them.
  if freed then collectgarbage() end
end

local function unidle(self, t)
  for i = #self.idle, 1, -1 do
    if self.idle[i] == t then table.remove(self.idle, i); return end
  end
end

-- A tensor of n elements of dtype (contents undefined).
function Pool:get(n, dtype)
  local key = dtype .. ":" .. n
  local list = self.free_lists[key]
  if list and #list > 0 then
    local t = table.remove(list)
    if self.cap then unidle(self, t) end
    return t
  end
  local t
  if self.device == "pinned" then t = lz.pinned({ n }, dtype)
  else
    if self.cap then trim(self, n * esize[dtype]) end
    t = lz.tensor({ n }, dtype, "comm", self.device)
  end
  self.all[#self.all + 1] = t
  self.held = self.held + t:bytes()
  return t
end

function Pool:put(t)
  local key = t:dtype_name() .. ":" .. t:numel()
  local list = self.free_lists[key] or {}
  self.free_lists[key] = list
  list[#list + 1] = t
  if self.cap then self.idle[#self.idle + 1] = t end
end

function Pool:free()
  for _, t in ipairs(self.all) do t:free() end
  self.all, self.free_lists, self.idle, self.held = {}, {}, {}, 0
end

return Pool
