-- support.lua — what the Lua tests share: an expected error, shell quoting
-- and a scratch folder for the files they write. (Not a test file: run_lua.lua
-- loads only test_*.lua.)
local M = {}

-- fn must raise an error whose text contains needle.
function M.expect_error(fn, needle)
  local ok, err = pcall(fn)
  assert(not ok, "expected an error mentioning: " .. needle)
  assert(tostring(err):find(needle, 1, true),
         ("error %q does not mention %q"):format(tostring(err), needle))
end

function M.quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

-- A fresh folder; returns write(name, bytes) -> path of the written file,
-- and the folder.
function M.scratch()
  local dir = os.tmpname()
  os.remove(dir)
  os.execute("mkdir -p " .. M.quote(dir))
  return function(name, bytes)
    local path = dir .. "/" .. name
    local f = assert(io.open(path, "wb"))
    f:write(bytes)
    f:close()
    return path
  end, dir
end

return M
