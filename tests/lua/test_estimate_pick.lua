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
