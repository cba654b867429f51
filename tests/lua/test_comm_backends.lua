-- test_comm_backends.lua — the collective backends are one C table
-- (core/comm/backends.c): comm.backends(), comm.init and `luazero --backend`
-- accept exactly its names and refuse others with its list.
local lz = require("luazero")
local comm = require("luazero.comm")
local support = dofile(lz.root .. "/tests/lua/support.lua")

local T = {}
local q, sh = support.quote, support.sh
local luazero = q(lz.root .. "/build/bin/luazero")

-- The names as the C API lists them, read here without luazero.comm.
local function c_names()
  local names = {}
  for i = 0, lz.C.lz_comm_backend_count() - 1 do
    names[#names + 1] = lz.ffi.string(lz.C.lz_comm_backend_name_at(i))
  end
  return names
end

-- A child process outside any launcher, so no LZ_BACKEND or rank leaks in.
local function child(args)
  return sh("env -u LZ_BACKEND -u LZ_SHM_NAME -u WORLD_SIZE -u RANK -u OMPI_COMM_WORLD_SIZE " ..
            "timeout 120 " .. luazero .. " " .. args)
end

local function mentions_every_name(text, what)
  for _, name in ipairs(c_names()) do
    assert(text:find(name, 1, true), ("%s does not name the backend %s: %s"):format(what, name, text))
  end
end

function T.backends_are_the_c_table_in_its_order()
  local names, seen = c_names(), {}
  local list = comm.backends()
  support.eq(#list, #names, "comm.backends() entries")
  assert(#names >= 1, "the table is empty")
  for i, b in ipairs(list) do
    support.eq(b.name, names[i], "entry " .. i .. "'s name")
    assert(not seen[b.name], "the name " .. b.name .. " is in the table twice")
    seen[b.name] = true
    assert(b.about ~= "", b.name .. " has no line about it")
    local any = false
    for dev in pairs(lz.devices) do any = any or b.moves[dev] end
    assert(any, b.name .. " moves no kind of buffer")
  end
  -- Nothing past the end.
  assert(lz.C.lz_comm_backend_name_at(#names) == nil)
  assert(lz.C.lz_comm_backend_name_at(-1) == nil)
end

function T.comm_init_refuses_an_unknown_name_with_the_table()
  support.expect_error(function() comm.init("carrier-pigeon") end,
                       "comm.init: 'carrier-pigeon' is not a collective backend; use auto, ")
  local ok, err = pcall(comm.init, "carrier-pigeon")
  assert(not ok)
  mentions_every_name(tostring(err), "comm.init's error")
  support.expect_error(function() comm.init(3) end, "backend must be a name")
end

-- Each name passes the name check: the communicator is made, or its own
-- backend refuses this environment (no launcher, no mpirun, no GPU).
function T.comm_init_accepts_every_table_name()
  for _, name in ipairs(c_names()) do
    local out = child("-e " .. q(("local ok, e = pcall(require('luazero.comm').init, %q) " ..
                                  "print(ok and 'made ' .. require('luazero.comm').backend() " ..
                                  "or 'refused: ' .. tostring(e))"):format(name)))
    assert(not out:find("is not a collective backend", 1, true), name .. ": " .. out)
    assert(out:find("made " .. name, 1, true) or out:find("refused: ", 1, true), name .. ": " .. out)
  end
  local out = child("-e " .. q("print(require('luazero.comm').init('local').backend())"))
  assert(out:find("^local\n"), out)
end

function T.backend_flag_takes_exactly_the_table_names()
  local out, st = child("--backend carrier-pigeon -e 'print(1)'")
  support.eq(st, 2, "luazero --backend carrier-pigeon's exit status")
  assert(out:find("luazero: --backend: 'carrier-pigeon' is not a collective backend; use auto, ",
                  1, true), out)
  mentions_every_name(out, "--backend's error")
  for _, name in ipairs(c_names()) do
    out, st = child("--backend " .. name .. " -e 'print(os.getenv(\"LZ_BACKEND\"))'")
    support.eq(st, 0, "luazero --backend " .. name .. "'s exit status (" .. out .. ")")
    support.eq(out, name .. "\n", "LZ_BACKEND under --backend " .. name)
  end
  out = child("--help")
  for _, b in ipairs(comm.backends()) do
    assert(out:find(b.name .. "%s+" .. b.about:gsub("%p", "%%%0")), "--help lacks " .. b.name .. ": " .. out)
  end
end

return T
