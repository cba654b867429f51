-- checkpoint/restart.lua — a training run the launcher started again
-- (`luazero -n N --restarts K`, core/launch/launch.c), told by LZ_RESTART=<k>
-- and LZ_RESTART_CAUSE=<one line>. A restart continues from the latest
-- checkpoint of its --save folder exactly as --resume DIR would (the loader
-- reshards to the world size the restart has), or, with nothing saved yet,
-- from where the first run started; its metrics log is appended to, one
-- restart record before the restarted run's first step. Also the test hook
-- LZ_FAULT_KILL.
--
--   local again = restart.prepare(flags, rank)   -- nil on a first run; may set flags.resume
--   jsonl.open(path, { append = restart.count() ~= nil })
--   log:write(again:record(world, first_step))   -- {"event":"restart", ...}
--   restart.fault_hook(rank, step)               -- after each optimizer step
local ffi = require("ffi")
local exists = require("luazero.io.fs").exists

pcall(ffi.cdef, "int getpid(void);")
pcall(ffi.cdef, "int kill(int pid, int sig);")

local M = {}
local Restart = {}
Restart.__index = Restart

-- k of LZ_RESTART=<k> (1 for the first restart), nil on a first run.
function M.count()
  local k = tonumber(os.getenv("LZ_RESTART") or "")
  return k and k >= 1 and k or nil
end

local function warn(fmt, ...)
  io.stderr:write(("train: warning: " .. fmt .. "\n"):format(...))
  io.stderr:flush()
end

-- A first run that may be restarted (LZ_RESTARTS): rank 0 warns when a
-- restart could not continue it, without --save (it would begin again from
-- step 0), or when --save already holds another run's checkpoints (a
-- restart before this run's first save would resume from those).
local function check_first_run(flags, rank)
  local restarts = tonumber(os.getenv("LZ_RESTARTS") or "") or 0
  if restarts == 0 or rank ~= 0 then return end
  if not flags.save then
    warn("--restarts %d without --save: a restart would begin again from step 0; add --save " ..
         "DIR (and --save-every N) to continue from the latest checkpoint", restarts)
  elseif not flags.resume and exists(flags.save .. "/latest") then
    warn("--save %s already holds checkpoints this run does not resume: a restart before its " ..
         "first save would resume from that latest; give --resume %s to continue them, or " ..
         "another --save folder", flags.save, flags.save)
  end
end

-- On a restart: flags.resume becomes the --save folder when it has a
-- `latest` (else the run's own --resume, or none, stays), and rank 0 says
-- where the run continues from. Returns the restart, nil on a first run
-- (after check_first_run's warnings).
function M.prepare(flags, rank)
  local k = M.count()
  if not k then
    check_first_run(flags, rank)
    return nil
  end
  local again = setmetatable({ count = k, cause = os.getenv("LZ_RESTART_CAUSE") or "" }, Restart)
  local saved = flags.save and exists(flags.save .. "/latest")
  if saved then flags.resume = flags.save end
  if rank == 0 then
    print(("restart %d (%s): %s"):format(k, again.cause, saved and
          ("resuming from the latest checkpoint in --save " .. flags.save) or flags.resume and
          ("nothing saved yet: resuming from --resume " .. flags.resume) or
          "nothing saved yet: starting again from step 0"))
    io.stdout:flush()
  end
  return again
end

-- The metrics log's record of this restart: first_step is the first step
-- the restarted run trains.
function Restart:record(world, first_step)
  return { event = "restart", restart = self.count, cause = self.cause, world_size = world,
           resumed_from_step = first_step - 1 }
end

-- Test hook: LZ_FAULT_KILL="RANK:STEP" makes rank RANK SIGKILL itself right
-- after optimizer step STEP (its metrics record written, before that step's
-- save), on a first run only (LZ_RESTART unset): the restarted run goes on.
local fault = os.getenv("LZ_FAULT_KILL")

-- The hook's value checked at start-up against the job's `world` ranks: a
-- malformed value, or a rank no process has, would never fire. (A restart,
-- on fewer ranks perhaps, never fires it.)
function M.check_fault(world)
  if not fault or fault == "" or M.count() then return end
  local r, s = fault:match("^(%d+):(%d+)$")
  if not r then error(("LZ_FAULT_KILL=%s: must be RANK:STEP (e.g. 2:5)"):format(fault), 0) end
  if tonumber(r) >= world then
    error(("LZ_FAULT_KILL=%s: rank %s is outside this job's %d rank%s (0..%d); give a rank " ..
           "below %d"):format(fault, r, world, world == 1 and "" or "s", world - 1, world), 0)
  end
  if tonumber(s) < 1 then
    error(("LZ_FAULT_KILL=%s: step %s never ends; give a step of 1 or more"):format(fault, s), 0)
  end
end

function M.fault_hook(rank, step)
  if not fault or fault == "" or M.count() then return end
  local r, s = fault:match("^(%d+):(%d+)$")
  if not r then error(("LZ_FAULT_KILL=%s: must be RANK:STEP (e.g. 2:5)"):format(fault), 0) end
  if tonumber(r) == rank and tonumber(s) == step then
    io.stdout:flush()
    io.stderr:flush()
    ffi.C.kill(ffi.C.getpid(), 9)
  end
end

return M
