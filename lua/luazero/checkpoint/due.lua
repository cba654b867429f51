-- checkpoint/due.lua — when a run saves: every `every_steps` steps, every
-- `every_minutes` minutes of wall clock since the run started or last
-- saved, and at its last step. Ranks' clocks differ, so the time is rank
-- 0's: its verdict goes to every rank with one small collective at each
-- step boundary (only when minutes or a stop on a signal are asked for,
-- under several ranks), and every rank saves at the same step; so does a
-- stop on SIGINT or SIGTERM, which any rank may have seen first.
-- docs/checkpoints.md.
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
-- stop_signal: a function giving the signal that asked this rank to stop
-- (SIGINT 2, SIGTERM 15; 0: none), or nil: check then also says whether any
-- rank was asked (self.stop), and a stop saves.
function M.new(comm, every_steps, every_minutes, last_step, stop_signal)
  return setmetatable({ comm = comm, steps = every_steps or 0, seconds = (every_minutes or 0) * 60,
                        last_step = last_step, since = clock.now(),
                        stop_signal = stop_signal }, Due)
end

-- Whether rank 0's clock says a save is due, and the signal any rank was
-- stopped by (0: none): the same answers on every rank.
function Due:agreed()
  local mine = self.seconds > 0 and clock.now() - self.since >= self.seconds and 1 or 0
  local sig = self.stop_signal and self.stop_signal() or 0
  if self.seconds <= 0 and not self.stop_signal or not self.comm or self.comm.size() == 1 then
    return mine == 1, sig
  end
  local all = gather(self.comm, { mine, sig })
  for _, r in ipairs(all) do sig = math.max(sig, r[2]) end
  return all[1][1] == 1, sig
end

-- Whether step saves (collective when minutes or a stop are asked for:
-- every rank calls it at every step); self.stop: the signal a rank was
-- stopped by, after which the run saves and ends.
function Due:check(step)
  local by_time, sig = self:agreed() -- first: its collective runs at every step
  self.stop = sig > 0 and sig or nil
  return step == self.last_step or (self.steps > 0 and step % self.steps == 0) or by_time or
         self.stop ~= nil
end

-- A save was made: the minutes count from now.
function Due:saved() self.since = clock.now() end

return M
