-- io/atomic.lua — the one way a user's file or folder is written: into a
-- temporary name beside the target, every write checked, then fsync, close
-- and a rename into place only when all of it succeeded; on any failure the
-- temporary is removed and the error is one line naming the target, the
-- bytes written and the bytes needed. An earlier file or folder of the same
-- name stays untouched until the new one replaces it whole.
--
--   local w = atomic.open("out.bin", total_bytes)    -- total: for the message
--   w:write(str)  w:write(ptr, n)  w:pwrite(ptr, n, offset)
--   w:commit()                                       -- or w:abort()
--   atomic.build_file("out.bin", total, function(w) ... end)  -- removed if fn raises
--   atomic.write("results.csv", text)                -- the same, in one call
--   atomic.copy("a.bin", "b.bin")                    -- a file's bytes, streamed
--   local f = atomic.folder("hf-model", { "config.json", "model.safetensors" })
--   f.tmp .. "/config.json"  ...  f:commit()         -- or f:abort()
--   atomic.build_folder("hf-model", owned, function(f) ... end)
--
-- Test hook: LZ_WRITE_FAIL_AFTER_BYTES=N makes the writes of this process
-- fail with "No space left on device" once N bytes have been written in
-- all (counted across files), as a full disk would.
local ffi = require("ffi")
local lz = require("luazero")
local fs = require("luazero.io.fs")

for _, decl in ipairs({ "int open(const char *path, int flags, int mode);",
                       "long write(int fd, const void *buf, unsigned long n);",
                       "int64_t pwrite(int fd, const void *buf, size_t n, int64_t offset);",
                       "int fsync(int fd);", "int close(int fd);", "int unlink(const char *path);",
                       "int rename(const char *from, const char *to);", "int getpid(void);",
                       "char *strerror(int errnum);",
                       "long readlink(const char *path, char *buf, unsigned long n);",
                       "int renameat2(int olddirfd, const char *oldpath, int newdirfd, " ..
                       "const char *newpath, unsigned int flags);" }) do
  pcall(ffi.cdef, decl) -- one at a time: another module may have declared some
end

local C = ffi.C
local O_WRONLY, O_CREAT, O_TRUNC, O_CLOEXEC = 1, 64, 512, 524288
local ENOSPC = 28

local M = {}

local INJECTED = -1 -- the errno of a failure LZ_WRITE_FAIL_AFTER_BYTES made

local function why(errno)
  if errno == INJECTED then return "No space left on device: LZ_WRITE_FAIL_AFTER_BYTES" end
  return ffi.string(C.strerror(errno or ffi.errno()))
end

-- The injected limit (LZ_WRITE_FAIL_AFTER_BYTES) and what was written so far.
local budget = tonumber(os.getenv("LZ_WRITE_FAIL_AFTER_BYTES") or "")
local written_total = 0

-- One write of n bytes at `at` (nil: the file's position); the bytes it
-- wrote, and an errno when it stopped short.
local function put(fd, ptr, n, at)
  local allowed = n
  if budget then allowed = math.max(0, math.min(n, budget - written_total)) end
  local done, errno = 0, nil
  while done < allowed do
    local r = at and C.pwrite(fd, ptr + done, allowed - done, at + done)
              or C.write(fd, ptr + done, allowed - done)
    r = tonumber(r)
    if r <= 0 then
      errno = r < 0 and ffi.errno() or ENOSPC
      break
    end
    done = done + r
  end
  written_total = written_total + done
  if not errno and done < n then errno = INJECTED end
  return done, errno
end

local function dir_of(path)
  return path:match("^(.*)/[^/]*$") or ".", path:match("([^/]*)$")
end

-- The temporary name beside `path`: .NAME.tmp-PID.
local function temporary(path)
  local dir, name = dir_of(path)
  return ("%s/.%s.tmp-%d"):format(dir, name, C.getpid())
end

------------------------------------------------- outputs that are inputs

for _, decl in ipairs({ "char *realpath(const char *path, char *resolved);",
                       "void free(void *p);" }) do
  pcall(ffi.cdef, decl)
end

-- path with links, "." and ".." resolved (a path that does not exist yet:
-- its folder resolved, its name kept), or nil when its folder is not there.
function M.real_path(path)
  path = path:gsub("(.)/+$", "%1")
  local p = C.realpath(path, nil)
  if p == nil then
    local dir, name = dir_of(path)
    if name == "" or name == "." or name == ".." then return nil end
    local d = C.realpath(dir, nil)
    if d == nil then return nil end
    local s = ffi.string(d)
    C.free(d)
    return (s == "/" and "" or s) .. "/" .. name
  end
  local s = ffi.string(p)
  C.free(p)
  return s
end

local identity = fs.identity

-- How writing `out` would touch `input`: "the same file as" (by device and
-- inode, or real path), "inside" (a file the folder `input` already holds:
-- a new name there destroys nothing), or nil when it would not.
function M.overlap(out, input)
  local a = identity(out)
  if a and a == identity(input) then return "the same file as" end
  local ro, ri = M.real_path(out), M.real_path(input)
  if not ro or not ri then return nil end
  if ro == ri then return "the same file as" end
  if a and ro:sub(1, #ri + 1) == ri .. "/" then return "inside" end
end

-- Refuses an output `out` (`out_what`: e.g. "the output") that is the input
-- `input` (`in_what`) or lies inside it: one line naming both.
function M.refuse_overlap(out, out_what, input, in_what)
  local how = input and M.overlap(out, input)
  if how then
    error(("%s %s is %s %s %s; writing it would destroy that input: give another path")
          :format(out_what, out, how, in_what, input), 0)
  end
end

local A = { fifo = "a FIFO (named pipe)", socket = "a socket", other = "not a regular file",
            ["character device"] = "a character device", ["block device"] = "a block device" }

-- Where an output named `path` is written: through a symbolic link to what
-- it points at, there or not yet (the rename would otherwise put a file in
-- the link's place), and never over a device, pipe or socket (a rename
-- would replace /dev/null itself, for root): those are refused.
local function target(path, what, depth)
  -- (a descriptor of this process, such as /dev/stdout redirected to a file:
  -- a rename there would replace the file the shell opened, its other
  -- output lost)
  if path:match("^/dev/std") or path:match("^/dev/fd/") or path:match("^/proc/[^/]+/fd/") then
    error(("%s is a file descriptor of this process, not a %s: an output is written whole to a " ..
           "temporary name and renamed into place; give a file path"):format(path, what), 0)
  end
  local kind = fs.kind(path, true) -- (what a link leads to: /dev/stdout, a pipe)
  if A[kind] then
    error(("%s is %s, not a %s: an output is written whole to a temporary name beside it and " ..
           "renamed into place, which would replace it; give a file path"):format(path, A[kind],
           what), 0)
  end
  if fs.kind(path) == "link" then
    -- (a link to a name not there yet: that name, beside the link when relative)
    local buf = ffi.new("char[4096]")
    local n = tonumber(C.readlink(path, buf, 4096))
    local to = n >= 0 and ffi.string(buf, n) or nil
    if not to or (depth or 0) > 40 then
      error(("%s: a symbolic link that cannot be followed (a loop?); remove the link or give " ..
             "another %s name"):format(path, what), 0)
    end
    if to:sub(1, 1) ~= "/" then to = dir_of(path) .. "/" .. to end
    to = to:gsub("(.)/+$", "%1") -- (a link to "dir/": the folder, not inside it)
    return target(to, what, (depth or 0) + 1)
  end
  return path
end

local Writer = {}
Writer.__index = Writer

-- A writer of `path` (total: the bytes it will hold, for messages).
function M.open(path, total)
  path = target(path, "file")
  local tmp = temporary(path)
  local fd = C.open(tmp, O_WRONLY + O_CREAT + O_TRUNC + O_CLOEXEC, 420) -- 0644
  if fd < 0 then
    error(("%s: cannot write it (%s); check the folder exists and is writable")
          :format(path, why()), 0)
  end
  return setmetatable({ path = path, tmp = tmp, fd = fd, written = 0, total = total,
                        high = 0 }, Writer)
end

-- Set once a write of an output failed (a full disk, a quota): a tool's
-- error is then the run's failure, exit status 1, not its input's.
M.write_failed = false

function Writer:fail(errno)
  local path, written, total = self.path, self.high, self.total
  M.write_failed = true
  self:abort()
  error(("%s: writing failed after %d%s bytes (%s); nothing was written there: free space " ..
         "or write elsewhere"):format(path, written, total and (" of " .. total) or "",
         why(errno)), 0)
end

-- Appends `data` (a string, or a pointer and n).
function Writer:write(data, n)
  n = n or #data
  local done, errno = put(self.fd, ffi.cast("const char *", data), n, nil)
  self.written = self.written + done
  self.high = math.max(self.high, self.written)
  if errno then self:fail(errno) end
end

-- Writes n bytes at `offset` (the file grows as needed).
function Writer:pwrite(data, n, offset)
  local done, errno = put(self.fd, ffi.cast("const char *", data), n, offset)
  self.high = math.max(self.high, offset + done)
  if errno then self:fail(errno) end
end

-- fsync, close, rename into place, fsync the folder.
function Writer:commit()
  local fd = self.fd
  self.fd = -1
  local err
  if C.fsync(fd) ~= 0 then err = ffi.errno() end
  if C.close(fd) ~= 0 and not err then err = ffi.errno() end
  if err then
    self.fd = -1
    M.write_failed = true
    C.unlink(self.tmp)
    error(("%s: writing failed after %d%s bytes (%s); nothing was written there: free space " ..
           "or write elsewhere"):format(self.path, self.high,
           self.total and (" of " .. self.total) or "", why(err)), 0)
  end
  if C.rename(self.tmp, self.path) ~= 0 then
    err = why()
    C.unlink(self.tmp)
    error(("%s: cannot put it in place (%s)"):format(self.path, err), 0)
  end
  if lz.C.lz_ckpt_fsync((dir_of(self.path))) ~= 0 then
    error(("%s: written, but %s"):format(self.path, lz.last_error():gsub("^checkpoint: ", "")), 0)
  end
  return self.high
end

-- Closes and removes the temporary; the target is as it was.
function Writer:abort()
  if self.fd >= 0 then C.close(self.fd) end
  self.fd = -1
  C.unlink(self.tmp)
end

-- fn(writer) inside a pcall: the file committed when it returns, removed
-- when it raises (the error raised again). Returns fn's result.
function M.build_file(path, total, fn)
  local w = M.open(path, total)
  local ok, res = pcall(fn, w)
  if not ok then
    w:abort()
    error(res, 0)
  end
  w:commit()
  return res
end

-- The whole of `text` as `path`.
function M.write(path, text)
  local w = M.open(path, #text)
  w:write(text)
  return w:commit()
end

------------------------------------------------------------------ folders

local Folder = {}
Folder.__index = Folder

local exists, is_dir = fs.exists, fs.is_dir

local function list(dir)
  local p = io.popen("ls -A1 '" .. dir:gsub("'", "'\\''") .. "' 2>/dev/null")
  local out = {}
  for name in p:lines() do out[#out + 1] = name end
  p:close()
  return out
end

-- A folder `path` built in a temporary folder beside it (f.tmp) and renamed
-- into place by f:commit(). `owned`: the names such a folder holds (a name
-- starting with ^ is a Lua pattern of names); an
-- existing folder holding anything else is refused (it is not an earlier
-- output of this kind, and replacing it would lose those files).
function M.folder(path, owned)
  path = target(path:gsub("/+$", ""), "folder")
  if exists(path) and not is_dir(path) then
    error(("%s: a file is there, not a folder; give a new folder name"):format(path), 0)
  end
  if is_dir(path) then
    local ok, patterns = {}, {} -- (a pattern: "^model%-%d+%-of%-%d+%.safetensors$")
    for _, n in ipairs(owned or {}) do
      if n:sub(1, 1) == "^" then patterns[#patterns + 1] = n else ok[n] = true end
    end
    local function owns(n)
      if ok[n] then return true end
      for _, p in ipairs(patterns) do
        if n:match(p) then return true end
      end
    end
    for _, n in ipairs(list(path)) do
      if not owns(n) then
        error(("%s: the folder holds %s, which this output does not write (another model's " ..
               "folder?); give a new or empty folder, or remove it"):format(path, n), 0)
      end
    end
  end
  local tmp = temporary(path)
  lz.C.lz_ckpt_remove_tree(tmp)
  if lz.C.lz_ckpt_mkdir(tmp) ~= 0 then
    error(("%s: cannot make a folder beside it (%s)"):format(path,
          (lz.last_error():gsub("^checkpoint: ", ""))), 0)
  end
  return setmetatable({ path = path, tmp = tmp }, Folder)
end

local AT_FDCWD, RENAME_EXCHANGE = -100, 2

-- The temporary folder renamed into place. An earlier one is swapped with
-- it in one step (renameat2's RENAME_EXCHANGE: there is no moment without
-- the folder, whenever the process dies) and then removed; where the file
-- system cannot swap, it is set aside first, then removed.
function Folder:commit()
  local old
  if is_dir(self.path) and lz.C.lz_ckpt_fsync(self.tmp) == 0 and
     C.renameat2(AT_FDCWD, self.tmp, AT_FDCWD, self.path, RENAME_EXCHANGE) == 0 then
    -- (self.tmp holds the earlier folder now)
    if lz.C.lz_ckpt_remove_tree(self.tmp) ~= 0 then
      error(("%s: written, but the earlier one, swapped to %s, could not be removed (%s)")
            :format(self.path, self.tmp, lz.last_error():gsub("^checkpoint: ", "")), 0)
    end
    if lz.C.lz_ckpt_fsync((dir_of(self.path))) ~= 0 then
      error(("%s: written, but %s"):format(self.path, lz.last_error():gsub("^checkpoint: ", "")), 0)
    end
    return
  end
  if is_dir(self.path) then
    old = ("%s/.%s.old-%d"):format(dir_of(self.path), select(2, dir_of(self.path)), C.getpid())
    lz.C.lz_ckpt_remove_tree(old)
    if C.rename(self.path, old) ~= 0 then
      local err = why()
      self:abort()
      error(("%s: cannot replace it (%s)"):format(self.path, err), 0)
    end
  end
  if lz.C.lz_ckpt_fsync(self.tmp) ~= 0 or C.rename(self.tmp, self.path) ~= 0 then
    local err = why()
    if old then C.rename(old, self.path) end
    self:abort()
    error(("%s: cannot put it in place (%s)"):format(self.path, err), 0)
  end
  if old and lz.C.lz_ckpt_remove_tree(old) ~= 0 then
    error(("%s: written, but the earlier one set aside as %s could not be removed (%s)")
          :format(self.path, old, lz.last_error():gsub("^checkpoint: ", "")), 0)
  end
  if lz.C.lz_ckpt_fsync((dir_of(self.path))) ~= 0 then
    error(("%s: written, but %s"):format(self.path, lz.last_error():gsub("^checkpoint: ", "")), 0)
  end
end

function Folder:abort() lz.C.lz_ckpt_remove_tree(self.tmp) end

-- dst written as a copy of src's bytes, 4 MiB at a time. Returns the bytes.
function M.copy(src, dst)
  local i, err = io.open(src, "rb")
  if not i then error(("%s: cannot read it (%s)"):format(src, tostring(err)), 0) end
  local total = i:seek("end")
  i:seek("set", 0)
  local ok, e = pcall(M.build_file, dst, total, function(w)
    while true do
      local chunk = i:read(2 ^ 22)
      if not chunk then break end
      w:write(chunk)
    end
  end)
  i:close()
  if not ok then error(e, 0) end
  return total
end

-- fn(folder) inside a pcall: the folder committed when it returns, removed
-- when it raises (the error raised again).
function M.build_folder(path, owned, fn)
  local f = M.folder(path, owned)
  local ok, err = pcall(fn, f)
  if not ok then
    f:abort()
    -- Messages name the files as they would have been named.
    local msg, i = tostring(err), 1
    while true do
      local a, b = msg:find(f.tmp, i, true)
      if not a then break end
      msg = msg:sub(1, a - 1) .. f.path .. msg:sub(b + 1)
      i = a + #f.path
    end
    error(msg, 0)
  end
  f:commit()
  return err
end

return M
