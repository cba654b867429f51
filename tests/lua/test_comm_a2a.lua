-- test_comm_a2a.lua — luazero.comm's all-to-all and groups, through
-- tests/comm/a2a_lua.lua in child processes: one rank (the local backend)
-- and three ranks under the launcher (shm). run.sh runs it under mpirun too.
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")

local T = {}
local q, sh = support.quote, support.sh
local luazero = q(lz.root .. "/build/bin/luazero")
local script = q(lz.root .. "/tests/comm/a2a_lua.lua")

-- A child outside any launcher, so no rank or backend leaks in.
local function child(args)
  return sh("env -u LZ_BACKEND -u LZ_SHM_NAME -u WORLD_SIZE -u RANK -u OMPI_COMM_WORLD_SIZE " ..
            "timeout 120 " .. luazero .. " " .. args)
end

function T.all_to_all_and_groups_on_one_rank()
  local out = child(script)
  assert(out:find("a2a lua: all passed (1 ranks, local)", 1, true), out)
end

function T.all_to_all_and_groups_on_three_ranks()
  local out = child("-n 3 " .. script)
  local _, n = out:gsub("a2a lua: all passed %(3 ranks, shm%)", "")
  support.eq(n, 3, "ranks that passed:\n" .. out)
end

return T
