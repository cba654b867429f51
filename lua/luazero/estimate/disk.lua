-- estimate/disk.lua — the disk's speed behind the estimate's NVMe times:
-- the figure assumed when none is given, or one measured through the
-- engine's own swap files (tools/estimate --measure-disk).
local M = {}

-- The disk's speed when not measured: NOTES.md's fio figures on the
-- development machines (O_DIRECT, 1 MiB blocks, queue depth 8).
M.disk = { read_gbps = 1.9, write_gbps = 1.1, assumed = true }

-- The disk's speed as the engine's swap files see it: `bytes` (256 MiB)
-- written then read through lz.swap (libaio, O_DIRECT where the file
-- system allows it) in 32 MiB requests, two in flight, in a swap file in
-- `dir`. Returns read_gbps, write_gbps (GB/s, 1e9 bytes) and whether the
-- I/O was direct (buffered I/O goes through the page cache: no measure).
function M.measure_disk(dir, bytes, aio)
  local lz = require("luazero")
  local clock = require("luazero.clock")
  bytes = bytes or 2 ^ 28
  local chunk = math.min(2 ^ 25, bytes)
  local n = math.max(1, math.floor(bytes / chunk))
  local made, swap = pcall(lz.swap, dir, n * chunk, "bench", aio)
  if not made then error((tostring(swap):gsub("^[^:]*%.lua:%d+: ", "")), 0) end
  local bufs = { lz.tensor({ chunk / 4 }, "f32", "offload"),
                 lz.tensor({ chunk / 4 }, "f32", "offload") }
  local ok, err = pcall(function()
    for _, b in ipairs(bufs) do b:fill(1) end
    local function pass(op)
      local reqs = {}
      local t0 = clock.now()
      for i = 1, n do
        local slot = (i - 1) % 2 + 1
        if reqs[slot] then reqs[slot]:wait() end
        reqs[slot] = swap[op](swap, (i - 1) * chunk, bufs[slot], chunk, true)
      end
      for _, r in pairs(reqs) do r:wait() end
      return n * chunk / (clock.now() - t0) / 1e9
    end
    local w = pass("write")
    return { read = pass("read"), write = w, direct = swap:stats().direct }
  end)
  for _, b in ipairs(bufs) do b:free() end
  swap:close()
  if not ok then error(err, 0) end
  return err.read, err.write, err.direct
end

return M
