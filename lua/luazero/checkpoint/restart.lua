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

-- This job's identity, the same for each of its restarts: the launcher's
-- pid (LZ_LAUNCHER_PID) and start time (field 22 of /proc/PID/stat, so a
-- later process given the same pid is another job); nil outside the
-- launcher. A save records it in the manifest (`job`).
function M.job()
  local pid = tonumber(os.getenv("LZ_LAUNCHER_PID") or "")
  if not pid then return nil end
  local f = io.open(("/proc/%d/stat"):format(pid), "rb")
  local stat = f and f:read("*a")
  if f then f:close() end
  -- (the fields after the command, which may hold ") ", start at field 3)
  local rest = stat and stat:match(".*%) (.*)$")
  local fields = {}
  for v in (rest or ""):gmatch("%S+") do fields[#fields + 1] = v end
  return fields[20] and (pid .. "-" .. fields[20]) or nil
end

-- The job that wrote the checkpoint `latest` names in dir (nil: unknown).
local function job_of_latest(dir)
  local disk = require("luazero.checkpoint.disk")
  local ok, m = pcall(function() return disk.read_manifest(disk.resolve(dir)) end)
  return ok and type(m) == "table" and m.job or nil
end

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
-- step 0).
local function check_first_run(flags, rank)
  local restarts = tonumber(os.getenv("LZ_RESTARTS") or "") or 0
  if restarts == 0 or rank ~= 0 then return end
  if not flags.save then
    warn("--restarts %d without --save: a restart would begin again from step 0; add --save " ..
         "DIR (and --save-every N) to continue from the latest checkpoint", restarts)
  end
end

-- On a restart: flags.resume becomes the --save folder when its `latest`
-- names a checkpoint this job wrote (its manifest's job is M.job()); before
-- the job's first save `latest` may name another run's, or a history this
-- run's --resume rewound, and the run's own --resume (or step 0) stays.
-- Rank 0 says where the run continues from. Returns the restart, nil on a
-- first run (after check_first_run's warning).
function M.prepare(flags, rank)
  local k = M.count()
  if not k then
    check_first_run(flags, rank)
    return nil
  end
  local again = setmetatable({ count = k, cause = os.getenv("LZ_RESTART_CAUSE") or "" }, Restart)
  local latest = flags.save and exists(flags.save .. "/latest")
  local job = M.job()
  local ours = latest and job ~= nil and job_of_latest(flags.save) == job
  if ours then flags.resume = flags.save end
  if rank == 0 then
    local before = latest and not ours and
                   ("--save " .. flags.save .. "'s latest is not this job's (another run's, or " ..
                    "a history its --resume rewound), and ") or ""
    print(("restart %d (%s): %s"):format(k, again.cause, ours and
          ("resuming from the latest checkpoint in --save " .. flags.save) or flags.resume and
          (before .. "nothing saved yet: resuming from --resume " .. flags.resume) or
          (before .. "nothing saved yet: starting again from step 0")))
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
