-- zero/store/device.lua — the compute device's memory (offload "none"): the
-- states are tensors on the device, under their own ledger category; the
-- kernels update them where they are, so a step moves nothing through it.
local lz = require("luazero")

local function nothing() return nil end

return {
  name = "device", config = "none", memory = "device", on_device = true, resident = true,
  allocate = function(shape, dtype, category, compute)
    return lz.tensor(shape, dtype, category, compute)
  end,
  read_group = nothing, write_group = nothing,
  bytes_per_step = function() return 0, 0 end,
}
