-- zero/store/host.lua — host memory (offload "cpu"): tensors counted under
-- the ledger's offload category, pinned beside an accelerator so copies to
-- and from the device run asynchronously. On a CPU rank the host is the
-- compute device: the same bytes, counted as offload. The optimizer updates
-- them where they are, so a step moves nothing through it.
local lz = require("luazero")

local function nothing() return nil end

local M = {
  name = "host", config = "cpu", memory = "host", on_device = false, resident = true,
  read_group = nothing, write_group = nothing,
  bytes_per_step = function() return 0, 0 end,
}

-- (category: the offload category whatever the state; compute: the rank's
-- compute device)
function M.allocate(shape, dtype, _, compute)
  if compute and compute ~= "cpu" then return lz.pinned(shape, dtype) end
  return lz.tensor(shape, dtype, "offload")
end

return M
