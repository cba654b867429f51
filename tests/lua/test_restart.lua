-- test_restart.lua — `luazero -n N --restarts K [--min-ranks M]` keeps
-- scripts/train.lua going through a lost rank: the restart resumes from
-- the --save folder's latest checkpoint on the ranks left (stage 3: the
-- shards resharded), bitwise as a resume by hand on that many ranks, and
-- appends a restart record to the metrics log; without --save it starts
-- again from step 0, and it resumes only checkpoints its own job wrote; a
-- first run that a restart could not continue warns. The launcher's
-- refusals and its giving up. The fault is the test hook LZ_FAULT_KILL=R:S:
-- rank R SIGKILLs itself after step S, before that step's save.
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")

local T = {}
local q, sh = support.quote, support.sh
local write_file, tmp, corpus = support.scratch_corpus(support.HAMLET, 40)
local MODEL = support.GPT2_1L .. " --micro-batch 2 --data " .. q(corpus)
local _, ok_train = support.trainer(MODEL)

-- luazero with launcher flags `launch` (and environment `env`) before the
-- script: output and exit status.
local function launch(env, launch_flags, rest)
  return sh(("cd %s && %s %s %s %s"):format(q(lz.root), env, q(lz.executable()), launch_flags,
                                             rest))
end

local function train_launched(env, launch_flags, flags)
  return launch(env, launch_flags, "scripts/train.lua " .. MODEL .. " " .. flags)
end

-- The log's restart record and the record after it.
local function restart_record(path)
  local recs = support.records(path)
  for i, r in ipairs(recs) do
    if r.event == "restart" then return r, recs[i + 1], recs, i end
  end
  error("no restart record in " .. path)
end

function T.a_killed_rank_restarts_on_the_ranks_left_as_a_resume_by_hand()
  local dir, log = tmp .. "/lost", tmp .. "/lost.jsonl"
  local out, st = train_launched("LZ_FAULT_KILL=2:5", "-n 3 --restarts 1 --min-ranks 2",
                                 "--steps 6 --stage 3 --save-every 2 --save " .. q(dir) ..
                                 " --log " .. q(log))
  assert(st == 0, ("exit %s:\n%s"):format(tostring(st), out))
  assert(out:find("luazero: rank 2 was killed by signal 9 (SIGKILL) at ", 1, true) and
         out:find("; restart 1 of 1 on 2 ranks (1 lost, --min-ranks 2)", 1, true), out)
  assert(out:find("resumed from " .. dir .. "/step-000004: step 4", 1, true), out)
  local r, after, recs, i = restart_record(log)
  support.eq(r.restart, 1, "restart")
  support.eq(r.world_size, 2, "world_size")
  support.eq(r.resumed_from_step, 4, "resumed_from_step")
  assert(r.cause:find("^rank 2 was killed by signal 9 %(SIGKILL%) at %d+%-%d+%-%d+T[%d:]+Z$"),
         r.cause)
  -- The first run's records stay: steps 1..4, and 5 when rank 0 wrote it
  -- before the launcher stopped it (rank 2 died after step 5).
  assert(i == 5 or i == 6, ("the restart record is line %d, expected 5 or 6"):format(i))
  for s = 1, i - 1 do support.eq(recs[s].step, s, "line " .. s .. "'s step") end
  support.eq(after.step, 5, "the step after the restart record")
  local sum = assert(out:match("params_checksum (%x+)"), out)
  support.eq(recs[#recs].params_checksum, sum, "the end record's checksum")
  local _, by_hand = ok_train(2, "--steps 6 --stage 3 --resume " .. q(dir .. "/step-000004"))
  support.eq(sum, by_hand, "the restart's checksum against -n 2 --resume step-000004")
end

-- Before a job's first save, --save's latest is not its own: a run that
-- --resumes an earlier step of the folder (a rewind) and is killed before
-- it saves restarts from that step, not from the newer history it rewound;
-- a fresh run into a folder holding another run's checkpoints restarts
-- from step 0. Each ends where the same run without the fault ends.
function T.a_restart_resumes_only_checkpoints_its_own_job_wrote()
  local dir = tmp .. "/rewound"
  local _, first = ok_train(1, "--steps 6 --save-every 2 --save " .. q(dir))
  local back = q(dir .. "/step-000002")
  local _, straight = ok_train(1, "--steps 6 --lr 1e-3 --resume " .. back)
  assert(straight ~= first, "the rewound run trains otherwise")
  local out, st = train_launched("LZ_FAULT_KILL=0:3", "-n 1 --restarts 1",
                                 "--steps 6 --lr 1e-3 --save-every 2 --resume " .. back ..
                                 " --save " .. q(dir))
  assert(st == 0, ("exit %s:\n%s"):format(tostring(st), out))
  assert(out:find("--save " .. dir .. "'s latest is not this job's (another run's, or a " ..
                  "history its --resume rewound), and nothing saved yet: resuming from " ..
                  "--resume " .. dir .. "/step-000002", 1, true), out)
  support.eq(out:match("params_checksum (%x+)"), straight, "the restart's checksum")
  -- a fresh run into a folder of another run's checkpoints
  local other = tmp .. "/other"
  ok_train(1, "--steps 2 --save " .. q(other))
  local _, fresh = ok_train(1, "--steps 3")
  out, st = train_launched("LZ_FAULT_KILL=0:1", "-n 1 --restarts 1",
                           "--steps 3 --save-every 5 --save " .. q(other))
  assert(st == 0, ("exit %s:\n%s"):format(tostring(st), out))
  assert(out:find("and nothing saved yet: starting again from step 0", 1, true), out)
  support.eq(out:match("params_checksum (%x+)"), fresh, "the fresh run's checksum")
end

function T.without_save_a_restart_warns_then_starts_again_from_step_0()
  local log = tmp .. "/nosave.jsonl"
  local out, st = train_launched("LZ_FAULT_KILL=1:2", "-n 2 --restarts 1 --min-ranks 1",
                                 "--steps 3 --log " .. q(log))
  assert(st == 0, ("exit %s:\n%s"):format(tostring(st), out))
  assert(out:find("train: warning: --restarts 1 without --save: a restart would begin again " ..
                  "from step 0", 1, true), out)
  assert(out:find("nothing saved yet: starting again from step 0", 1, true), out)
  local r, after = restart_record(log)
  support.eq(r.world_size, 1, "world_size")
  support.eq(r.resumed_from_step, 0, "resumed_from_step")
  support.eq(after.step, 1, "the step after the restart record")
  local _, straight = ok_train(1, "--steps 3")
  support.eq(out:match("params_checksum (%x+)"), straight, "the restart's checksum, 1 rank")
end

function T.without_restarts_a_killed_rank_fails_the_run_as_before()
  local out, st = train_launched("LZ_FAULT_KILL=1:2", "-n 2", "--steps 3")
  support.eq(st, 137, "exit status")
  assert(out:find("luazero: rank 1 was killed by signal 9 (SIGKILL)", 1, true), out)
  assert(not out:find("restart", 1, true) and not out:find("params_checksum", 1, true), out)
end

-- The launcher alone (a chunk for a program): it gives up, and refuses.
local FAIL_RANK_1 = q('if os.getenv("RANK") == "1" then os.exit(3) end')

function T.restarts_used_up_or_too_few_ranks_left_exit_1_saying_why()
  local out, st = launch("", "-n 2 --restarts 2", "-e " .. FAIL_RANK_1)
  support.eq(st, 1, "exit status, restarts used up")
  support.eq(select(2, out:gsub("; restart %d of 2 on 2 ranks", "")), 2, "restart lines")
  assert(out:find("rank 1 exited with code 3 at [^;]+; no restart left %(2 restarts used, " ..
                  "%-%-restarts 2%)"), out)
  out, st = launch("", "-n 2 --restarts 1 --min-ranks 2", "-e " .. FAIL_RANK_1)
  support.eq(st, 1, "exit status, too few ranks")
  assert(out:find("1 rank left, fewer than --min-ranks 2: not restarting", 1, true), out)
end

-- Bad input would be refused again: a rank that exits 2 ends the job at once.
function T.a_rank_that_refuses_its_input_is_not_restarted()
  local out, st = launch("", "-n 2 --restarts 2", "-e " .. q('if os.getenv("RANK") == "1" then os.exit(2) end'))
  support.eq(st, 2, "exit status")
  assert(out:find("luazero: rank 1 refused its input (exit 2): not restarting", 1, true), out)
  assert(not out:find("restart 1 of", 1, true), out)
end

function T.restart_flags_are_checked_and_the_environment_gives_defaults()
  for _, c in ipairs({
    { "--restarts 1", "luazero: --restarts restarts the ranks of a job: give -n N too" },
    { "-n 2 --restarts 1 --min-ranks 3",
      "luazero: --min-ranks 3 is more than -n 2: a restart never has more ranks" },
    { "-n 2 --min-ranks 1", "luazero: --min-ranks 1 does nothing without --restarts K" },
    { "-n 2 --restarts -1", "luazero: --restarts takes a whole number from 0 to 1000 (got '-1')" },
  }) do
    local out, st = launch("", c[1], "-e 'print(1)'")
    support.eq(st, 2, c[1] .. ": exit status")
    assert(out:find(c[2], 1, true) and not out:find("\n.", 1, false), c[1] .. ":\n" .. out)
  end
  local out, st = launch("LZ_MIN_RANKS=5", "-n 2 --restarts 1", "-e 'print(1)'")
  support.eq(st, 2, "LZ_MIN_RANKS=5: exit status")
  assert(out:find("LZ_MIN_RANKS 5 is more than -n 2", 1, true), out)
  -- The ranks see the job's restarts; a flag wins over LZ_RESTARTS.
  local show = q('if os.getenv("RANK") == "0" then print("restarts " .. os.getenv("LZ_RESTARTS")) end')
  out = launch("LZ_RESTARTS=3", "-n 2", "-e " .. show)
  assert(out:find("restarts 3", 1, true), out)
  out = launch("LZ_RESTARTS=3", "-n 2 --restarts 1", "-e " .. show)
  assert(out:find("restarts 1", 1, true), out)
end

return T
