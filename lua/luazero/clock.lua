-- clock.lua — wall-clock time in seconds (CLOCK_MONOTONIC). os.clock is CPU
-- time of all threads, useless for throughput.
local ffi = require("ffi")

pcall(ffi.cdef, [[
typedef struct { long tv_sec; long tv_nsec; } lz_clock_timespec;
int clock_gettime(int clk_id, lz_clock_timespec *tp);
]])
pcall(ffi.cdef, "int usleep(unsigned int usec);")

local ts = ffi.new("lz_clock_timespec")
local CLOCK_MONOTONIC = 1

local M = {}

function M.now()
  ffi.C.clock_gettime(CLOCK_MONOTONIC, ts)
  return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
end

-- Waits `s` seconds.
function M.sleep(s) ffi.C.usleep(math.floor(s * 1e6)) end

return M
