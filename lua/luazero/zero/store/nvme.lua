-- zero/store/nvme.lua — swap files on NVMe (offload "nvme"): the states are
-- a file read and written through libaio with O_DIRECT (lz.swap), one
-- region per optimizer sub-group; a step reads every group into a host
-- staging buffer and writes it back (zero/offload.lua's ring).
local lz = require("luazero")

return {
  name = "nvme", config = "nvme", memory = "nvme", on_device = false, resident = false,
  allocate = function()
    error("store: the nvme tier holds no memory buffer; open a swap file on it", 0)
  end,
  open = function(path, bytes, tag, swap_opts) return lz.swap(path, bytes, tag, swap_opts) end,
  -- Sub-group k's region of the states' file, into or out of buf (async).
  read_group = function(states, k, buf)
    return states.swap:read((k - 1) * states.region, buf, states.region, true)
  end,
  write_group = function(states, k, buf)
    return states.swap:write((k - 1) * states.region, buf, states.region, true)
  end,
  bytes_per_step = function(bytes) return bytes, bytes end,
}
