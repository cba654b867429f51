-- checkpoint/due.lua — when a run saves: every `every_steps` steps, every
-- `every_minutes` minutes of wall clock since the run started or last
-- saved, and at its last step. Ranks' clocks differ, so the time is rank
-- 0's: its verdict goes to every rank with one small collective at each
-- step boundary (only when minutes are asked for, under several ranks), and
-- every rank saves at the same step. docs/checkpoints.md.
--
--   local due = require("luazero.checkpoint.due").new(comm, 10, 30.5, 1000)
--   if due:check(step) then ... save ...; due:saved() end
local clock = require("luazero.clock")
local gather = require("luazero.checkpoint.agree").gather

local M = {}
local Due = {}
Due.__index = Due

-- comm: the run's communicator (nil: one rank); every_steps 0 and
-- every_minutes 0 (or nil): never by that measure; last_step: saved always.
function M.new(comm, every_steps, every_minutes, last_step)
  return setmetatable({ comm = comm, steps = every_steps or 0, seconds = (every_minutes or 0) * 60,
                        last_step = last_step, since = clock.now() }, Due)
end

-- Whether rank 0's clock says a save is due: the same answer on every rank.
function Due:time_due()
  if self.seconds <= 0 then return false end
  local mine = clock.now() - self.since >= self.seconds and 1 or 0
  if not self.comm or self.comm.size() == 1 then return mine == 1 end
  return gather(self.comm, { mine })[1][1] == 1
end

-- Whether step saves (collective when minutes are asked for: every rank
-- calls it at every step).
function Due:check(step)
  local by_time = self:time_due() -- first: its collective runs at every step
  return step == self.last_step or (self.steps > 0 and step % self.steps == 0) or by_time
end

-- A save was made: the minutes count from now.
function Due:saved() self.since = clock.now() end

return M
