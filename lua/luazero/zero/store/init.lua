-- zero/store/init.lua — the memory tiers, one table: every place a state can
-- live (the compute device's memory, host memory, swap files on NVMe) is a
-- store kind, one file each, registered here under its tier name (the
-- plan's) and its config name (offload_optimizer.device /
-- offload_param.device). The config's check, the plan, the engine, the
-- estimate and the checkpoints ask the kind, never the name.
--
-- A kind is a table:
--   name       the plan's tier ("device", "host", "nvme")
--   config     the value of offload_*.device that selects it ("none", "cpu", "nvme")
--   memory     which of the three memories its bytes occupy: "device",
--              "host" or "nvme" (the estimate's columns, Plan:bytes)
--   on_device  its bytes are the compute device's memory
--   resident   its bytes are memory the engine addresses (views, kernels);
--              false: a file the engine stages sub-groups through
--   allocate(shape, dtype, category, compute) -> tensor   (resident kinds)
--   open(path, bytes, tag, swap_opts) -> file (read/write/stats/close: an
--              lz.swap) (kinds that are not resident)
--   read_group(states, k, buf) -> request|nil, write_group(states, k, buf)
--              -> request|nil: move sub-group k of an optimizer's states
--              (zero/offload.lua) between the kind and buf (the staging
--              buffer; nil for a resident kind, whose bytes are updated
--              where they are)
--   bytes_per_step(bytes) -> read, written: what one optimizer step moves
--              through the kind for states of `bytes` (the estimate's traffic)
--
--   local store = require("luazero.zero.store")
--   local kind = store.get("host"); kind.allocate({ n }, "f32", "optimizer", "cpu")
--   store.register(dofile("my_tier.lua"))   -- a new tier, one file
local M = {}

local by_name, by_config, order = {}, {}, {}

local function quoted_list(list, key)
  local names = {}
  for i, kind in ipairs(list) do names[i] = kind[key] end
  if #names == 1 then return names[1] end
  return table.concat(names, ", ", 1, #names - 1) .. " or " .. names[#names]
end

-- Adds a kind to the table; its names must be new.
function M.register(kind)
  for _, key in ipairs({ "name", "config", "memory" }) do
    if type(kind[key]) ~= "string" then
      error(("store: a store kind needs a string %s (got %s)"):format(key, tostring(kind[key])), 0)
    end
  end
  if by_name[kind.name] or by_config[kind.config] then
    error(("store: tier %s (config %s) is registered already"):format(kind.name, kind.config), 0)
  end
  by_name[kind.name], by_config[kind.config] = kind, kind
  order[#order + 1] = kind
  return kind
end

-- Removes the kind registered under tier `name` (a test's own kind).
function M.unregister(name)
  local kind = by_name[name]
  if not kind then return end
  by_name[name], by_config[kind.config] = nil, nil
  for i, k in ipairs(order) do
    if k == kind then table.remove(order, i) break end
  end
end

-- The kind of tier `name` (a plan's tier).
function M.get(name)
  local kind = by_name[name]
  if not kind then
    error(("store: unknown tier %s (tiers: %s)"):format(tostring(name),
                                                        quoted_list(order, "name")), 0)
  end
  return kind
end

-- The kind an offload_*.device value selects, or nil.
function M.of_config(device) return by_config[device] end

-- The offload_*.device values, for errors: `none, cpu or nvme`; quote:
-- each one in double quotes.
function M.config_names(quote)
  local list = {}
  for i, kind in ipairs(order) do
    list[i] = { config = quote and ('"' .. kind.config .. '"') or kind.config }
  end
  return quoted_list(list, "config")
end

-- The kinds in the order they were registered.
function M.kinds()
  local out = {}
  for i, kind in ipairs(order) do out[i] = kind end
  return out
end

M.register(require("luazero.zero.store.device"))
M.register(require("luazero.zero.store.host"))
M.register(require("luazero.zero.store.nvme"))

return M
