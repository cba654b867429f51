-- test_bf16_master.lua — bf16 master weights (optimizer.params.
-- bf16_stochastic_round): no fp32 master, the bf16 working parameters
-- updated through stochastic rounding keyed by (seed, step, canonical
-- index). Updates far below half a bf16 step still move the weights on
-- average (where rounding to nearest keeps none); stages 0-3, world sizes
-- and tiers give one checksum, AdamW's and Muon's; a resume continues bitwise;
-- a run without bf16 working parameters is refused naming what it needs.
local cjson = require("cjson")
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local T = {}

local q = support.quote
local ops = lz.ops

-- 100 steps of -1e-4 on weights of 1.0 (half a bf16 step there is 2^-9,
-- about 0.002): rounding to nearest never moves them, stochastic rounding
-- moves them by -0.01 on average.
function T.small_updates_survive_on_average()
  local n = 20000
  local sr, rne = lz.tensor({ n }, "bf16"), lz.tensor({ n }, "bf16")
  sr:fill(1); rne:fill(1)
  local wide, delta = lz.tensor({ n }, "f32"), lz.tensor({ n }, "f32")
  delta:fill(1e-4)
  for t = 1, 100 do
    wide:convert(sr)
    ops.axpy(wide, -1, delta)
    ops.bf16_round_stochastic(sr, wide, 7, t, 0)
    wide:convert(rne)
    ops.axpy(wide, -1, delta)
    rne:convert(wide)
  end
  wide:convert(sr)
  local mean = 0
  for i = 0, n - 1 do mean = mean + wide:get(i) end
  mean = mean / n
  -- Each step's rounding error has sd <= 2^-9 (steps of 2^-8 below 1), so
  -- the mean of n elements after 100 steps has sd <= 2^-9 * 10 / sqrt(n).
  local sd = 2 ^ -9 * 10 / math.sqrt(n)
  assert(math.abs(mean - (1 - 0.01)) < 4 * sd, ("mean %.6f, expected 0.99 (+- %.2g)"):format(mean, 4 * sd))
  wide:convert(rne)
  assert(wide:get(0) == 1 and wide:get(n - 1) == 1, "rounding to nearest moved a weight")
  for _, x in ipairs({ sr, rne, wide, delta }) do x:free() end
end

local write_file, tmp = support.scratch()
local lines = {}
for i = 1, 80 do lines[i] = ("line %d of the corpus: %d\n"):format(i, i * 7919 % 1000) end
local corpus = write_file("corpus.txt", table.concat(lines))
local train, ok_train = support.trainer("--model gpt2-nano --n-layer 2 --n-embd 64 --n-head 4 " ..
  "--context 32 --seq-len 16 --sample 0 --eval-batches 1 --seed 7 --micro-batch 2 --data " .. q(corpus))

local function config(opt_type, params, bf16)
  params.bf16_stochastic_round = true
  local c = { train_micro_batch_size_per_gpu = 2, optimizer = { type = opt_type, params = params } }
  if bf16 ~= false then c.bf16 = { enabled = true } end
  return q(write_file(("sr%d.json"):format(math.random(1e9)), cjson.encode(c)))
end

function T.every_stage_and_world_size_gives_one_checksum()
  local adamw = config("AdamW", { lr = 1e-3, weight_decay = 0.1 })
  local _, want = ok_train(2, "--steps 3 --stage 0 --config " .. adamw)
  for _, st in ipairs({ 1, 2, 3 }) do
    local _, got = ok_train(2, ("--steps 3 --stage %d --config %s"):format(st, adamw))
    assert(got == want, ("stage %d: %s, stage 0: %s"):format(st, got, want))
  end
  local _, w1s0 = ok_train(1, "--steps 3 --stage 0 --config " .. adamw)
  local _, w1s3 = ok_train(1, "--steps 3 --stage 3 --config " .. adamw)
  assert(w1s0 == w1s3, ("world 1: %s, %s"):format(w1s0, w1s3))
  -- Not the fp32 master's bf16 run.
  local _, fp32_master = ok_train(2, "--steps 3 --stage 0 --dtype bf16")
  assert(fp32_master ~= want)
  local muon = config("Muon", { lr = 0.01 })
  local _, m0 = ok_train(2, "--steps 3 --stage 0 --config " .. muon)
  local _, m3 = ok_train(2, "--steps 3 --stage 3 --config " .. muon)
  assert(m0 == m3, ("Muon: %s, %s"):format(m0, m3))
end

-- Where the optimizer cannot update the working parameters in place (on
-- NVMe, or in host memory beside the sim device), the bf16 master is a
-- copy beside its states: the same checksum as stage 0's, and a resume
-- from the NVMe tier into another tier and stage continues bitwise.
function T.every_tier_gives_stage_0s_checksum()
  local nvme = { stage = 3, offload_optimizer = { device = "nvme", nvme_path = tmp },
                 offload_param = { device = "nvme", nvme_path = tmp } }
  local function tiered(zero)
    local c = { train_micro_batch_size_per_gpu = 2, bf16 = { enabled = true }, zero_optimization = zero,
                optimizer = { type = "AdamW", params = { lr = 1e-3, weight_decay = 0.1,
                                                         bf16_stochastic_round = true } } }
    return q(write_file(("tier%d.json"):format(math.random(1e9)), cjson.encode(c)))
  end
  local _, want = ok_train(2, "--steps 4 --stage 0 --config " .. config("AdamW", { lr = 1e-3, weight_decay = 0.1 }))
  local dir = tmp .. "/ck_nvme"
  local _, on_nvme = ok_train(2, "--steps 4 --save-every 2 --save " .. q(dir) .. " --config " ..
                                 tiered(nvme))
  assert(on_nvme == want, ("nvme: %s, stage 0: %s"):format(on_nvme, want))
  local cpu = tiered({ stage = 2, offload_optimizer = { device = "cpu" } })
  local _, on_sim = ok_train(2, "--steps 4 --device sim --config " .. cpu)
  assert(on_sim == want, ("sim, optimizer on the cpu: %s, stage 0: %s"):format(on_sim, want))
  local _, resumed = ok_train(2, "--steps 4 --device sim --config " .. cpu .. " --resume " ..
                                 q(dir .. "/step-000002"))
  assert(resumed == want, ("resumed from nvme on sim: %s, stage 0: %s"):format(resumed, want))
end

-- With the working parameters on NVMe in bf16, the bf16 master is the
-- working copy bit for bit: each sub-group's master is read from and written
-- to the parameter file, and the state file holds m and v only, so a step
-- writes the master once, not twice (checksums: tools/checksums' nvme lines).
function T.on_nvme_the_master_is_the_parameter_file()
  local zero, config_mod = require("luazero.zero"), require("luazero.config")
  local gpt2, data = require("models.gpt2"), require("luazero.data")
  local comm = require("luazero.comm").init("local")
  local cfg = gpt2.config("gpt2-nano", { n_layer = 1, n_embd = 64, n_head = 4, context = 16 })
  local ds = { train_micro_batch_size_per_gpu = 2, bf16 = { enabled = true },
               zero_optimization = { stage = 3, sub_group_size = 8192,
                                     offload_optimizer = { device = "nvme", nvme_path = tmp },
                                     offload_param = { device = "nvme", nvme_path = tmp } },
               optimizer = { type = "AdamW", params = { lr = 1e-3, bf16_stochastic_round = true } } }
  local engine = zero.initialize({ model = gpt2.new(cfg), seed = 3, batch = { 2, 16 }, comm = comm,
                                   config = config_mod.load(ds, 1) })
  local loader = data.loader(data.load(corpus), { B = 2, T = 16, seed = 1, vocab = cfg.vocab })
  local ring = engine.states
  assert(ring.master_in_params, "a bf16 master over bf16 parameters on NVMe kept a copy of its own")
  local G, groups = ring.G, #ring.groups
  assert(ring.region == 2 * G * 4, ("a sub-group's region is %d bytes; m and v take %d")
                                   :format(ring.region, 2 * G * 4))
  engine:train_batch(loader)
  local s0, p0 = ring.swap:stats(), ring.params.swap:stats()
  engine:train_batch(loader)
  local s1, p1 = ring.swap:stats(), ring.params.swap:stats()
  local state_w = s1.bytes_written - s0.bytes_written
  assert(state_w == groups * 2 * G * 4, ("state file: %d bytes written in a step, want %d")
                                        :format(state_w, groups * 2 * G * 4))
  -- the parameter file: each group written once, and read for the update
  -- beside the gathers' reads
  local pw, pr = p1.bytes_written - p0.bytes_written, p1.bytes_read - p0.bytes_read
  assert(pw >= ring.n * 2 and pw <= groups * G * 2,
         "parameter file: " .. pw .. " bytes written")
  assert(pr >= pw + ring.n * 2, ("parameter file: %d bytes read, %d written"):format(pr, pw))
  engine:free()
end

function T.a_resume_continues_bitwise()
  local cfg, dir = config("AdamW", { lr = 1e-3 }), tmp .. "/ck"
  local out0, straight = ok_train(2, "--steps 4 --stage 3 --save-every 2 --save " .. q(dir) ..
                                     " --config " .. cfg)
  assert(out0:find("zero stage 3, bf16, AdamW (bf16 master), 2 ranks", 1, true), out0)
  local _, resumed = ok_train(2, "--steps 4 --stage 3 --resume " .. q(dir .. "/step-000002") ..
                                 " --config " .. cfg)
  assert(resumed == straight, ("resumed %s, straight %s"):format(resumed, straight))
  -- The manifest records the bf16 master: a run with an fp32 master is
  -- refused naming the conversion, which then lets it load.
  local step2 = dir .. "/step-000002"
  local plain = q(write_file("plain.json", cjson.encode({ train_micro_batch_size_per_gpu = 2,
    bf16 = { enabled = true }, optimizer = { type = "AdamW", params = { lr = 1e-3 } } })))
  local out, st = train(2, "--steps 4 --stage 3 --resume " .. q(step2) .. " --config " .. plain)
  assert(st == 2 and out:find(step2 .. " keeps its master weights in bf16; this run keeps them " ..
                              "in f32: convert it first (tools/ckpt convert-states " .. step2 ..
                              " OUT --master f32)", 1, true), out)
  local conv = tmp .. "/ck32/step-000002"
  out, st = support.sh(("cd %s && %s tools/ckpt.lua convert-states %s %s --master f32")
                       :format(q(lz.root), q(lz.executable()), q(step2), q(conv)))
  assert(st == 0 and out:find("the master weights (bf16) now in f32", 1, true), out)
  local _, from_conv = ok_train(2, "--steps 4 --stage 3 --resume " .. q(conv) .. " --config " .. plain)
  -- and back: the bf16-master run resumes from the converted copy as from its own
  local back = tmp .. "/ck16/step-000002"
  out, st = support.sh(("cd %s && %s tools/ckpt.lua convert-states %s %s --master bf16")
                       :format(q(lz.root), q(lz.executable()), q(conv), q(back)))
  assert(st == 0, out)
  local _, again = ok_train(2, "--steps 4 --stage 3 --resume " .. q(back) .. " --config " .. cfg)
  assert(again == straight, ("back to bf16: %s, straight %s"):format(again, straight))
  print(("    bf16 master resumed: %s; through an f32 master: %s"):format(resumed, from_conv))
end

function T.fp32_working_parameters_are_refused()
  local out, st = train(1, "--steps 1 --config " .. config("AdamW", {}, false))
  assert(st ~= 0 and out:find("bf16 master weights (optimizer.params.bf16_stochastic_round) " ..
                              "are the bf16 working parameters themselves: they need " ..
                              "a bf16 run (bf16.enabled, and no --dtype but bf16)", 1, true), out)
end

return T
