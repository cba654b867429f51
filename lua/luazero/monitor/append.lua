-- monitor/append.lua — a file the monitors append to, one record at a time:
-- each record goes out in one write(2) when its step ends (nothing waits in
-- a buffer) and is checked; a failed or short write is cut back (ftruncate)
-- to the end of the last whole record, so a full disk never leaves half a
-- record behind. An existing file is kept and appended to (a resumed run
-- continues it).
--
--   local f = assert(append.open("run/Train_Samples_lr.csv"))
--   local ok, err = f:write(bytes)
--   f:close()
local ffi = require("ffi")

for _, decl in ipairs({ "int open(const char *path, int flags, int mode);",
                       "long write(int fd, const void *buf, unsigned long n);",
                       "int ftruncate(int fd, int64_t length);", "int close(int fd);",
                       "int64_t lseek(int fd, int64_t offset, int whence);",
                       "char *strerror(int errnum);" }) do
  pcall(ffi.cdef, decl) -- one at a time: another module may have declared some
end

local O_WRONLY, O_CREAT, O_APPEND, O_CLOEXEC = 1, 64, 1024, 524288
local SEEK_END = 2

local M = {}
local File = {}
File.__index = File

local function why() return ffi.string(ffi.C.strerror(ffi.errno())) end

-- The file at path (created when missing); nil and the reason when it
-- cannot be opened.
function M.open(path)
  local fd = ffi.C.open(path, O_WRONLY + O_CREAT + O_APPEND + O_CLOEXEC, 420) -- 0644
  if fd < 0 then return nil, why() end
  local size = tonumber(ffi.C.lseek(fd, 0, SEEK_END))
  return setmetatable({ fd = fd, size = size, path = path }, File)
end

-- Appends `bytes`; true, or nil and the reason (the file then ends at the
-- last record written whole).
function File:write(bytes)
  if self.fd < 0 then return nil, "the file is closed" end
  local n = tonumber(ffi.C.write(self.fd, bytes, #bytes))
  if n == #bytes then
    self.size = self.size + n
    return true
  end
  local err = n < 0 and why() or ("wrote %d of %d bytes"):format(n, #bytes)
  if n >= 0 then
    local rest = tonumber(ffi.C.write(self.fd, ffi.cast("const char *", bytes) + n, #bytes - n))
    if rest < 0 then err = why() end
  end
  ffi.C.ftruncate(self.fd, self.size)
  return nil, err
end

function File:close()
  if self.fd >= 0 then ffi.C.close(self.fd) end
  self.fd = -1
end

return M
