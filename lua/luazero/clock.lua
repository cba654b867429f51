-- clock.lua — wall-clock time in seconds (CLOCK_MONOTONIC; unix(): the
-- epoch's, for logs). os.clock is CPU time of all threads, useless for
-- throughput.
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

-- Seconds since the epoch (CLOCK_REALTIME): when something happened, for logs.
function M.unix()
  ffi.C.clock_gettime(0, ts)
  return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
end

-- A duration for people: 42s, 12m04s, 3h05m.
function M.span(s)
  s = math.max(0, math.floor(s + 0.5))
  if s < 60 then return ("%ds"):format(s) end
  if s < 3600 then return ("%dm%02ds"):format(math.floor(s / 60), s % 60) end
  return ("%dh%02dm"):format(math.floor(s / 3600), math.floor(s % 3600 / 60))
end

-- Waits `s` seconds.
function M.sleep(s) ffi.C.usleep(math.floor(s * 1e6)) end

return M
