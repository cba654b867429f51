-- test_sweep.lua — the sweep's runs and ids (lua/luazero/ui/sweep.lua's
-- expand): an id stays when another entry adds keys (ranks among them), and
-- a value reaches its run in every digit it has.
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local sweep = require("luazero.ui.sweep")

local T = {}
local eq = support.eq

local function ids(spec)
  local out = {}
  for _, r in ipairs(sweep.expand(spec)) do out[#out + 1] = r.id end
  return out
end

function T.an_id_stays_when_another_entry_adds_keys()
  local base = { model = "gpt2-nano", steps = 2 }
  local before = ids({ ranks = 1, base = base, grid = { lr = { 1e-3, 2e-3 } } })
  local after = ids({ ranks = 1, base = base, grid = { lr = { 1e-3, 2e-3 } },
                      runs = { { lr = 5e-3, ranks = 2 }, { lr = 1e-3, stage = 3 } } })
  eq(#after, 4, "runs")
  eq(after[1], before[1], "the first grid run's id")
  eq(after[2], before[2], "the second grid run's id")
  assert(before[1]:match("^lr0%.001%-%x+$"), before[1])
  assert(after[3]:match("^lr0%.005_ranks2%-%x+$"), after[3])
  assert(after[4]:match("^lr0%.001_stage3%-%x+$"), after[4])
end

function T.values_reach_the_run_in_every_digit()
  local runs = sweep.expand({ ranks = 1, base = { model = "gpt2-nano" },
                              grid = { lr = { 1 / 3, 0.3, 0.30000000000000004, 1e-3, 0.001 } } })
  eq(#runs, 4, "0.3 and 0.30000000000000004 are two runs, 1e-3 and 0.001 one")
  eq(sweep.value_text(1 / 3), "0.3333333333333333", "1/3")
  eq(sweep.value_text(0.30000000000000004), "0.30000000000000004", "0.1 + 0.2")
  eq(sweep.value_text(3e-4), "0.0003", "3e-4")
  eq(sweep.value_text(16), "16", "a whole number")
end

return T
