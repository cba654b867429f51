-- checkpoint/lock.lua — one run at a time in a --save folder: the first
-- save (or the start-up check of --save) takes an flock on DIR/.lock and
-- holds it while the process lives; the kernel drops it when the process
-- ends, however it ends (kill -9 included), so a dead run never locks a
-- folder. A second run saving there would set the first's step folders
-- aside as a rewound history and replace them with its own: it is refused,
-- naming the run that holds the folder.
--
--   lock.claim(dir)   -- rank 0, before anything is written in dir
local ffi = require("ffi")

for _, decl in ipairs({ "int open(const char *path, int flags, int mode);",
                        "int flock(int fd, int operation);",
                        "long read(int fd, void *buf, unsigned long n);",
                        "long pwrite(int fd, const void *buf, unsigned long n, int64_t off);",
                        "int ftruncate(int fd, int64_t length);", "int close(int fd);",
                        "int getpid(void);", "char *strerror(int errnum);",
                        "long readlink(const char *path, char *buf, unsigned long n);" }) do
  pcall(ffi.cdef, decl) -- one at a time: another module may have declared some
end

local C = ffi.C
local O_RDWR, O_CREAT, O_CLOEXEC = 2, 64, 524288
local LOCK_EX, LOCK_NB = 2, 4
local EWOULDBLOCK = 11

local M = {}

-- The folders this process holds (real path -> the lock file's descriptor):
-- a second claim of one folder (another engine of the same script, a
-- resumed run saving where it resumed from) is the same run's.
local held = {}

-- (the folder's one spelling: links, "." and ".." resolved)
local function real_path(path) return require("luazero.io.atomic").real_path(path) or path end

-- Whether the lock file held through fd is still dir's .lock (not removed,
-- with its folder, since: then it locks nothing).
local function still_there(fd, dir)
  local buf = ffi.new("char[4096]")
  local n = tonumber(C.readlink(("/proc/self/fd/%d"):format(fd), buf, 4095))
  if n < 0 then return true end -- (no /proc: trust it)
  return ffi.string(buf, n) == real_path(dir) .. "/.lock"
end

-- Drops this process's lock of dir (a refused --save folder about to be
-- removed).
function M.release(dir)
  local real = real_path(dir)
  if held[real] then C.close(held[real]); held[real] = nil end
end

-- Takes dir's lock for this process. Raises, naming the holder's pid (the
-- number it wrote there), when another process holds it. A file system
-- without flock (some network ones) locks nothing: the claim goes on.
-- Returns true when this call took the lock (false: already held here).
function M.claim(dir)
  local real = real_path(dir)
  if held[real] then
    if still_there(held[real], dir) then return false end
    M.release(dir)
  end
  local path = dir .. "/.lock"
  local fd = C.open(path, O_RDWR + O_CREAT + O_CLOEXEC, 420) -- 0644
  if fd < 0 then
    error(("checkpoint: %s: cannot open it (%s)"):format(path,
          ffi.string(C.strerror(ffi.errno()))), 0)
  end
  if C.flock(fd, LOCK_EX + LOCK_NB) ~= 0 then
    local errno = ffi.errno()
    if errno ~= EWOULDBLOCK then
      held[real] = fd -- (no locks here: nothing to hold, nothing to refuse)
      return true
    end
    local buf = ffi.new("char[32]")
    local n = tonumber(C.read(fd, buf, 31))
    C.close(fd)
    local pid = n and n > 0 and ffi.string(buf, n):match("^(%d+)") or "?"
    error(("checkpoint: %s is in use by another run (pid %s, which holds %s): two runs saving " ..
           "into one folder replace each other's checkpoints; give this run another --save " ..
           "folder, or stop that run first"):format(dir, pid, path), 0)
  end
  local text = tostring(tonumber(C.getpid())) .. "\n"
  C.ftruncate(fd, 0)
  C.pwrite(fd, text, #text, 0)
  held[real] = fd
  return true
end

return M
