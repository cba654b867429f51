-- io/fs.lua — what the file system holds at a path, asked the same way
-- everywhere: a file or folder that can be opened, a folder.
local M = {}

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

return M
