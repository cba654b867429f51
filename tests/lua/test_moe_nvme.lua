-- test_moe_nvme.lua — a frozen MoE base (LoRA) on NVMe at stage 3 reads
-- only the experts some rank routed to (moe.routed_only): the same bits as
-- the stage-0 run and as reading every expert, fewer bytes read from the
-- parameter file, and each step's record says how many expert bytes of how
-- many.
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")

local T = {}
local q, eq = support.quote, support.eq
local write_file, dir, corpus = support.scratch_corpus(support.YORK, 60)
-- 4 tokens a micro-batch, top-2 of 8 experts on 2 ranks: some experts get
-- no token anywhere.
local MODEL = "--model mixtral-tiny --seq-len 4 --sample 0 --eval-batches 1 --seed 7 " ..
              "--micro-batch 1 --steps 3 --lora-r 8 --data " .. q(corpus)
local _, ok_train = support.trainer(MODEL)

local function config(name, stage, nvme, routed)
  local z = ('"stage": %d, "stage3_param_persistence_threshold": 0'):format(stage)
  if nvme then z = z .. (', "offload_param": {"device": "nvme", "nvme_path": "%s"}'):format(dir) end
  return write_file(name, ('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {%s}, ' ..
                           '"moe": {"gather": "expert", "routed_only": %s}}'):format(z, routed))
end

local function run(name, stage, nvme, routed)
  local log = write_file(name .. ".jsonl", "")
  local out, sum = ok_train(2, ("--config %s --log %s"):format(q(config(name .. ".json", stage,
                                                                       nvme, routed)), q(log)))
  local recs = {}
  for _, r in ipairs(support.records(log)) do
    if r.step and r.loss then recs[#recs + 1] = r end
  end
  eq(#recs, 3, "steps logged")
  return sum, recs, out
end

function T.frozen_experts_on_nvme_are_read_only_where_routed()
  local s0 = run("s0", 0, false, "false")
  local all_sum, all = run("all", 3, true, "false")
  local routed_sum, routed, out = run("routed", 3, true, "true")
  eq(all_sum, s0, "reading every expert from NVMe ends on the stage-0 checksum")
  eq(routed_sum, s0, "reading the routed experts alone ends on it too")
  local fewer = 0
  for i = 1, 3 do
    local a, r = all[i], routed[i]
    eq(a.expert_bytes_read, a.expert_bytes, "every expert read (step " .. i .. ")")
    eq(r.expert_bytes, a.expert_bytes, "the same full expert bytes (step " .. i .. ")")
    assert(r.expert_bytes_read < r.expert_bytes,
           ("step %d: read %d of %d expert bytes"):format(i, r.expert_bytes_read, r.expert_bytes))
    assert(r.nvme_read < a.nvme_read, ("step %d: %d bytes read from NVMe, not fewer than %d")
                                      :format(i, r.nvme_read, a.nvme_read))
    fewer = fewer + (a.nvme_read - r.nvme_read)
    -- The agreement: one all-reduce of 8 floats per block and micro-batch.
    eq(r.comm.all_reduce - a.comm.all_reduce, 2 * 8 * 4, "the bitmasks' bytes (step " .. i .. ")")
  end
  assert(out:find("expert bytes read [%d.]+ of [%d.]+ MiB"), out)
  print(("    3 steps: %d fewer bytes read from NVMe, expert bytes %d of %d in step 1")
        :format(fewer, routed[1].expert_bytes_read, routed[1].expert_bytes))
end

-- tools/estimate's MoE figures (estimate/moe.lua): the model's own total
-- and active counts, and per step the expert bytes a rank's stage-3
-- gathers read, the engine's full count above (fp32, 2 ranks, per expert).
function T.the_estimate_knows_total_active_and_expert_bytes()
  local models = require("models.registry")
  local emoe = require("luazero.estimate.moe")
  local model = models.new(models.config("mixtral-tiny", { moe_gather = "expert" }))
  local m = emoe.of(model, { world = 2, dtype = "fp32", threshold = 0, tokens = 4 })
  eq(m.total, model:count_params(), "total")
  eq(m.active, model:count_active_params(), "active")
  local C, H = model.cfg.n_embd, model.cfg.n_hidden
  eq(m.expert_params, 2 * 8 * 3 * C * H, "2 blocks of 8 experts")
  eq(m.total - m.active, m.expert_params - m.active_expert_params, "idle = unpicked experts")
  eq(m.read_per_step, 589824, "what stage 3 at world 2 reads gathering every expert")
  local share = 1 - (1 - 2 / 8) ^ 8
  eq(m.routed_read_per_step, 589824 * share, "routed only, 8 tokens over 2 ranks, top 2 of 8")
  eq(emoe.of(model, { world = 1, threshold = 1e5 }).read_per_step, 0,
     "experts under the persistence threshold are kept whole, never gathered")
  local dense = models.new(models.config("llama-tiny"))
  eq(emoe.of(dense, {}), nil, "no MoE blocks, no figures")
  local out = support.sh(("cd %s && tools/estimate --model mixtral-tiny --world 2 " ..
                          "--micro-batch 1 --seq-len 4 --moe-gather expert " ..
                          "--persistence-threshold 0 2>&1"):format(q(lz.root)))
  assert(out:find("moe: 2 blocks of 8 experts, top 2 a token", 1, true), out)
  assert(out:find("about 265.4 kB (7.2 of 8 experts a block routed", 1, true), out)
end

return T
