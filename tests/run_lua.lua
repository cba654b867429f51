-- run_lua.lua — runs tests/lua/test_*.lua. Each file returns a table of
-- name -> function; a test fails when it raises. Ends with "N passed, N failed".
--   luazero tests/run_lua.lua [substring]
local root = rawget(_G, "LUAZERO_ROOT") or "."
local filter = arg and arg[1]
local clock = require("luazero.clock") -- wall time per test
local files = {}
local p = io.popen('ls "' .. root .. '/tests/lua/"test_*.lua 2>/dev/null')
for f in p:lines() do files[#files + 1] = f end
p:close()
table.sort(files)

local passed, failed = 0, 0
for _, file in ipairs(files) do
  local ok, suite = pcall(dofile, file)
  if not ok then
    print("FAIL " .. file .. ": " .. tostring(suite))
    failed = failed + 1
  else
    local names = {}
    for name in pairs(suite) do names[#names + 1] = name end
    table.sort(names)
    local short = file:match("([^/]+)%.lua$")
    for _, name in ipairs(names) do
      local full = short .. "." .. name
      if not filter or full:find(filter, 1, true) then
        local t0 = clock.now()
        local tok, err = xpcall(suite[name], debug.traceback)
        if tok then
          passed = passed + 1
          print(("ok   %-56s %6.2f s"):format(full, clock.now() - t0))
        else
          failed = failed + 1
          print(("FAIL %s\n    %s"):format(full, tostring(err):gsub("\n", "\n    ")))
        end
        io.stdout:flush()
      end
    end
  end
end
print(("%d passed, %d failed"):format(passed, failed))
os.exit(failed == 0 and 0 or 1)
