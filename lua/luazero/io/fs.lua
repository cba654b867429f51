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
]])

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

return M
