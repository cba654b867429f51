-- io/fs.lua — what the file system holds at a path, asked the same way
-- everywhere: a file or folder that can be opened, a folder, a folder's names.
local ffi = require("ffi")

local M = {}

-- (readdir through libc: glibc's 64-bit struct dirent)
pcall(ffi.cdef, [[
typedef struct lz_dirent { uint64_t d_ino; int64_t d_off; unsigned short d_reclen;
                           unsigned char d_type; char d_name[256]; } lz_dirent;
void *opendir(const char *name);
lz_dirent *readdir(void *dirp);
int closedir(void *dirp);
typedef struct lz_statvfs { unsigned long f_bsize, f_frsize; uint64_t f_blocks, f_bfree, f_bavail,
  f_files, f_ffree, f_favail; unsigned long f_fsid, f_flag, f_namemax; int spare[6]; } lz_statvfs;
int statvfs(const char *path, lz_statvfs *buf);
]])

local KINDS = { [0x8000] = "file", [0x4000] = "folder", [0xA000] = "link", [0x1000] = "fifo",
                [0x2000] = "character device", [0x6000] = "block device", [0xC000] = "socket" }

-- What path is: "file", "folder", "link" (follow false: the link itself),
-- "fifo", "character device", "block device", "socket"; nil when nothing is
-- there. Asked without opening it (opening a FIFO waits for a writer).
function M.kind(path, follow)
  local k = require("luazero").C.lz_path_kind(path, follow and 1 or 0, nil)
  if k < 0 then return nil end
  return KINDS[k] or "other"
end

-- "device:inode" of what path names (following links), or nil.
function M.identity(path)
  local id = ffi.new("uint64_t[2]")
  if require("luazero").C.lz_path_kind(path, 1, id) < 0 then return nil end
  return tostring(id[0]) .. ":" .. tostring(id[1])
end

-- True when path names something that can be opened (a file or a folder).
function M.exists(path)
  local f = io.open(path, "rb")
  if f then f:close() end
  return f ~= nil
end

-- True when path names a folder.
function M.is_dir(path)
  local f = io.open(path .. "/.", "rb")
  if f then f:close() end
  return f ~= nil
end

-- The names in folder dir (with . and ..; {} where it cannot be read).
function M.list(dir)
  local d = ffi.C.opendir(dir)
  if d == nil then return {} end
  local names = {}
  while true do
    local e = ffi.C.readdir(d)
    if e == nil then break end
    names[#names + 1] = ffi.string(e.d_name)
  end
  ffi.C.closedir(d)
  return names
end

-- path as an absolute path: a relative one is taken from $PWD (the folder
-- the user ran the command in, as the shell names it).
function M.absolute(path)
  if path:sub(1, 1) == "/" then return path end
  return (os.getenv("PWD") or ".") .. "/" .. path
end

-- The bytes an unprivileged writer may still take on path's file system
-- (statvfs's f_bavail), or nil where it cannot be asked.
function M.free_bytes(path)
  local st = ffi.new("lz_statvfs")
  if ffi.C.statvfs(path, st) ~= 0 then return nil end
  return tonumber(st.f_bavail) * tonumber(st.f_frsize)
end

return M
