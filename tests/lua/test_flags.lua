-- test_flags.lua — scripts/train.lua's flags that would otherwise be
-- ignored or taken silently: --model beside --model-config, the LoRA flags
-- without --lora-r, a run whose loss stops being finite, --stage auto with
-- a budget no stage fits, and a resume whose --steps stretches the schedule.
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local estimate = require("luazero.estimate")

local T = {}
local write_file, _, corpus = support.scratch_corpus(
  "It was the best of times, it was the worst of times.\n", 60)
local MODEL = support.GPT2_1L .. " --micro-batch 2 --data " .. support.quote(corpus)
local train, ok_train = support.trainer(MODEL)

-- A run that stops before step 1 with exit 2 and `needle` on one line.
local function refused(flags, needle)
  local out, st = train(1, flags)
  assert(st == 2, ("exit %s, expected 2:\n%s"):format(tostring(st), out))
  assert(out:find(needle, 1, true), ("output does not mention %q:\n%s"):format(needle, out))
  assert(not out:find("step +1/"), "a step ran:\n" .. out)
  assert(not out:find("traceback", 1, true), out)
end

function T.model_beside_model_config_is_refused_naming_the_one_to_drop()
  refused("--model-config " .. support.quote(write_file("config.json", "{}")),
          "train: --model gpt2-nano beside --model-config ")
  refused("--model-config x.json", "the config.json defines the model; drop --model (or drop " ..
          "--model-config to train gpt2-nano)")
end

function T.checkpoint_flags_without_save_are_refused()
  for _, f in ipairs({ "--save-every 5", "--save-every-minutes 1", "--keep 2", "--async-save" }) do
    local name = f:match("^(%S+)")
    refused(f, ("train: %s without --save does nothing: add --save DIR (the checkpoint " ..
                "folder) or drop %s"):format(name, name))
  end
end

function T.lora_flags_without_lora_r_or_out_of_range_are_refused()
  refused("--lora-alpha 8", "train: --lora-alpha 8 without --lora-r does nothing: add --lora-r R " ..
          "(the adapters' rank) or drop --lora-alpha")
  refused("--lora-targets c_attn", "train: --lora-targets c_attn without --lora-r does nothing")
  refused("--lora-targets ''", "train: --lora-targets '' without --lora-r does nothing")
  refused("--lora-r 2 --lora-alpha 0", "train: --lora-alpha must be > 0 (got 0): the adapters' " ..
          "scale is alpha / r")
  refused("--lora-r 2 --lora-alpha -4", "--lora-alpha must be > 0 (got -4)")
  refused("--lora-r 2 --lora-targets ''", "train: --lora-targets '' names no module: give " ..
          "comma-separated names")
  refused("--lora-r 2 --lora-targets ' , '", "--lora-targets ' , ' names no module")
end

-- A loss or validation loss that is not finite stops the run: exit 2, one
-- line naming the step and --lr. fp16's skipped overflow steps (inf in the
-- gradients, the loss finite) run on. (Step 1's loss comes before any
-- update, its validation after one; which later step's loss is the first
-- nan depends on the CPU's code paths: an AVX2 part's is step 2's.)
function T.a_loss_that_is_not_finite_stops_the_run_but_skipped_fp16_steps_run_on()
  for _, case in ipairs({ { "--steps 1", { "step 1: the validation loss is nan" } },
                          { "--steps 3", { "step 2: the loss is nan", "step 3: the loss is nan" } },
                          { "--steps 4 --dtype fp16", { "step 2: the loss is nan" } } }) do
    local out, st = train(1, "--lr 1e9 " .. case[1])
    assert(st == 2, ("%s: exit %s:\n%s"):format(case[1], tostring(st), out))
    local said = false
    for _, line in ipairs(case[2]) do
      said = said or out:find("train: " .. line .. ": training diverged; lower --lr (it was " ..
                              "1e+09)\n", 1, true)
    end
    assert(said, out)
    assert(not out:find("params_checksum", 1, true), out)
  end
  local out = ok_train(1, "--steps 3 --dtype fp16", "LZ_INJECT_INF_STEP=2")
  assert(out:find("step     2/3 | loss %d.*skipped %(overflow%)"), out)
end

function T.stage_auto_says_which_stage_needs_the_least_when_none_fits()
  local _, why, fits = estimate.pick_stage(1e6, 1, 1e6, "fp32", { persistent = 1e6 })
  assert(fits == false, why)
  assert(why:find("no stage fits (stage 0 needs the least, ", 1, true), why)
  assert(not why:find("the smallest", 1, true), why)
  _, why = estimate.pick_stage(1e6, 2, 1e6, "bf16")
  assert(why:find("no stage fits (stage 3 needs the least, 8.6 MiB); picked stage 3", 1, true), why)
  -- a budget the run holds that nothing meets is refused before the first
  -- step (it would stop the run there), and so is one the process fills
  -- The activations of one micro-batch come off the budget first.
  local out, st = train(1, "--steps 1 --stage auto --memory-budget 100KiB")
  assert(st == 2 and out:find("train: stage auto: the activations of a 2 x 8 micro-batch need " ..
                              "100.6 KiB per rank, more than the whole budget 100.0 KiB " ..
                              "(--memory-budget); the run would stop at its first step: lower " ..
                              "--micro-batch or --seq-len, add " ..
                              "--checkpoint-activations, or raise --memory-budget", 1, true), out)
  -- What the process holds already comes off a held budget too (its whole
  -- memory is what each step checks): a budget it fills is refused.
  for _, b in ipairs({ { "150KiB", "49.4 KiB" }, { "1MiB", "923.4 KiB" } }) do
    out, st = train(1, "--steps 1 --stage auto --memory-budget " .. b[1])
    assert(st == 2 and out:find("train: stage auto: this process holds ", 1, true) and
           out:find(" already, before any model state, more than the budget " .. b[2] ..
                    " (what is left after 100.6 KiB of activations for a 2 x 8 micro-batch): " ..
                    "the run would stop at its first step over it; raise --memory-budget", 1,
                    true) and not out:find("step     1", 1, true), out)
  end
end

-- An offload in the config allows only the stages it works at: stage auto
-- picks among those (it picked 0 and then refused its own pick).
function T.stage_auto_picks_among_the_stages_an_offload_allows()
  for _, c in ipairs({ { '"offload_optimizer": {"device": "cpu"}', "offload_optimizer needs " ..
                         "stage 1, 2 or 3, so stage 1 at least; stage 1 needs", "stage 1" },
                       { '"offload_param": {"device": "cpu"}, "offload_optimizer": ' ..
                         '{"device": "cpu"}', "offload_param needs stage 3, so stage 3 at " ..
                         "least; stage 3 needs", "stage 3" } }) do
    local cfg = write_file("auto-offload.json", ('{"train_micro_batch_size_per_gpu": 2, ' ..
      '"zero_optimization": {"stage": "auto", %s}}'):format(c[1]))
    local out, st = train(1, "--steps 1 --config " .. support.quote(cfg))
    assert(st == 0, out)
    assert(out:find("stage auto: zero_optimization." .. c[2], 1, true) and
           out:find(": picked " .. c[3], 1, true), out)
  end
end

-- A moe block beside a dense model does nothing, and the run says so.
function T.a_moe_block_beside_a_dense_model_is_named_as_without_effect()
  local cfg = write_file("dense-moe.json", '{"train_micro_batch_size_per_gpu": 2, ' ..
                         '"moe": {"gather": "expert", "routed_only": true}}')
  local out, st = train(1, "--steps 1 --config " .. support.quote(cfg))
  assert(st == 0 and out:find("config: no effect here: moe.gather, moe.routed_only (the model " ..
                              "gpt2-nano has no mixture-of-experts blocks)", 1, true), out)
  -- nor does an ep_size: no expert-parallel groups, none described
  cfg = write_file("dense-ep.json", '{"train_micro_batch_size_per_gpu": 2, "moe": {"ep_size": 2}}')
  out, st = train(2, "--steps 1 --config " .. support.quote(cfg))
  assert(st == 0 and out:find("config: no effect here: moe.ep_size (the model gpt2-nano has " ..
                              "no mixture-of-experts blocks)", 1, true), out)
  assert(out:find("zero stage 0, fp32, AdamW, 2 ranks\n") and not out:find("ep_size 2"), out)
end

-- An ep_size that divides the world size but not a block's experts is
-- refused as the config's error (exit 2) before any log or save is made.
function T.an_ep_size_not_dividing_the_experts_is_refused_before_anything_is_written()
  local cfg = write_file("ep3.json", '{"train_micro_batch_size_per_gpu": 2, "moe": {"ep_size": 3}}')
  local dir, log = write_file("ep3-ck", ""), write_file("ep3.jsonl", "")
  os.remove(dir); os.remove(log)
  local out, st = support.sh(("cd %s && %s -n 3 scripts/train.lua --model mixtral-tiny " ..
    "--seq-len 16 --sample 0 --data %s --steps 1 --config %s --save %s --log %s"):format(
    support.quote(lz.root), support.quote(lz.executable()), support.quote(corpus),
    support.quote(cfg), support.quote(dir), support.quote(log)))
  assert(st == 2 and out:find("train: config: moe.ep_size 3 does not divide the 8 experts of " ..
                              "mixtral-tiny's MoE blocks; set moe.ep_size to a divisor of 8 " ..
                              "that divides the world size 3", 1, true), out)
  assert(not io.open(dir) and not io.open(log), "a save folder or log was left: " .. out)
end

-- The config's save settings without --save save nothing: said so.
function T.save_settings_without_save_are_named_as_without_effect()
  local cfg = write_file("saves.json", '{"train_micro_batch_size_per_gpu": 2, "checkpoint": ' ..
                         '{"writer": {"decoupled": true}}, "zero_optimization": {"stage": 3, ' ..
                         '"stage3_gather_16bit_weights_on_model_save": true}}')
  local out, st = train(1, "--steps 1 --config " .. support.quote(cfg))
  assert(st == 0 and out:find("config: no effect here: checkpoint.writer.decoupled, " ..
                              "zero_optimization.stage3_gather_16bit_weights_on_model_save " ..
                              "(nothing is saved without --save DIR)", 1, true), out)
end

-- --val-data holding --data's bytes: said (the validation loss would be the
-- training data's).
function T.val_data_that_is_the_training_data_is_said()
  local out = ok_train(1, "--steps 1 --val-data " .. support.quote(corpus))
  assert(out:find("holds the same bytes as --data", 1, true), out)
  local other = write_file("other-val.txt", ("Another text altogether. "):rep(80))
  out = ok_train(1, "--steps 1 --val-data " .. support.quote(other))
  assert(not out:find("holds the same bytes", 1, true), out)
end

function T.a_resume_with_other_steps_says_the_schedule_changes()
  local dir = select(2, support.scratch())
  ok_train(1, ("--steps 4 --save-every 2 --save %s"):format(dir))
  local ck = dir .. "/step-000002"
  local out = ok_train(1, "--steps 8 --resume " .. ck)
  assert(out:find("resume: --steps 8, the saved run had --steps 4: the warmup + cosine " ..
                  "schedule now spans 8 steps, not 4 (--steps 4 keeps the saved run's)\n", 1, true),
         out)
  out = ok_train(1, "--steps 4 --resume " .. ck)
  assert(not out:find("resume: --steps", 1, true) and not out:find("lr schedule was", 1, true) and
         not out:find("resume: peak lr", 1, true) and not out:find("resume: gradient_", 1, true),
         out)
  -- A config without a scheduler keeps its lr whatever --steps is: nothing to
  -- say of the steps; that it replaces the saved run's schedule is said.
  local cfg = write_file("constant.json", '{"train_micro_batch_size_per_gpu": 2}')
  out = ok_train(1, ("--steps 8 --config %s --resume %s"):format(cfg, ck))
  assert(not out:find("resume: --steps", 1, true), out)
  assert(out:find("resume: the saved run's lr schedule was warmup 0 + cosine, this run's is " ..
                  "constant (the --config has no scheduler block); from step 3 the lr follows " ..
                  "this run's (the saved run's --config and flags keep its own)\n", 1, true), out)
  -- (train.lua clips at 1.0 without a --config; the file's default is none)
  assert(out:find("resume: gradient_clipping 0, the saved run's 1 (0: none)\n", 1, true), out)
  out = ok_train(1, "--steps 4 --lr 0.01 --resume " .. ck)
  assert(out:find("resume: peak lr 0.01, the saved run's 0.003; from step 3 the lr follows " ..
                  "this run's\n", 1, true) and not out:find("lr schedule was", 1, true), out)
  -- A longer run keeps the saved run's warmup (2 of 20 steps), not 10% of
  -- the new --steps (4 of 40): before, the lr warmed up again past step 20.
  local dir20 = select(2, support.scratch())
  ok_train(1, ("--steps 20 --save-every 10 --save %s"):format(dir20))
  out = ok_train(1, "--steps 40 --resume " .. dir20 .. "/step-000010")
  assert(out:find("(--steps 20 keeps the saved run's); its warmup stays the saved run's 2 " ..
                  "steps (--warmup sets another)\n", 1, true) and
         out:find("warmup 2 + cosine, 40 steps", 1, true), out)
  out = ok_train(1, "--steps 40 --warmup 4 --resume " .. dir20 .. "/step-000010")
  assert(out:find("warmup 4 + cosine, 40 steps", 1, true) and
         not out:find("its warmup stays", 1, true), out)
  -- Another --seed on resume changes nothing, and says so.
  assert(MODEL:find("--seed 7", 1, true))
  local _, ok_seed8 = support.trainer((MODEL:gsub("%-%-seed 7", "--seed 8")))
  out = ok_seed8(1, "--steps 4 --resume " .. ck)
  assert(out:find("resume: --seed 8, the saved run's 7: the weights, the data's order and " ..
                  "position and every generator come from the checkpoint", 1, true), out)
  out = ok_train(1, "--steps 4 --resume " .. ck)
  assert(not out:find("resume: --seed", 1, true), out)
  -- Below the saved step: refused, naming the step itself (equal runs nothing).
  local o, st = train(1, "--steps 1 --resume " .. ck)
  assert(st == 2 and o:find("give --steps 2 or more", 1, true), o)
  -- --warmup 0, which the default gives a short run, may be given too.
  out = ok_train(1, "--steps 2 --warmup 0")
  assert(out:find("warmup 0 + cosine", 1, true), out)
end

-- Bad input exits 2, a failure during the run 1: a resume of another model
-- (found when the engine meets the manifest), a config the engine refuses
-- to build and an -n this machine cannot run are bad input.
function T.another_model_resumed_a_refused_config_and_too_many_ranks_exit_2()
  local dir = select(2, support.scratch())
  ok_train(1, ("--steps 1 --save %s"):format(dir))
  refused("--steps 2 --vocab 300 --resume " .. support.quote(dir), "holds a different model: " ..
          "parameter 1 is transformer.wte.weight")
  -- the same shapes in another arrangement (8 heads of 4 for 2 of 16)
  local heads = support.trainer("--model gpt2-nano --n-layer 1 --n-embd 32 --context 16 " ..
                                "--seq-len 8 --micro-batch 2 --data " .. support.quote(corpus))
  local hd = select(2, support.scratch())
  local out, st = heads(1, "--steps 1 --n-head 2 --save " .. support.quote(hd))
  assert(st == 0, out)
  out, st = heads(1, "--steps 2 --n-head 8 --resume " .. support.quote(hd))
  assert(st == 2 and out:find("holds a different model: its n_head is 2, this model's 8; load " ..
                              "it with the model flags it was saved with", 1, true), out)
  -- what the engine refuses to build from a config is bad input too
  local nvme = select(2, support.scratch())
  local cfg = write_file("buffer.json", ('{"train_micro_batch_size_per_gpu": 2, ' ..
    '"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "%s", ' ..
    '"buffer_size": 1}}}'):format(nvme))
  refused("--steps 1 --config " .. support.quote(cfg), "train: initialize: " ..
          "zero_optimization.offload_param.buffer_size 1 is smaller than ")
  local out, st = support.sh(("cd %s && %s -n 4097 scripts/train.lua"):format(
                             support.quote(lz.root), support.quote(lz.executable())))
  assert(st == 2 and out:find("launch: -n 4097: the number of ranks must be 1..4096", 1, true),
         ("exit %s:\n%s"):format(tostring(st), out))
end

-- A flag given twice, an --init that is not there, a --resume that is a
-- file: one line each, saying which; tools/ckpt without a command: usage
-- and exit 2.
function T.repeated_flags_and_missing_paths_are_named()
  refused("--steps 2 --steps=3", "train: --steps is given twice (--steps 2, then --steps=3); " ..
          "give it once")
  refused("--steps 0 --init /nonexistent/hf", "train: --init /nonexistent/hf: no such file or " ..
          "folder")
  refused("--steps 2 --resume " .. support.quote(corpus), corpus .. ": is a file, not a " ..
          "checkpoint folder")
  local out, st = support.sh(("cd %s && LUAZERO=%s tools/ckpt"):format(support.quote(lz.root),
                             support.quote(lz.executable())))
  assert(st == 2 and out:find("^usage: tools/ckpt"), ("exit %s:\n%s"):format(tostring(st), out))
end

return T
