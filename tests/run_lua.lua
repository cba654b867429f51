-- run_lua.lua — runs tests/lua/test_*.lua. Each file returns a table of
-- name -> function; a test fails when it raises. Ends with "N passed, N failed".
--   luazero tests/run_lua.lua [--shuffle SEED] [--reverse] [--jit off] [--skip substring] [substring | tests/lua/FILE.lua]
-- Tests run in file then name order; --shuffle runs them all in an order
-- drawn from SEED (printed first, so a failing order can be replayed),
-- --reverse in the reverse of the usual order, --jit off with the JIT
-- compiler off: a test must pass in any order and interpreted. --skip leaves
-- out the tests whose full name (file.test) contains its substring. A
-- substring (or a test file's path) that names no test is an error.
local root = rawget(_G, "LUAZERO_ROOT") or "."
local clock = require("luazero.clock") -- wall time per test

local filter, skip, seed, reverse = nil, nil, nil, false
local argv = arg or {}
local i = 1
while i <= #argv do
  local a = argv[i]
  if a == "--shuffle" then
    seed = tonumber(argv[i + 1])
    if not seed or seed ~= math.floor(seed) then
      io.stderr:write("run_lua: --shuffle needs an integer seed (got " .. tostring(argv[i + 1]) .. ")\n")
      os.exit(2)
    end
    i = i + 1
  elseif a == "--reverse" then
    reverse = true
  elseif a == "--skip" then
    skip = argv[i + 1]
    if not skip then
      io.stderr:write("run_lua: --skip needs a substring of the tests to leave out\n")
      os.exit(2)
    end
    i = i + 1
  elseif a == "--jit" then
    local v = argv[i + 1]
    if v ~= "off" and v ~= "on" then
      io.stderr:write("run_lua: --jit takes on or off (got " .. tostring(v) .. ")\n")
      os.exit(2)
    end
    if v == "off" then jit.off() end
    i = i + 1
  elseif a:sub(1, 2) == "--" then
    io.stderr:write("run_lua: unknown option " .. a .. " (--shuffle SEED, --reverse, --jit off, --skip SUBSTRING)\n")
    os.exit(2)
  else
    filter = a:match("([^/]+)%.lua$") or a -- a test file's path: its tests
  end
  i = i + 1
end

local files = {}
local p = io.popen('ls "' .. root .. '/tests/lua/"test_*.lua 2>/dev/null')
for f in p:lines() do files[#files + 1] = f end
p:close()
table.sort(files)

-- Every test as { full name, function }, in file then name order.
local passed, failed = 0, 0
local tests = {}
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
      local wanted = not filter or full:find(filter, 1, true)
      if wanted and not (skip and full:find(skip, 1, true)) then tests[#tests + 1] = { full, suite[name] } end
    end
  end
end

if filter and #tests == 0 and failed == 0 then
  io.stderr:write(("run_lua: no test's name contains '%s'%s (names are file.test, such as " ..
                   "test_api_args.a_loaders_position_is_checked)\n")
                  :format(filter, skip and " without '" .. skip .. "'" or ""))
  os.exit(1)
end
if reverse then
  for a = 1, math.floor(#tests / 2) do
    local b = #tests + 1 - a
    tests[a], tests[b] = tests[b], tests[a]
  end
end
if seed then
  -- Fisher-Yates with a generator of our own (math.random differs between
  -- Lua builds), so a seed gives the same order everywhere.
  local state = seed % 2147483647
  if state <= 0 then state = state + 2147483646 end
  local function draw(n)
    state = state * 16807 % 2147483647
    return state % n + 1
  end
  for a = #tests, 2, -1 do
    local b = draw(a)
    tests[a], tests[b] = tests[b], tests[a]
  end
  print(("shuffled with seed %d (replay: luazero tests/run_lua.lua --shuffle %d)"):format(seed, seed))
end
if reverse then print("in reverse order") end
if not jit.status() then print("with the JIT compiler off") end

for _, t in ipairs(tests) do
  local full, fn = t[1], t[2]
  local t0 = clock.now()
  local tok, err = xpcall(fn, debug.traceback)
  collectgarbage("restart") -- support.settle() stops it for a test's readings
  if tok then
    passed = passed + 1
    print(("ok   %-56s %6.2f s"):format(full, clock.now() - t0))
  else
    failed = failed + 1
    print(("FAIL %s\n    %s"):format(full, tostring(err):gsub("\n", "\n    ")))
  end
  io.stdout:flush()
end
print(("%d passed, %d failed"):format(passed, failed))
os.exit(failed == 0 and 0 or 1)
