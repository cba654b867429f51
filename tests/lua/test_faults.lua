-- test_faults.lua — scripts/train.lua under the faults a user meets:
-- resuming into a --save folder that went further (--keep, a rewound
-- history), a changed manifest.json, a --save or --log target that cannot
-- take the run, a rank's own error, --steps below the checkpoint, bad flags
-- and data paths, errors that must stay one line, and SIGKILL of a rank or
-- the launcher at random moments while saving every step.
local ffi = require("ffi")
local bit = require("bit")
local lz = require("luazero")
local cjson = require("cjson")
local clock = require("luazero.clock")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local checkpoint = require("luazero.checkpoint")

local T = {}
local root, q, sh = lz.root, support.quote, support.sh
local write_file, tmp, corpus = support.scratch_corpus(support.HAMLET, 40)
local MODEL = support.GPT2_1L .. " --micro-batch 2 --data " .. q(corpus)

local train, ok_train = support.trainer(MODEL)

-- MODEL without its --NAME VALUE for each name, for a run that gives its
-- own (a flag is given once).
local function model_but(...)
  local m = MODEL
  for _, name in ipairs({ ... }) do
    m = m:gsub("%-%-" .. name:gsub("%-", "%%-") .. " %S+ ?", "")
  end
  return m
end

-- A failed run: exit status `status`, every needle in its output, no
-- traceback, no step run when `before_step_1`.
local function fails(n, flags, status, needles, opts)
  opts = opts or {}
  local out, st = (opts.model and support.trainer(opts.model) or train)(n, flags, opts.env)
  assert(st == status, ("exit %s, expected %d:\n%s"):format(tostring(st), status, out))
  for _, needle in ipairs(needles) do
    assert(out:find(needle, 1, true), ("output does not mention %q:\n%s"):format(needle, out))
  end
  assert(not out:find("traceback", 1, true), "a traceback:\n" .. out)
  if opts.before_step_1 then assert(not out:find("step +1/", 1), "a step ran:\n" .. out) end
  return out
end

local function read(path) return (lz.read_file(path)) end -- nil where there is none yet
local put = support.write

local function ls(dir)
  local out = sh("ls -a " .. q(dir))
  return out
end

local function count(s, needle)
  local n, i = 0, 1
  while true do
    local a, b = s:find(needle, i, true)
    if not a then return n end
    n, i = n + 1, b + 1
  end
end

-------------------------------------------------------- 1. --keep, history

function T.keep_spares_the_new_and_resumed_checkpoints_and_a_rewind_sets_history_aside()
  local dir = tmp .. "/rewind"
  ok_train(1, "--steps 12 --save " .. q(dir) .. " --save-every 2")
  -- A crashed save's temporary folder (its process is gone), and a crashed
  -- 16-bit export's inside a step folder.
  os.execute("mkdir -p " .. q(dir .. "/.step-000013.tmp-999999999"))
  os.execute("mkdir -p " .. q(dir .. "/step-000004/.hf16.tmp-999999999/x"))
  local out = ok_train(1, "--steps 5 --keep 2 --save " .. q(dir) .. " --resume " ..
                       q(dir .. "/step-000004"))
  assert(out:find("saved " .. dir .. "/step-000005", 1, true), out)
  assert(out:find("step-000006..step-000012 in " .. dir .. " (4 folders", 1, true), out)
  local names = ls(dir)
  assert(read(dir .. "/latest") == "step-000005\n", "latest: " .. tostring(read(dir .. "/latest")))
  assert(names:find("step-000005", 1, true) and names:find("step-000004", 1, true), names)
  assert(not ls(dir .. "/step-000004"):find(".hf16.tmp-", 1, true), "a dead export's temporary")
  for _, gone in ipairs({ "step-000002", "step-000006", "step-000012", ".tmp-" }) do
    assert(not names:find(gone, 1, true), gone .. " is still in " .. dir .. ":\n" .. names)
  end
  local aside = assert(names:match("(%.abandoned%-%S+)"), names)
  local kept = ls(dir .. "/" .. aside)
  for s = 6, 12, 2 do assert(kept:find(("step-%06d"):format(s), 1, true), kept) end
  -- The next resume of the folder continues the new history.
  out = ok_train(1, "--steps 6 --keep 2 --save " .. q(dir) .. " --resume " .. q(dir))
  assert(out:find("resumed from " .. dir .. "/step-000005: step 5", 1, true), out)
  names = ls(dir)
  assert(names:find("step-000006", 1, true) and names:find("step-000005", 1, true) and
         not names:find("step-000004", 1, true), names)
  -- A second rewind sets step 6 aside; --keep then removes the older
  -- set-aside history and keeps the newest (disk use stays bounded).
  os.execute("sleep 1.1") -- (set-aside folders are named to the second)
  out = ok_train(1, "--steps 6 --keep 2 --save " .. q(dir) .. " --resume " ..
                 q(dir .. "/step-000005"))
  names = ls(dir)
  local asides = {}
  for a in names:gmatch("(%.abandoned%-%S+)") do asides[#asides + 1] = a end
  assert(#asides == 1 and asides[1] ~= aside and
         ls(dir .. "/" .. asides[1]):find("step-000006", 1, true),
         names .. out)
end

-- A resume through a symbolic link to a step folder of the --save folder
-- spares that folder as a resume by its own name does (--keep 1 would
-- otherwise remove it, leaving the link to nothing).
function T.keep_spares_a_resumed_folder_named_through_a_link()
  local dir = tmp .. "/linked"
  ok_train(1, "--steps 4 --save " .. q(dir) .. " --save-every 2")
  local link = tmp .. "/linked-step"
  os.execute(("ln -sfn %s %s"):format(q(dir .. "/step-000002"), q(link)))
  ok_train(1, "--steps 3 --keep 1 --save " .. q(dir) .. " --resume " .. q(link))
  local names = ls(dir)
  assert(names:find("step-000002", 1, true) and names:find("step-000003", 1, true), names)
end

---------------------------------------------------- 2. manifest checksum

function T.manifest_with_any_byte_changed_is_refused()
  local dir = tmp .. "/manifest"
  ok_train(1, "--steps 2 --save " .. q(dir))
  local step = dir .. "/step-000002"
  local path = step .. "/manifest.json"
  local text = read(path)
  local manifest = checkpoint.manifest
  assert(manifest.decode(text, path).version == 2)
  -- Every byte, one bit flipped: refused, naming the file.
  for i = 1, #text do
    local bad = text:sub(1, i - 1) .. string.char(bit.bxor(text:byte(i), 1)) .. text:sub(i + 1)
    local ok, err = pcall(manifest.decode, bad, path)
    assert(not ok, ("byte %d (%q) flipped was accepted"):format(i, text:sub(i, i)))
    assert(tostring(err):find("checkpoint: " .. path, 1, true), err)
  end
  -- End to end: another data stream, more skipped steps.
  local rng = assert(text:match('"rng_state":"(%x+)"'))
  local other = (rng:sub(1, 1) == "1" and "2" or "1") .. rng:sub(2)
  put(path, (text:gsub(rng, other)))
  fails(1, "--steps 3 --resume " .. q(dir), 2, { path, "manifest_xxh64" })
  put(path, (text:gsub('"skipped_steps":0', '"skipped_steps":4')))
  fails(1, "--steps 3 --resume " .. q(dir), 2, { path, "skipped_steps" })
  -- A version 1 manifest (no checksum) still loads.
  local v1 = text:gsub(',"manifest_xxh64":"%x+"}\n$', "}"):gsub('"version":2', '"version":1')
  put(path, v1)
  ok_train(1, "--steps 3 --resume " .. q(dir))
  put(path, text)
end

------------------------------------------------ 3. --save before step 1

function T.save_target_is_checked_before_step_1()
  local file = write_file("a-file", "x")
  fails(1, "--steps 2 --save " .. q(file), 2, { "--save " .. file, "not a folder" },
        { before_step_1 = true })
  fails(1, "--steps 2 --save-zstd-level 25", 2, { "--save-zstd-level must be 1..19 (got 25)" },
        { before_step_1 = true })
  local help = train(1, "--help")
  assert(help:find("(1..19", 1, true), help)
  local ro, small = tmp .. "/ro", tmp .. "/small"
  os.execute(("mkdir -p %s %s"):format(q(ro), q(small)))
  if not os.execute(("mount -t tmpfs -o ro,size=64k tmpfs %s 2>/dev/null"):format(q(ro))) then
    print("    (skipped the read-only and full folders: mount needs root)")
    return
  end
  os.execute(("mount -t tmpfs -o size=64k tmpfs %s"):format(q(small)))
  local ok, err = pcall(function()
    fails(1, "--steps 2 --save " .. q(ro .. "/ck"), 2, { "Read-only file system" },
          { before_step_1 = true })
    fails(1, "--steps 2 --save " .. q(small .. "/ck"), 2, { "free", "one checkpoint needs" },
          { before_step_1 = true })
  end)
  os.execute(("umount %s %s"):format(q(ro), q(small)))
  assert(ok, err)
end

-- A script run alone (no launcher to say it) stopped by SIGTERM says so on
-- stderr and dies of the signal (status 143).
function T.a_script_alone_stopped_by_sigterm_says_so()
  local err = tmp .. "/sigterm.err"
  local out = sh(("%s -e 'require(\"luazero.clock\").sleep(30)' 2>%s & p=$!; sleep 1; " ..
                  "kill -TERM $p; wait $p; echo status=$?"):format(q(lz.executable()), q(err)))
  assert(out:find("status=143", 1, true), out)
  local said = read(err) or ""
  assert(said:find("luazero: received SIGTERM; stopping", 1, true), said)
end

-- A --save folder another live run holds (here this process, through the
-- lock a run takes) is refused before step 1, naming that run; what a dead
-- save left there is cleared at start, so its space counts as free.
function T.a_save_folder_another_run_holds_is_refused()
  local dir = tmp .. "/held"
  os.execute("mkdir -p " .. q(dir))
  local lock = require("luazero.checkpoint.lock")
  assert(lock.claim(dir) == true and lock.claim(dir) == false, "a second claim is this run's")
  -- a folder removed and made again under a held lock is claimed anew
  local again = tmp .. "/again"
  os.execute("mkdir -p " .. q(again))
  assert(lock.claim(again) == true)
  os.execute(("rm -rf %s && mkdir %s"):format(q(again), q(again)))
  assert(lock.claim(again) == true and read(again .. "/.lock"), "the new folder is locked")
  local pid = tonumber(require("ffi").C.getpid())
  fails(1, "--steps 2 --save " .. q(dir), 2,
        { ("--save %s is in use by another run (pid %d, which holds %s/.lock)"):format(dir, pid, dir),
          "give this run another --save folder, or stop that run first" }, { before_step_1 = true })
  -- a dead save's leftover (pid 2^22 + 1 runs nowhere) is gone before step 1
  local free = tmp .. "/free"
  os.execute(("mkdir -p %s/.step-000002.tmp-4194305"):format(q(free)))
  fails(1, "--steps 2 --save " .. q(free) .. " --stage auto --micro-batch 100000000", 2,
        { "stage auto:" }, { model = model_but("micro-batch") })
  local left = ls(free)
  assert(not left:find("tmp-4194305", 1, true), left)
end

----------------------------------------------------- 4. --log write fails

function T.log_write_failure_stops_the_run_and_keeps_whole_records()
  fails(1, "--steps 3 --log /dev/full", 1, { "--log /dev/full: writing step 1's record failed",
                                            "No space left on device" })
  local small = tmp .. "/logfs"
  os.execute("mkdir -p " .. q(small))
  if not os.execute(("mount -t tmpfs -o size=4k tmpfs %s 2>/dev/null"):format(q(small))) then
    print("    (skipped the full folder: mount needs root)")
    return
  end
  local log = small .. "/run.jsonl"
  local ok, err = pcall(function()
    fails(1, "--steps 60 --log " .. q(log), 1, { "--log " .. log, "No space left on device",
                                                 "ends at the record before it" })
    local text = read(log)
    assert(#text > 0 and text:sub(-1) == "\n", "the log does not end with a whole line")
    local n = 0
    for line in text:gmatch("[^\n]+") do
      n = n + 1
      assert(cjson.decode(line).step == n, "record " .. n .. ": " .. line)
    end
    assert(n > 0 and n < 60, n .. " records")
  end)
  os.execute("umount " .. q(small))
  assert(ok, err)
end

---------------------------------------------------- 5. another rank's error

function T.an_error_on_rank_1_alone_is_shown_once_with_its_rank()
  local dir = tmp .. "/rank1"
  ok_train(2, "--steps 2 --stage 1 --save " .. q(dir))
  local shard = dir .. "/step-000002/shard-00001-of-00002.zst"
  local good = read(shard)
  local mid = math.floor(#good / 2)
  put(shard, good:sub(1, mid) .. string.char(bit.bxor(good:byte(mid + 1), 1)) .. good:sub(mid + 2))
  -- (exit 2, a damaged input, as at one rank: the rank that met it is the
  -- job's status)
  local out = fails(2, "--steps 3 --stage 1 --resume " .. q(dir), 2,
                    { "[rank 1] train: checkpoint: " .. shard, "failed on rank 1" })
  assert(count(out, "shard-00001-of-00002.zst: xxh64") == 1, out)
  put(shard, good)
end

---------------------------------------------- 6. --steps below the checkpoint

function T.steps_below_the_checkpoint_is_an_error_with_the_numbers()
  local dir = tmp .. "/below"
  ok_train(1, "--steps 6 --save " .. q(dir))
  fails(1, "--steps 4 --resume " .. q(dir), 2,
        { "--steps 4 is below the checkpoint's step 6", "--steps 6 or more" },
        { before_step_1 = true })
end

----------------------------------------------------- 9. flags and data paths

function T.numeric_flags_and_data_paths_are_named()
  fails(1, "--steps 2 --micro-batch 1e300", 2, { "--micro-batch: '1e300' is out of range" },
        { model = model_but("micro-batch") })
  fails(1, "--steps 2 --seed 1e19", 2, { "--seed: '1e19' is out of range" },
        { model = model_but("seed") })
  fails(1, "--steps 2 --seed 3 --seed 4", 2, { "--seed is given twice (--seed 3, then --seed 4)" },
        { model = model_but("seed") })
  local out, st = sh(("cd %s && %s scripts/train.lua %s --steps 2 --data %s"):format(q(root),
                     q(lz.executable()), model_but("data"), q(tmp)))
  assert(st == 2 and out:find(tmp .. ": is a folder", 1, true) and not out:find("tensor_new"),
         out)
  local fifo = tmp .. "/fifo"
  os.execute("mkfifo " .. q(fifo))
  -- No writer on the FIFO: refused, not waited on.
  out, st = sh(("cd %s && timeout 20 %s scripts/train.lua %s --steps 2 --data %s"):format(q(root),
               q(lz.executable()), model_but("data"), q(fifo)))
  assert(st == 2 and out:find("is a pipe or a stream", 1, true) and
         out:find("not supported", 1, true), out)
end

----------------------------------------------- 10. one line per problem

function T.errors_are_one_line_without_lz_debug()
  -- Activations that do not fit: the flags that lower them.
  local out = fails(1, "--steps 1 --micro-batch 20000000", 1,
                    { "for activations failed", "--micro-batch", "--checkpoint-activations" },
                    { model = model_but("micro-batch") })
  assert(not out:find("gpt2.lua:", 1, true), out)
  -- LZ_MEMORY_BUDGET: once, from rank 0, before any work.
  out = fails(2, "--steps 1", 2, { "LZ_MEMORY_BUDGET=xyz" },
              { env = "LZ_MEMORY_BUDGET=xyz", before_step_1 = true })
  assert(count(out, "LZ_MEMORY_BUDGET=xyz") == 1 and not out:find("^model"), out)
  -- The engine's own checks: a parameter slice above offload_param.buffer_size
  -- (the configuration's to fix: exit 2, as bad input).
  local cfg = write_file("buffer.json", cjson.encode({
    train_micro_batch_size_per_gpu = 2,
    zero_optimization = { stage = 3, offload_param = { device = "nvme", nvme_path = tmp,
                                                       buffer_size = 10 } } }))
  fails(1, "--steps 1 --config " .. q(cfg), 2, { "offload_param.buffer_size 10" })
  -- With LZ_DEBUG=1 the traceback is back.
  out = train(1, "--steps 1 --config " .. q(cfg), "LZ_DEBUG=1")
  assert(out:find("traceback", 1, true), out)
  -- The executable: a luazero message loses the Lua location, others keep it.
  local exe = q(lz.executable())
  out = sh(("cd %s && printf 'error(\"comm: x\")' > %s/e.lua && %s %s/e.lua"):format(q(root),
           q(tmp), exe, q(tmp)))
  assert(out:match("^luazero: comm: x\n$"), out)
  out = sh(("printf 'local t = nil\\nreturn t.x' > %s/n.lua && %s %s/n.lua"):format(q(tmp), exe,
           q(tmp)))
  assert(out:find("n.lua:2: attempt to index", 1, true) and out:find("LZ_DEBUG=1", 1, true) and
         not out:find("traceback:", 1, true), out)
end

function T.a_full_nvme_path_is_one_line()
  local img, mnt = tmp .. "/nvme.img", tmp .. "/nvme"
  os.execute("mkdir -p " .. q(mnt))
  if not os.execute(("dd if=/dev/zero of=%s bs=1M count=2 2>/dev/null && mkfs.ext4 -q -F %s " ..
                     "2>/dev/null && mount -o loop %s %s 2>/dev/null"):format(q(img), q(img),
                     q(img), q(mnt))) then
    print("    (skipped: a small ext4 loop mount needs root and mkfs.ext4)")
    return
  end
  local cfg = write_file("nvme.json", cjson.encode({
    train_micro_batch_size_per_gpu = 2,
    zero_optimization = { stage = 2, offload_optimizer = { device = "nvme", nvme_path = mnt } } }))
  local ok, err = pcall(fails, 1, "--steps 1 --n-embd 128 --n-head 4 --config " .. q(cfg), 1,
                        { mnt, "No space left on device", "larger disk" },
                        { before_step_1 = true, model = model_but("n-embd", "n-head") })
  os.execute("umount " .. q(mnt))
  assert(ok, err)
end

function T.a_stopped_rank_ends_the_run_with_one_line()
  local pidfile = tmp .. "/stopped.pid"
  local outfile = tmp .. "/stopped.out"
  os.execute(("cd %s && (sh -c 'echo $$ > %s; exec env LZ_COMM_TIMEOUT=2 %s -n 2 " ..
              "scripts/train.lua %s --steps 3000' > %s 2>&1; echo \"EXIT:$?\" >> %s) &")
             :format(q(root), q(pidfile), q(lz.executable()), MODEL:gsub("'", "'\\''"),
                     q(outfile), q(outfile)))
  local t0 = clock.now()
  while not (read(outfile) or ""):find("step +2/") and clock.now() - t0 < 30 do clock.sleep(0.1) end
  local launcher = assert(tonumber(read(pidfile)), "no launcher pid")
  local ok, err = pcall(function()
    local kids = read(("/proc/%d/task/%d/children"):format(launcher, launcher)) or ""
    local rank1 = assert(tonumber(kids:match("%d+%s+(%d+)")), "no rank 1 among " .. kids)
    os.execute("kill -STOP " .. rank1)
    while not (read(outfile) or ""):find("EXIT:") and clock.now() - t0 < 30 do clock.sleep(0.2) end
    os.execute("kill -CONT " .. rank1 .. " 2>/dev/null")
    local out = read(outfile)
    assert(out:find("EXIT:1", 1, true), out:sub(-2000))
    assert(out:match("train: [%w_]+: rank 0 waited [%d.]+ s %(LZ_COMM_TIMEOUT%) for ranks 1"),
           out:sub(-2000))
    -- (said while it waited, a third of the timeout in)
    assert(out:match("luazero: [%w_]+: rank 0 has waited 1 s for ranks 1 %(a rank stuck or " ..
                     "busy elsewhere%); LZ_COMM_TIMEOUT stops the run at 2 s"), out:sub(-2000))
    assert(not out:find("traceback", 1, true), out:sub(-2000))
  end)
  os.execute("kill -KILL " .. launcher .. " 2>/dev/null") -- whatever happened
  assert(ok, err)
end

function T.os_exit_in_the_multi_rank_repl_ends_every_rank_cleanly()
  local out, st = sh(("cd %s && printf 'x = 1\\nos.exit(0)\\n' | LZ_COMM_TIMEOUT=3 timeout 30 " ..
                      "%s -n 2 -i -e 'y = 1'"):format(q(root), q(lz.executable())))
  assert(st == 0, ("exit %s:\n%s"):format(tostring(st), out))
  assert(not out:find("traceback", 1, true) and not out:find("waited", 1, true), out)
end

-- Commands piped into the REPL: a chunk that fails, a syntax error or one
-- left unfinished at the end of the input makes the exit status 1 (a script
-- of commands can be checked by it); all fine, 0.
function T.a_piped_repl_exits_1_when_a_command_fails()
  for input, want in pairs({ ["x = 1\\nprint(x)\\n"] = 0, ["error(\"boom\")\\nx = 1\\n"] = 1,
                             ["x = = 1\\n"] = 1, ["x = 1 +\\n"] = 1 }) do
    local out, st = sh(("cd %s && printf '%s' | timeout 30 %s"):format(q(root), input,
                                                                     q(lz.executable())))
    assert(st == want, ("%s: exit %s, not %d:\n%s"):format(input, tostring(st), want, out))
    if input == "x = 1 +\\n" then
      assert(out:find("input ended inside an unfinished chunk, not run: x = 1 +", 1, true), out)
    end
  end
end

------------------------------------------ acceptance: SIGKILL at random

-- 20 runs of 6 steps on 2 ranks saving every step, each SIGKILLed (a rank or
-- the launcher) at a random moment; then no process of it is left, and the
-- newest `latest` resumes to the params_checksum of a run never stopped.
-- SIGTERM to a run with --save (a script run alone, and a launcher of 2
-- ranks): the run finishes its step, saves it and ends by the signal (exit
-- 143), and --resume from that save goes on bitwise as the run that never
-- stopped. Before, the signal ended it at once, losing every step since the
-- last save. A second SIGTERM a second later stops it at once.
function T.sigterm_saves_the_step_and_the_resume_is_bitwise()
  local cfg = write_file("constant-lr.json", '{"train_micro_batch_size_per_gpu": 2}')
  local exe = q(lz.executable())
  for _, n in ipairs({ 1, 2 }) do
    local dir = ("%s/term-%d"):format(tmp, n)
    local log, pidfile, rcfile = dir .. ".jsonl", dir .. ".pid", dir .. ".rc"
    local launch = n == 1 and exe or exe .. " -n 2"
    os.execute(("cd %s && (%s scripts/train.lua %s --stage 1 --steps 100000 --config %s " ..
                "--save %s --save-every 100000 --log %s > %s.out 2>&1 & echo $! > %s; " ..
                "wait $!; echo $? > %s) 2>/dev/null &")
               :format(q(root), launch, MODEL, q(cfg), q(dir), q(log), q(dir), q(pidfile),
                       q(rcfile)))
    local t0 = clock.now()
    while not (read(log) or ""):find('"step":3[,}]') and clock.now() - t0 < 60 do
      clock.sleep(0.02)
    end
    local pid = assert(tonumber(read(pidfile) or ""), n .. " rank(s): no pid")
    os.execute("kill -TERM " .. pid)
    while not tonumber(read(rcfile) or "") and clock.now() - t0 < 90 do clock.sleep(0.02) end
    local out = read(dir .. ".out") or ""
    support.eq(tonumber(read(rcfile) or ""), 143, n .. " rank(s): exit status\n" .. out)
    local k = tonumber((read(dir .. "/latest") or ""):match("step%-0*(%d+)"))
    assert(k and k >= 3, n .. " rank(s): no save after the signal\n" .. out)
    assert(out:find(("stopped by SIGTERM after step %d, saved: --resume %s goes on from it")
                    :format(k, dir), 1, true) and
           out:find("received SIGTERM: stopping after this step, saving it", 1, true), out)
    local flags = ("--stage 1 --steps %d --config %s"):format(k + 2, q(cfg))
    local _, straight = ok_train(n, flags)
    local _, resumed = ok_train(n, flags .. " --resume " .. q(dir))
    support.eq(resumed, straight, n .. " rank(s): resumed after the signal")
  end
  -- SIGTERM to the ranks (not the launcher) of a job with --restarts: they
  -- stop saved, and the launcher does not restart them (before, it took
  -- their ends for a failure and trained on from the save).
  do
    local dir = tmp .. "/term-restarts"
    local log, pidfile, rcfile = dir .. ".jsonl", dir .. ".pid", dir .. ".rc"
    os.execute(("cd %s && (%s -n 2 --restarts 1 scripts/train.lua %s --stage 1 --steps 100000 " ..
                "--config %s --save %s --save-every 100000 --log %s > %s.out 2>&1 & " ..
                "echo $! > %s; wait $!; echo $? > %s) 2>/dev/null &")
               :format(q(root), exe, MODEL, q(cfg), q(dir), q(log), q(dir), q(pidfile), q(rcfile)))
    local t0 = clock.now()
    while not (read(log) or ""):find('"step":3[,}]') and clock.now() - t0 < 60 do
      clock.sleep(0.02)
    end
    local launcher = assert(tonumber(read(pidfile) or ""), "no launcher pid")
    local kids = read(("/proc/%d/task/%d/children"):format(launcher, launcher)) or ""
    os.execute("kill -TERM " .. kids:gsub("%s+", " "))
    while not tonumber(read(rcfile) or "") and clock.now() - t0 < 90 do clock.sleep(0.02) end
    local out = read(dir .. ".out") or ""
    support.eq(tonumber(read(rcfile) or ""), 143, "--restarts, SIGTERM to the ranks\n" .. out)
    assert(out:find("stopped on SIGTERM: not restarting", 1, true) and
           not out:find("restart 1 of 1", 1, true), out)
  end
  -- A second SIGTERM within a second is the same request (Ctrl-C reaches
  -- the ranks, then the launcher relays it); a second later, it ends the
  -- process at once.
  local script = write_file("twice.lua", [[
local ffi = require("ffi")
pcall(ffi.cdef, "int kill(int pid, int sig); int getpid(void); int poll(void *f, unsigned long n, int t);")
LUAZERO_SIGNALS.graceful()
ffi.C.kill(ffi.C.getpid(), 15)
io.stderr:write("pending " .. LUAZERO_SIGNALS.pending() .. "\n")
ffi.C.poll(nil, 0, tonumber(arg[1]))
ffi.C.kill(ffi.C.getpid(), 15)
io.stderr:write("survived\n")
]])
  local out, st = sh(exe .. " " .. q(script) .. " 100")
  assert(st == 0 and out:find("pending 15\nsurvived", 1, true), out)
  out, st = sh(exe .. " " .. q(script) .. " 1100")
  assert(st == 143 and out:find("pending 15", 1, true) and not out:find("survived", 1, true) and
         out:find("luazero: received the signal again; stopping at once", 1, true),
         st .. "\n" .. out)
end

function T.sigkill_at_random_moments_then_latest_resumes_to_the_same_checksum()
  local flags = "--steps 6 --stage 1 --save-every 1"
  local _, straight = ok_train(2, "--steps 6 --stage 1") -- saves change no number
  local seed = tonumber(os.getenv("LZ_FAULT_SEED") or "") or os.time()
  math.randomseed(seed)
  local exe = q(lz.executable())
  for run = 1, 20 do
    local dir = ("%s/kill-%02d"):format(tmp, run)
    local pidfile, rcfile = dir .. ".pid", dir .. ".rc"
    os.execute(("cd %s && (%s -n 2 scripts/train.lua %s %s --save %s > %s.out 2>&1 & " ..
                "echo $! > %s; wait $!; echo $? > %s) 2>/dev/null &")
               :format(q(root), exe, MODEL, flags, q(dir), q(dir), q(pidfile), q(rcfile)))
    local t0 = clock.now()
    -- (the shell creates the file before it writes the pid into it)
    while not tonumber(read(pidfile) or "") and clock.now() - t0 < 10 do clock.sleep(0.01) end
    local launcher = assert(tonumber(read(pidfile) or ""), ("run %d: no launcher pid"):format(run))
    local delay = math.random() * 0.8
    local target = math.random(3) -- 1: the launcher, 2: rank 0, 3: rank 1
    clock.sleep(delay)
    local victim = launcher
    if target > 1 then
      local kids = read(("/proc/%d/task/%d/children"):format(launcher, launcher)) or ""
      local pids = {}
      for p in kids:gmatch("%d+") do pids[#pids + 1] = tonumber(p) end
      victim = pids[target - 1] or launcher
    end
    os.execute("kill -KILL " .. victim .. " 2>/dev/null")
    while not read(rcfile) and clock.now() - t0 < 30 do clock.sleep(0.02) end
    assert(read(rcfile), ("run %d: the launcher did not end"):format(run))
    -- No process of the run is left (ranks die with the launcher).
    local left
    for _ = 1, 50 do
      left = sh("pgrep -f -- " .. q("--save " .. dir .. "$"))
      if left == "" then break end
      clock.sleep(0.1)
    end
    assert(left == "", ("run %d (seed %d): processes left: %s"):format(run, seed, left))
    local what = ("run %d (seed %d, %s killed after %.2f s)"):format(run, seed,
                 ({ "launcher", "rank 0", "rank 1" })[target], delay)
    local resume = read(dir .. "/latest") and (" --resume " .. q(dir)) or ""
    local out, sum = ok_train(2, flags .. " --save " .. q(dir) .. resume)
    assert(sum == straight, ("%s: resumed to %s, straight %s\n%s"):format(what, sum, straight, out))
    assert(not ls(dir):find(".tmp-", 1, true), what .. ": a temporary folder is left:\n" ..
           ls(dir) .. (read(dir .. ".out") or "") .. out)
  end
end

return T
