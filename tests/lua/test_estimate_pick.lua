-- test_estimate_pick.lua — the stage "auto" pick counts what the run holds:
-- the optimizer's own states (Lion's one, 8-bit AdamW's bytes), a LoRA
-- run's frozen base (4 bytes a parameter, no gradient or state), an MoE's
-- experts over moe.ep_size; and tools/estimate takes a micro-batch's
-- activations off the budget first, as the trainer does.
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")

local T = {}

local function tool(flags)
  local out, st = support.sh(("cd %s && LUAZERO=%s tools/estimate %s"):format(
    support.quote(lz.root), support.quote(lz.executable()), flags))
  assert(st == 0, out)
  return out:match('stage "auto"[^\n]*')
end

local function need(line, stage)
  return line:match("stage " .. stage .. " needs ([%d.]+ %a+)")
end

-- The budget without one given is what this process may take: the least of
-- MemAvailable, the room its memory cgroups leave (v1 and v2, the group and
-- its parents) and ulimit -v's room.
function T.the_machines_budget_heeds_cgroups_and_ulimit()
  local memory = require("luazero.io.memory")
  local write, dir = support.scratch()
  os.execute(("mkdir -p %s/memory/job/step %s/job/step"):format(dir, dir))
  write("memory/job/memory.limit_in_bytes", "1468006400\n") -- 1400 MiB
  write("memory/job/memory.usage_in_bytes", "104857600\n")  -- 100 MiB
  write("memory/job/step/memory.limit_in_bytes", "9223372036854771712\n")
  write("memory/job/step/memory.usage_in_bytes", "52428800\n")
  write("memory/job/memory.stat", "cache 90000000\ntotal_inactive_file 0\n")
  local room, file = memory.cgroup_room(dir, "4:memory:/job/step\n0::/\n")
  support.eq(room, 1300 * 2 ^ 20, "v1: the parent's limit less its use")
  support.eq(file, dir .. "/memory/job/memory.limit_in_bytes", "the limit's file")
  write("job/step/memory.max", "max\n")
  write("job/step/memory.current", "1\n")
  write("job/memory.max", "3221225472\n") -- 3 GiB
  write("job/memory.current", "1073741824\n")
  room = memory.cgroup_room(dir, "0::/job/step\n")
  support.eq(room, 2 * 2 ^ 30, "v2: memory.max less memory.current")
  -- inactive file pages are reclaimed before a kill: they count as room
  write("job/memory.stat", "anon 1\nactive_file 5\ninactive_file 536870912\n")
  room = memory.cgroup_room(dir, "0::/job/step\n")
  support.eq(room, 2.5 * 2 ^ 30, "v2: memory.current less inactive_file")
  assert(memory.cgroup_room(dir, "0::/\n") == nil, "no limit")
  -- ulimit -v: the trainer's budget says where it came from
  local out = support.sh(("ulimit -v 3000000; cd %s && %s -e 'local b, s = " ..
                          "require(\"luazero.config\").memory_budget({ world_size = 1 }); " ..
                          "print(s)'"):format(support.quote(lz.root), support.quote(lz.executable())))
  assert(out:find("ulimit -v\n", 1, true), out)
  -- (each process's own: not divided among the ranks on the machine)
  out = support.sh(("ulimit -v 3000000; cd %s && %s -e 'local b, s = " ..
                    "require(\"luazero.config\").memory_budget({ world_size = 2 }); " ..
                    "print(b > 2.5 * 2 ^ 30, s)'"):format(support.quote(lz.root),
                                                          support.quote(lz.executable())))
  assert(out:find("true\tulimit -v", 1, true), out)
end

-- A stage the config names is checked too: over a budget the run holds it
-- is refused before any allocation; over what the machine has (here
-- ulimit -v's room) it is said before the run meets the limit.
function T.a_named_stage_over_the_budget_is_refused_or_said()
  local corpus = select(3, support.scratch_corpus("a line of the corpus, and another one\n", 400))
  local train = ("cd %s && %s scripts/train.lua --model gpt2-nano --steps 1 --sample 0 --data %s ")
                :format(support.quote(lz.root), support.quote(lz.executable()), support.quote(corpus))
  local out, st = support.sh(train .. "--seq-len 16 --micro-batch 2 --stage 0 --memory-budget 5MiB")
  assert(st == 2 and out:find("stage 0 needs about", 1, true) and
         out:find("more than 5.0 MiB (--memory-budget): the run would stop at its first step " ..
                  "over the budget it holds; --stage auto picks", 1, true) and
         not out:find("step +1/", 1), out)
  -- a budget the estimate alone fits but not with what the process holds
  -- already: refused before step 1 (before, the step's RSS stopped the run)
  out, st = support.sh(train .. "--seq-len 16 --micro-batch 2 --stage 0 --memory-budget 20MiB")
  assert(st == 2 and out:find("MiB this process holds and ", 1, true) and
         out:find("more than 20.0 MiB (--memory-budget)", 1, true) and
         out:find("offload the optimizer states to NVMe", 1, true) and
         not out:find("step +1/", 1), out)
  out = support.sh("ulimit -v 1500000; " .. train .. "--micro-batch 256 --seq-len 256")
  assert(out:find("memory: stage 0 needs about 2.9 GiB per rank", 1, true) and
         out:find("(ulimit -v): the run may be killed when it gets there", 1, true), out)
end

function T.the_pick_counts_the_optimizers_states()
  -- gpt2-nano fp32 at world 2: AdamW 16 bytes a parameter at stage 0, Lion 12
  local adamw = tool("--model gpt2-nano --world 2 --dtype fp32 --budget 12MiB")
  local lion = tool("--model gpt2-nano --world 2 --dtype fp32 --optimizer Lion --budget 12MiB")
  assert(adamw:find("picked stage 1", 1, true), adamw)
  assert(lion:find("stage 0 needs 9.8 MiB per rank; budget 12.0 MiB: picked stage 0", 1, true),
         lion)
end

function T.the_pick_counts_a_lora_runs_frozen_base()
  -- 858,880 frozen fp32 parameters: 3.3 MiB before any adapter
  local line = tool("--model gpt2-nano --world 2 --dtype fp32 --lora-r 4 --budget 1MiB")
  assert(line:find("no stage fits", 1, true) and need(line, 0) == "3.4 MiB", line)
end

function T.the_tools_pick_takes_the_activations_off_the_budget()
  local line = tool("--model gpt2-nano --dtype fp32 --device cpu --micro-batch 2 --seq-len 32 " ..
                    "--budget 15MiB")
  assert(line:find("budget 12.1 MiB (what is left after 2.9 MiB of activations for a 2 x 32 " ..
                   "micro-batch)", 1, true) and line:find("no stage fits", 1, true), line)
end

function T.the_trainers_pick_counts_lora_and_expert_parallelism()
  local write = support.scratch()
  local corpus = write("c.txt", ("a line of the corpus, and another one\n"):rep(200))
  local out, st = support.sh(("cd %s && OMP_NUM_THREADS=1 %s scripts/train.lua --data %s " ..
    "--model gpt2-nano --seq-len 16 --micro-batch 1 --steps 1 --sample 0 --lora-r 4 " ..
    "--stage auto --memory-budget 64MiB"):format(support.quote(lz.root),
    support.quote(lz.executable()), support.quote(corpus)))
  assert(st == 0 and out:find("stage auto: stage 0 needs 3.4 MiB per rank", 1, true), out)
  local cfg = write("ep2.json", '{"train_micro_batch_size_per_gpu": 2, "moe": {"ep_size": 2}}')
  out, st = support.sh(("cd %s && OMP_NUM_THREADS=1 %s -n 2 scripts/train.lua --data %s " ..
    "--model mixtral-tiny --seq-len 32 --micro-batch 2 --steps 1 --sample 0 --config %s " ..
    "--stage auto --memory-budget 200MiB"):format(support.quote(lz.root),
    support.quote(lz.executable()), support.quote(corpus), support.quote(cfg)))
  assert(st == 0 and out:find("stage auto: stage 0 needs 2.0 MiB per rank; budget ", 1, true) and
         out:find(" (what is left after 1.9 MiB of activations for a 2 x 32 micro-batch, and " ..
                  "the ", 1, true), out)
end

return T
