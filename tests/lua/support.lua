-- support.lua — what the end-to-end Lua tests share: shell quoting and a
-- scratch folder for the files they write. (Not a test file: run_lua.lua
-- loads only test_*.lua.)
local M = {}

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

-- Runs a shell command; returns its output (stdout and stderr together)
-- and its exit status.
function M.sh(cmd)
  local p = io.popen(cmd .. " 2>&1; echo \"EXIT:$?\"")
  local out = p:read("*a")
  p:close()
  return out:gsub("EXIT:%d+%s*$", ""), tonumber(out:match("EXIT:(%d+)%s*$"))
end

return M
