-- tests/probe/nothing_lost.lua — the "nothing lost" probe's cases, run as a
-- careful new user would run them: the scripts and tools on scratch files,
-- one case per defect the probe found (an output that destroys an input, a
-- full disk, an option silently ignored, data that trains nothing or is not
-- the checkpoint's) and per cosmetic finding (exit status, one line, the
-- thing and the fix named). Each case checks the exit status, the message
-- and what is left on disk.
--
--   luazero tests/probe/nothing_lost.lua        # ends with "N passed, N failed"
local lz = require("luazero")
local cjson = require("cjson")

local function q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end
local function sh(cmd)
  local p = io.popen(cmd .. " 2>&1; echo \"EXIT:$?\"")
  local out = p:read("*a")
  p:close()
  return out:gsub("EXIT:%d+%s*$", ""), tonumber(out:match("EXIT:(%d+)%s*$"))
end

local dir = os.tmpname()
os.remove(dir)
os.execute("mkdir -p " .. q(dir))
local function path(name) return dir .. "/" .. name end
local function write(name, bytes)
  local f = assert(io.open(path(name), "wb")) -- the probe's own scratch inputs
  f:write(bytes)
  f:close()
  return path(name)
end

local LZ = q(lz.executable())
-- a command of the checkout (scripts/X.lua, tools/X.lua) with env in front
local function run(env, what, args)
  return sh(("cd %s && %s %s %s %s"):format(q(lz.root), env or "", LZ, what, args))
end
local TINY = "--model gpt2-nano --n-layer 1 --n-embd 32 --n-head 2 --context 16 --seq-len 8 " ..
             "--micro-batch 2 --sample 0 --eval-batches 1 --seed 7 --steps 2 "
local FULL = "LZ_WRITE_FAIL_AFTER_BYTES=0"

local passed, failed = 0, 0
local function case(name, fn)
  local ok, err = pcall(fn)
  if ok then
    passed = passed + 1
    print("ok   probe." .. name)
  else
    failed = failed + 1
    print("FAIL probe." .. name .. "\n     " .. tostring(err):gsub("\n", "\n     "))
  end
end
-- out/st must be exit status `code` with one line holding every needle
local function expect(out, st, code, ...)
  assert(st == code, ("exit status %s, expected %d:\n%s"):format(tostring(st), code, out))
  if code ~= 0 then
    local line = out:match("([^\n]*)\n?$")
    assert(not line:find("traceback", 1, true), out)
    for _, n in ipairs({ ... }) do assert(out:find(n, 1, true), ("lacks %q:\n%s"):format(n, out)) end
  end
end
local function same(a, b, what) assert(a == b, what .. ": changed") end
local function gone(p) assert(not lz.read_file(p), p .. " was left behind") end

local corpus = write("corpus.txt", ("To be, or not to be, that is the question.\n"):rep(60))
local original = lz.read_file(corpus)
local out, st = run(nil, "scripts/train.lua", TINY .. ("--data %s --save %s"):format(q(corpus),
                                                                                   q(path("ck"))))
assert(st == 0, out)

case("d1_flops_profiler_output_file_is_the_data", function()
  local cfg = write("fp.json", cjson.encode({ flops_profiler = { enabled = true,
                                                                output_file = corpus } }))
  local o, s = run(nil, "scripts/train.lua", TINY .. ("--data %s --config %s"):format(q(corpus), q(cfg)))
  expect(o, s, 2, "flops_profiler.output_file " .. corpus .. " is the same file as --data")
  same(lz.read_file(corpus), original, "the corpus")
end)

case("d2_generate_out_is_the_prompts_or_a_link_to_them", function()
  local prompts = write("prompts.txt", "To be\n")
  os.execute(("ln -f %s %s"):format(q(prompts), q(path("prompts-link.txt"))))
  for _, target in ipairs({ prompts, path("prompts-link.txt") }) do
    local o, s = run(nil, "scripts/generate.lua", ("--load %s --prompts %s --out %s")
                                                  :format(q(path("ck")), q(prompts), q(target)))
    expect(o, s, 2, "--out " .. target .. " is the same file as --prompts")
    same(lz.read_file(prompts), "To be\n", "the prompts")
  end
end)

case("d3_full_disk_generate_out_and_profile_json_exit_1_leaving_nothing", function()
  local o, s = run(FULL, "scripts/generate.lua", ("--load %s --prompt-ids 1,2 --out %s")
                                                 :format(q(path("ck")), q(path("g.jsonl"))))
  expect(o, s, 1, path("g.jsonl") .. ": writing failed after 0 of")
  gone(path("g.jsonl"))
  o, s = run(FULL, "scripts/train.lua", TINY .. ("--data %s --profile-json %s")
                                                :format(q(corpus), q(path("p.json"))))
  expect(o, s, 1, path("p.json") .. ": writing failed after 0 of")
  gone(path("p.json"))
end)

case("d3_full_disk_tensorboard_leaves_no_empty_events_file", function()
  local cfg = write("tb.json", cjson.encode({ tensorboard = { enabled = true,
                                              output_path = dir, job_name = "tb" } }))
  local o, s = sh(("cd %s && sh -c %s"):format(q(lz.root), q(("trap '' XFSZ; ulimit -f 0; exec %s " ..
                  "scripts/train.lua %s --data %s --config %s"):format(LZ, TINY, q(corpus), q(cfg)))))
  expect(o, s, 1, "tensorboard: writing step 1 failed")
  local left = sh("ls -A " .. q(path("tb")))
  assert(left == "", "left in the folder: " .. left)
end)

case("d4_checkpoint_flags_without_save", function()
  for _, f in ipairs({ "--keep 2", "--save-every 1", "--save-every-minutes 5", "--async-save" }) do
    local o, s = run(nil, "scripts/train.lua", TINY .. ("--data %s %s"):format(q(corpus), f))
    expect(o, s, 2, f:match("^%S+") .. " without --save does nothing")
  end
end)

case("d5_adapter_config_use_rslora_honoured_use_dora_refused", function()
  local L = "--model llama-tiny --n-layer 1 --seq-len 16 --micro-batch 2 --sample 0 --seed 7 "
  local o, s = run(nil, "scripts/train.lua", L .. ("--steps 1 --data %s --save %s")
                                                 :format(q(corpus), q(path("lbase"))))
  assert(s == 0, o)
  o, s = run(nil, "tools/ckpt.lua", ("export %s %s"):format(q(path("lbase")), q(path("hf"))))
  assert(s == 0, o)
  o, s = run(nil, "scripts/train.lua", ("--init %s --seq-len 16 --micro-batch 2 --sample 0 " ..
             "--seed 7 --steps 3 --lr 0.01 --lora-r 4 --data %s --save %s")
             :format(q(path("hf")), q(corpus), q(path("lck"))))
  assert(s == 0, o)
  o, s = run(nil, "tools/ckpt.lua", ("export %s %s"):format(q(path("lck")), q(path("ad"))))
  assert(s == 0, o)
  local function loss(ad)
    local e, es = run(nil, "scripts/eval.lua", ("--hf %s --adapters %s --data %s --seq-len 16 " ..
                      "--max-batches 2"):format(q(path("hf")), q(ad), q(corpus)))
    assert(es == 0, e)
    return assert(e:match("val_loss (%S+)"), e), e, es
  end
  local cfg = cjson.decode(lz.read_file(path("ad/adapter_config.json")))
  for _, v in ipairs({ { "ad_rs", "use_rslora", true }, { "ad_dora", "use_dora", true } }) do
    os.execute(("cp -r %s %s"):format(q(path("ad")), q(path(v[1]))))
    cfg[v[2]] = v[3]
    write(v[1] .. "/adapter_config.json", cjson.encode(cfg))
    cfg[v[2]] = nil
  end
  assert(loss(path("ad_rs")) ~= loss(path("ad")), "use_rslora gave plain LoRA's loss")
  o, s = run(nil, "scripts/eval.lua", ("--hf %s --adapters %s --data %s --seq-len 16")
                                      :format(q(path("hf")), q(path("ad_dora")), q(corpus)))
  expect(o, s, 2, "use_dora true changes the result")
end)

case("d6_generate_stop_empty", function()
  local o, s = run(nil, "scripts/generate.lua", ("--load %s --prompt hi --stop ''"):format(q(path("ck"))))
  expect(o, s, 2, "--stop '' matches at every position")
end)

case("d7_instruction_file_training_nothing", function()
  local src = write("i.jsonl", '{"prompt": "ab", "completion": "cd"}\n{"prompt": "ef", "completion": "g"}\n')
  local o, s = run(nil, "tools/prepare_data.lua", ("--format jsonl %s %s"):format(q(src), q(path("i.bin"))))
  assert(s == 0, o)
  local bytes = lz.read_file(path("i.bin"))
  local n = 7 -- 4 + 3 tokens; the weights follow the header and the ids
  local at = 1024 + n * 4
  write("z.bin", bytes:sub(1, at) .. ("\0"):rep(n) .. bytes:sub(at + n + 1))
  o, s = run(nil, "scripts/train.lua", TINY .. "--data " .. q(path("z.bin")))
  expect(o, s, 2, "z.bin: example 1 (line 1 of its .jsonl): no token is trained")
end)

case("d8_resume_with_other_data_of_the_same_size", function()
  local other = write("other.txt", ("To be, or not to be, that is the answer!\n"):rep(60))
  local o, s = run(nil, "scripts/train.lua", TINY .. ("--data %s --resume %s")
                                                     :format(q(other), q(path("ck"))))
  expect(o, s, 2, "--resume " .. path("ck"), "--data " .. other .. " is other data")
end)

case("d9_full_disk_in_tools_exits_1", function()
  local o, s = run(FULL, "tools/prepare_data.lua", ("%s %s"):format(q(corpus), q(path("c.bin"))))
  expect(o, s, 1, "writing failed")
  o, s = run(FULL, "tools/ckpt.lua", ("consolidate %s %s"):format(q(path("ck")), q(path("c2.bin"))))
  expect(o, s, 1, "writing failed")
  gone(path("c.bin")); gone(path("c2.bin"))
end)

case("d9_load_of_nothing_says_so", function()
  local o, s = run(nil, "scripts/eval.lua", ("--load %s --data %s"):format(q(path("nope")), q(corpus)))
  expect(o, s, 2, "--load " .. path("nope") .. ": no such file or folder")
  assert(not o:find("is a file", 1, true), o)
end)

case("d9_a_byte_order_mark_is_named", function()
  local prompts = write("bom.txt", "\239\187\191To be\n")
  local o, s = run(nil, "scripts/generate.lua", ("--load %s --prompts %s")
                                                :format(q(path("ck")), q(prompts)))
  expect(o, s, 2, "--prompts " .. prompts .. ": starts with a UTF-8 byte order mark")
  local cfg = write("bom.json", "\239\187\191{}")
  o, s = run(nil, "scripts/train.lua", TINY .. ("--data %s --config %s"):format(q(corpus), q(cfg)))
  expect(o, s, 2, cfg .. ": starts with a UTF-8 byte order mark")
  local jl = write("bom.jsonl", '\239\187\191{"prompt": "a", "completion": "b"}\n')
  o, s = run(nil, "scripts/train.lua", TINY .. ("--data %s"):format(q(jl)))
  expect(o, s, 2, jl .. ":1: starts with a UTF-8 byte order mark")
end)

case("d9_prompt_ids_with_an_empty_entry", function()
  local o, s = run(nil, "scripts/generate.lua", ("--load %s --prompt-ids 1,,2"):format(q(path("ck"))))
  expect(o, s, 2, "--prompt-ids 1,,2: an empty entry is not a token id")
end)

case("d9_no_doubled_prefix", function()
  local o, s = run(nil, "scripts/generate.lua", ("--load %s --prompt %s")
                                                :format(q(path("ck")), q(("x"):rep(40))))
  expect(o, s, 2, "generate: prompt 1 has 40 tokens")
  assert(not o:find("generate: generate:", 1, true), o)
end)

case("d9_config_values_that_do_nothing", function()
  local cases = {
    { { flops_profiler = { enabled = true, profile_step = 50 } },
      "flops_profiler.profile_step 50 is past the run's last step (--steps 2)" },
    { { zero_optimization = { stage = 2, offload_optimizer = { device = "cpu", buffer_count = 0 } } },
      "offload_optimizer.buffer_count must be a whole number >= 1 (got 0)" },
    { { zero_optimization = { stage = 2, offload_optimizer = { device = "nvme", nvme_path = "" } } },
      "offload_optimizer.nvme_path is \"\" (no folder)" },
  }
  for i, c in ipairs(cases) do
    local cfg = write(("c%d.json"):format(i), cjson.encode(c[1]))
    local o, s = run(nil, "scripts/train.lua", TINY .. ("--data %s --config %s"):format(q(corpus), q(cfg)))
    expect(o, s, 2, c[2])
    assert(not o:find("step     1", 1, true), "refused before the first step: " .. o)
  end
end)

case("d9_fault_hook_outside_the_world", function()
  for _, v in ipairs({ "5:1", "x" }) do
    local o, s = run("LZ_FAULT_KILL=" .. v, "scripts/train.lua", TINY .. "--data " .. q(corpus))
    expect(o, s, 2, "LZ_FAULT_KILL=" .. v)
    assert(not o:find("step     1", 1, true), "refused before the first step: " .. o)
  end
end)

case("d9_stage_auto_on_a_budget_the_run_cannot_hold", function()
  for _, b in ipairs({ "100KiB", "1MiB" }) do
    local o, s = run(nil, "scripts/train.lua", TINY .. ("--data %s --stage auto --memory-budget %s")
                                                     :format(q(corpus), b))
    expect(o, s, 2, "stage auto: ", "the run would stop at its first step")
    assert(not o:find("step     1", 1, true), "refused before the first step: " .. o)
  end
end)

case("d9_eval_batch_too_large_names_the_flag", function()
  local big = write("big.txt", original:rep(300))
  local o, s = sh(("cd %s && sh -c %s"):format(q(lz.root), q(("ulimit -v 1000000; exec %s " ..
                  "scripts/eval.lua --load %s --data %s --micro-batch 40000")
                  :format(LZ, q(path("ck")), q(big)))))
  expect(o, s, 2, "for activations failed", "lower --micro-batch or --seq-len")
end)

case("d9_csv_monitor_appending_to_an_earlier_run_says_so", function()
  local cfg = write("csv.json", cjson.encode({ csv_monitor = { enabled = true, output_path = dir,
                                                               job_name = "csv" } }))
  local o, s = run(nil, "scripts/train.lua", TINY .. ("--data %s --config %s"):format(q(corpus), q(cfg)))
  assert(s == 0 and not o:find("earlier run's files", 1, true), o)
  o, s = run(nil, "scripts/train.lua", TINY .. ("--data %s --config %s"):format(q(corpus), q(cfg)))
  assert(s == 0 and o:find("csv_monitor: " .. path("csv") .. " holds an earlier run's files", 1, true), o)
end)

os.execute("rm -rf " .. q(dir))
print(("%d passed, %d failed"):format(passed, failed))
os.exit(failed == 0 and 0 or 1)
