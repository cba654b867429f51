-- checkpoint/agree.lua — ranks agreeing on an outcome: every rank's numbers
-- gathered on every rank, and a failure on any rank raised on all of them
-- (its own message where it happened, a pointer to it elsewhere), so a
-- collective save or load never leaves ranks apart.
local fail = require("luazero.checkpoint.disk").fail

local M = {}

-- Every rank's `vals` (numbers exact in a double), gathered on every rank:
-- all[r + 1][i] (luazero.comm's numbers).
function M.gather(comm, vals) return comm.numbers(vals) end

-- Whether every rank succeeded; raises on every rank otherwise (its own
-- message where it failed, the failing ranks' numbers elsewhere).
function M.agree(comm, ok, err, what, extra_vals)
  local vals = { ok and 1 or 0 }
  for _, v in ipairs(extra_vals or {}) do vals[#vals + 1] = v end
  local all = M.gather(comm, vals)
  local bad = {}
  for r, v in ipairs(all) do if v[1] ~= 1 then bad[#bad + 1] = r - 1 end end
  if #bad > 0 then
    -- A failure of some ranks only is named with the rank it happened on:
    -- the others hold only a pointer to it.
    if not ok and #bad < #all then
      error(("rank %d: %s"):format(comm.rank(), (tostring(err):gsub("^[^%s:]+%.lua:%d+: ", ""))), 0)
    end
    if not ok then error(err, 0) end
    fail("%s failed on rank%s %s (see %s message)", what, #bad > 1 and "s" or "",
         table.concat(bad, ", "), #bad > 1 and "their" or "its")
  end
  return all
end

return M
