-- test_paths.lua — every file a run touches, declared once (io/paths.lua):
-- an output that is an input (the same inode through a hard link or a
-- symlink too), that sits in an input folder read whole, or a folder
-- output that would write over an input, is refused in one line naming
-- both; the scripts declare their flags' and configuration's files
-- (flops_profiler.output_file naming --data is refused, the corpus
-- intact); outputs on a full disk fail with exit status 1 and leave no
-- file behind and the earlier one whole (generate --out, --profile-json,
-- a TensorBoard events file); and no code writes a file except through the
-- checked writers (a scan of the sources).
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local paths = require("luazero.io.paths")

local T = {}
local eq, q = support.eq, support.quote

local function refused(p, needle)
  local ok, err = pcall(p.check, p)
  assert(not ok, "expected a refusal mentioning " .. needle)
  assert(tostring(err):find(needle, 1, true), tostring(err))
  assert(not tostring(err):find("\n"), "one line: " .. tostring(err))
  return tostring(err)
end

function T.an_output_that_is_an_input_is_refused_through_links()
  local write, dir = support.scratch()
  local data = write("corpus.txt", "abc")
  os.execute(("ln %s %s/hard.txt && ln -s %s %s/soft.txt && mkdir %s/sub")
             :format(q(data), q(dir), q(data), q(dir), q(dir)))
  for _, out in ipairs({ data, dir .. "/hard.txt", dir .. "/soft.txt", dir .. "/sub/../corpus.txt" }) do
    local err = refused(paths.new():read("--data", data):write("--log", out),
                        "--log " .. out .. " is the same file as --data " .. data)
    assert(err:find("give another path", 1, true), err)
  end
  -- a new name beside it is fine, and so is a new name in a folder not read whole
  paths.new():read("--data", data):write("--log", dir .. "/log.jsonl"):check()
  paths.new():read("--load", dir):write("--out", dir .. "/new.jsonl"):check()
  -- a file the folder already holds would be replaced
  refused(paths.new():read("--load", dir):write("--out", data), "is inside --load")
  -- nothing may be written into a model folder read whole
  refused(paths.new():read("--hf", dir, { whole = true }):write("--out", dir .. "/new.jsonl"),
          "--out " .. dir .. "/new.jsonl is inside --hf")
  -- two outputs that are one file
  refused(paths.new():write("--log", dir .. "/a"):write("--profile-json", dir .. "/sub/../a"),
          "--log " .. dir .. "/a is the same file as " ..
          "--profile-json " .. dir .. "/sub/../a; one would overwrite the other")
  refused(paths.new():write("--log", dir .. "/latest"):write_in("--save", dir, { "^latest$" }),
          "--log " .. dir .. "/latest is a name made by --save " .. dir)
  paths.new():write("--log", dir .. "/log.jsonl"):write_in("--save", dir, { "^latest$" }):check()
end

function T.a_folder_output_refuses_only_what_it_would_write_over()
  local write, dir = support.scratch()
  local data = write("corpus.txt", "abc")
  local latest = write("latest", "step-000001\n")
  local names = { "^step%-%d+$", "^latest$" }
  -- data beside the checkpoints: untouched by a save
  paths.new():read("--data", data):write_in("--save", dir, names):check()
  refused(paths.new():read("--data", latest):write_in("--save", dir, names),
          "--save " .. dir .. " is the folder holding --data " .. latest)
  refused(paths.new():read("--data", data):write_in("--save", data, names),
          "is the same file as --data")
  -- the folder it resumes from is its own
  paths.new():read("--resume", dir):write_in("--save", dir, names, { ["--resume"] = true }):check()
  refused(paths.new():read("--init", dir, { whole = true }):write_in("--save", dir .. "/ck", names),
          "is inside --init")
end

------------------------------------------------------------- the scripts

local MODEL = support.GPT2_1L .. " --micro-batch 2 --steps 2 "

local function script(name, flags, env)
  return support.sh(("cd %s && %s %s scripts/%s.lua %s"):format(q(lz.root), env or "",
                    q(lz.executable()), name, flags))
end

function T.flops_profiler_output_file_naming_the_data_is_refused()
  local write, dir, corpus = support.scratch_corpus(support.HAMLET, 40)
  local before = lz.read_file(corpus)
  os.execute(("ln %s %s/linked.txt"):format(q(corpus), q(dir)))
  for _, target in ipairs({ corpus, dir .. "/linked.txt" }) do
    local cfg = write("ds.json", ('{"flops_profiler": {"enabled": true, "output_file": "%s"}}')
                                 :format(target))
    local out, st = script("train", MODEL .. ("--data %s --config %s"):format(q(corpus), q(cfg)))
    eq(st, 2, "exit status: " .. out)
    assert(out:find("train: flops_profiler.output_file " .. target .. " is the same file as " ..
                    "--data " .. corpus, 1, true), out)
    assert(not out:find("step     1", 1, true), "refused before the first step: " .. out)
    eq(lz.read_file(corpus), before, "the corpus stays whole")
  end
  -- a csv_monitor folder whose files would write over the data
  local csv_data = write("Train_Samples_lr.csv", support.HAMLET:rep(40))
  local cfg = write("ds.json", ('{"csv_monitor": {"enabled": true, "output_path": "%s", ' ..
                                '"job_name": "."}}'):format(dir))
  local out, st = script("train", MODEL .. ("--data %s --config %s"):format(q(csv_data), q(cfg)))
  eq(st, 2, "exit status: " .. out)
  assert(out:find("is the folder holding --data " .. csv_data, 1, true), out)
end

-- scripts/sweep.lua declares its sweep file and the names it makes in --out.
function T.a_sweep_out_folder_that_would_write_over_the_sweep_file_is_refused()
  local write, dir = support.scratch()
  local file = write("results.md", lz.read_file(lz.root .. "/sweeps/example.lua"))
  local out, st = script("sweep", ("%s --out %s"):format(q(file), q(dir)))
  eq(st, 2, out)
  assert(out:find("sweep: --out " .. dir .. " is the folder holding the sweep file " .. file, 1, true),
         out)
  eq(lz.read_file(file), lz.read_file(lz.root .. "/sweeps/example.lua"), "the sweep file")
end

-- A full disk as LZ_WRITE_FAIL_AFTER_BYTES makes one (io/atomic.lua).
local FULL = "LZ_WRITE_FAIL_AFTER_BYTES=0"

function T.outputs_on_a_full_disk_fail_with_exit_1_and_leave_nothing()
  local _, dir, corpus = support.scratch_corpus(support.HAMLET, 40)
  local out, st = script("train", MODEL .. ("--data %s --save %s/ck"):format(q(corpus), q(dir)))
  assert(st == 0, out)
  -- generate --out: no new file; an earlier one stays as it was
  out, st = script("generate", ("--load %s/ck --prompt-ids 1,2 --max-new-tokens 2 --out %s/o.jsonl")
                               :format(q(dir), q(dir)), FULL)
  eq(st, 1, "generate --out on a full disk: " .. out)
  assert(out:find("generate: " .. dir .. "/o.jsonl: writing failed after 0 of", 1, true), out)
  assert(not lz.read_file(dir .. "/o.jsonl"), "no file left behind")
  support.write(dir .. "/o.jsonl", "earlier\n")
  out, st = script("generate", ("--load %s/ck --prompt-ids 1,2 --max-new-tokens 2 --out %s/o.jsonl")
                               :format(q(dir), q(dir)), FULL)
  eq(st, 1, out)
  eq(lz.read_file(dir .. "/o.jsonl"), "earlier\n", "the earlier file untouched")
  -- --profile-json
  out, st = script("train", MODEL .. ("--data %s --profile-json %s/p.json")
                                     :format(q(corpus), q(dir)), FULL)
  eq(st, 1, "--profile-json on a full disk: " .. out)
  assert(out:find(dir .. "/p.json: writing failed after 0 of", 1, true), out)
  assert(not lz.read_file(dir .. "/p.json"), "no profile file left behind")
  -- TensorBoard under a file size limit of 0: the step fails, no empty events file
  local cfg = support.write(dir .. "/tb.json", ('{"tensorboard": {"enabled": true, ' ..
                            '"output_path": "%s", "job_name": "tb"}}'):format(dir))
  out, st = support.sh(("cd %s && sh -c %s"):format(q(lz.root), q(("trap '' XFSZ; ulimit -f 0; " ..
                       "exec %s scripts/train.lua %s --data %s --config %s")
                       :format(q(lz.executable()), MODEL, q(corpus), q(cfg)))))
  eq(st, 1, "tensorboard on a full disk: " .. out)
  assert(out:find("train: tensorboard: writing step 1 failed", 1, true), out)
  local left = support.sh("ls -A " .. q(dir .. "/tb"))
  eq(left, "", "no events file left behind")
end

--------------------------------------------------------- the code scan

-- The files allowed to open a file for writing or rename one, each with
-- the reason. Everything else writes through these.
local WRITERS = {
  ["lua/luazero/io/atomic.lua"] = "the checked writer: temporary, checked writes, fsync, rename",
  ["lua/luazero/jsonl.lua"] = "the record appender (--log, monitors): one checked write per " ..
                              "record, cut back to the last whole record on failure",
  ["core/io/checkpoint.c"] = "atomic.lua's C twin: shards and small files of checkpoints, " ..
                             "temporary, checked writes, fsync, rename",
  ["core/io/swap.c"] = "NVMe swap files: made O_EXCL and unlinked at once, never a user's file",
  ["core/mem/shared_mem.c"] = "the memory the ranks share, under /dev/shm",
  ["core/comm/comm_shm.c"] = "the shm backend's segment, shared with the other ranks",
  ["core/comm/comm_shm_group.c"] = "a group's segment: a memfd its leader makes, which the " ..
                                   "group's other ranks open through /proc; no named file",
  ["core/comm/comm_nccl.c"] = "the NCCL id handed to the other ranks through a file of its own",
  ["core/launch/launch.c"] = "/dev/null for the children's streams",
  ["lua/luazero/checkpoint/lock.lua"] = "a --save folder's .lock: one pid, held by flock while " ..
                                        "the run lives, never a user's file",
  ["tools/gen-cdef.lua"] = "a developer's tool that regenerates lua/luazero/cdef.lua from the " ..
                           "header, run by hand",
}

-- Lines that open a file for writing or rename one: "path:line: text".
local function writes_in(path, text)
  local hits, lua = {}, path:match("%.lua$")
  local n = 0
  for line in (text .. "\n"):gmatch("([^\n]*)\n") do
    n = n + 1
    local code = lua and line:gsub("%-%-.*$", "") or line:gsub("//.*$", "")
    local hit
    if lua then
      local mode = code:match("io%.open%s*%b()") and code:match("io%.open%s*%((.*)%)")
      hit = (mode and mode:match(",%s*[\"'][^\"']*[wa+]")) or code:find("os%.rename%s*%(") or
            code:find("C%.rename%s*%(") or code:find("io%.output%s*%(") or
            (code:find("C%.open%s*%(") and code:find("O_CREAT"))
    else
      hit = (code:find("fopen%s*%(") and code:find(",%s*\"[^\"]*[wa+]")) or
            code:find("[^_%w]rename%s*%(") or code:find("[^_%w]creat%s*%(") or
            (code:find("[^_%w]open%s*%(") and (code:find("O_CREAT") or code:find("O_WRONLY") or
                                                code:find("O_RDWR")))
    end
    if hit then hits[#hits + 1] = ("%s:%d: %s"):format(path, n, line:gsub("^%s+", "")) end
  end
  return hits
end

local function sources()
  local p = io.popen(("cd %s && find lua scripts tools models core cuda -type f \\( -name '*.lua' " ..
                      "-o -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \\) | sort")
                     :format(q(lz.root)))
  local list = {}
  for l in p:lines() do list[#list + 1] = l end
  p:close()
  return list
end

function T.no_code_writes_a_file_outside_the_checked_writers()
  local bad, seen = {}, {}
  for _, path in ipairs(sources()) do
    local hits = writes_in(path, assert(lz.read_file(lz.root .. "/" .. path)))
    if #hits > 0 then
      seen[path] = true
      if not WRITERS[path] then
        for _, h in ipairs(hits) do bad[#bad + 1] = h end
      end
    end
  end
  assert(#bad == 0, "files written outside io/atomic.lua, jsonl.lua and their C twin " ..
                    "(write through them, or add the file to WRITERS with the reason):\n" ..
                    table.concat(bad, "\n"))
  -- the scan sees what it is meant to: each allowed file writes, and a
  -- planted line is caught
  for path in pairs(WRITERS) do assert(seen[path], path .. " is allowed but writes nothing") end
  eq(#writes_in("x.lua", 'local f = io.open(path, "w")'), 1, "io.open for writing")
  eq(#writes_in("x.lua", 'local f = io.open(path, "rb")'), 0, "io.open for reading")
  eq(#writes_in("x.lua", 'os.rename(a, b)'), 1, "os.rename")
  eq(#writes_in("x.c", 'FILE *f = fopen(p, "ab");'), 1, "fopen for appending")
  eq(#writes_in("x.c", 'int fd = open(p, O_WRONLY | O_CREAT, 0644);'), 1, "open(2) for writing")
end

return T
