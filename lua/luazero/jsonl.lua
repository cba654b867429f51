-- jsonl.lua — a JSON Lines file written one record at a time: each record
-- goes out in one write(2) and is checked; a failed or short write is cut
-- back (ftruncate) to the end of the last complete record, so the file stays
-- valid JSON Lines whatever stops it (a full disk, a quota, /dev/full).
-- The monitors' files (CSV, TensorBoard events) are written the same way,
-- appended to when they exist (a resumed run continues them).
--
--   local log = assert(jsonl.open("run.jsonl"))
--   local f = assert(jsonl.open("run/Train_Samples_lr.csv", { append = true }))
--   local ok, err = log:write(line)   -- line ends with "\n"
--   log:close()        -- or log:discard(): a file this open made, still empty, removed
local ffi = require("ffi")

for _, decl in ipairs({ "int open(const char *path, int flags, int mode);",
                       "long write(int fd, const void *buf, unsigned long n);",
                       "int ftruncate(int fd, int64_t length);", "int close(int fd);",
                       "int64_t lseek(int fd, int64_t offset, int whence);",
                       "char *strerror(int errnum);" }) do
  pcall(ffi.cdef, decl) -- one at a time: another module may have declared some
end

local O_WRONLY, O_CREAT, O_EXCL, O_TRUNC, O_APPEND, O_CLOEXEC = 1, 64, 128, 512, 1024, 524288
local EEXIST = 17
local SEEK_END = 2

local M = {}
local File = {}
File.__index = File

local function why() return ffi.string(ffi.C.strerror(ffi.errno())) end

-- A new (emptied) file, or with opts.append the file as it is (created when
-- missing); nil and the reason when it cannot be opened.
function M.open(path, opts)
  local append = opts and opts.append
  local flags = O_WRONLY + O_CLOEXEC + (append and O_APPEND or O_TRUNC)
  -- made here (O_EXCL), so that discard() may remove it again
  local fd, made = ffi.C.open(path, flags + O_CREAT + O_EXCL, 420), true -- 0644
  if fd < 0 and ffi.errno() == EEXIST then fd, made = ffi.C.open(path, flags, 420), false end
  if fd < 0 then return nil, why() end
  local size = append and tonumber(ffi.C.lseek(fd, 0, SEEK_END)) or 0
  return setmetatable({ fd = fd, size = size, path = path, made = made }, File)
end

-- Appends `text`; true, or nil and the reason (the file then ends at the
-- last record written whole).
function File:write(text)
  if self.fd < 0 then return nil, "the file is closed" end
  local n = tonumber(ffi.C.write(self.fd, text, #text))
  if n == #text then
    self.size = self.size + n
    return true
  end
  local err = n < 0 and why()
  if n >= 0 then
    -- a short write: the rest, to learn why (a full disk: ENOSPC)
    local rest = tonumber(ffi.C.write(self.fd, ffi.cast("const char *", text) + n, #text - n))
    err = rest < 0 and why() or ("wrote %d of %d bytes"):format(n, #text)
    ffi.C.ftruncate(self.fd, self.size)
  end
  return nil, err
end

-- Closes the file, and removes it when this open made it and nothing was
-- written whole (a first write that failed): no empty file left behind.
function File:discard()
  self:close()
  if self.made and self.size == 0 then os.remove(self.path) end
end

function File:close()
  if self.fd >= 0 then ffi.C.close(self.fd) end
  self.fd = -1
end

return M
