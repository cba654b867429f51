-- zero/pool.lua — reusable communication buffers (category comm): gradient
-- staging for reduce-scatter and stage-3 gather targets. A buffer returned
-- with put() is handed out again for the same size and dtype, so the hot
-- loop allocates only until it reaches its high-water mark, which the
-- ledger then shows as comm bytes.
local lz = require("luazero")

local Pool = {}
Pool.__index = Pool

function Pool.new() return setmetatable({ free_lists = {}, all = {} }, Pool) end

-- A tensor of n elements of dtype (contents undefined).
function Pool:get(n, dtype)
  local key = dtype .. ":" .. n
  local list = self.free_lists[key]
  if list and #list > 0 then return table.remove(list) end
  local t = lz.tensor({ n }, dtype, "comm")
  self.all[#self.all + 1] = t
  return t
end

function Pool:put(t)
  local key = t:dtype_name() .. ":" .. t:numel()
  local list = self.free_lists[key] or {}
  self.free_lists[key] = list
  list[#list + 1] = t
end

function Pool:free()
  for _, t in ipairs(self.all) do t:free() end
  self.all, self.free_lists = {}, {}
end

return Pool
