-- test_moe_ep.lua — expert parallelism in the MoE block (moe.ep_size;
-- nn/moe_experts.lua's exchange): under the launcher with adversarial
-- routing (tests/lua/moe_ep_check.lua: each rank's tokens all to its own
-- expert, so whole ranks send nothing to some group ranks and receive
-- nothing from others), every ZeRO stage finishes at each world size and
-- ep_size, gathered whole and per expert, on the checksum of ep_size 1 at
-- the same world size; with the router's own top-2 choice at world 4,
-- every stage at each ep_size ends on one checksum and the first step's
-- loss is ep_size 1's; every token piled on one expert fits the arenas; a
-- checkpoint saved under one ep_size resumes under another; experts that
-- do not divide among the ranks are refused by name.
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")

local T = {}
local q, eq = support.quote, support.eq
local write_file, scratch_dir, corpus = support.scratch_corpus(support.YORK, 40)

-- Runs moe_ep_check.lua; returns its output and { {stage, sum, rows, loss} }.
-- backend: the launcher's --backend (shm by default).
local function check(n, gather, ep, route, backend)
  local cmd = ("cd %s && timeout 600 %s %s %s tests/lua/moe_ep_check.lua %s %s %d %s 2>&1")
              :format(q(lz.root), q(lz.executable()), backend and ("--backend " .. backend) or "",
                      n > 1 and ("-n " .. n) or "", q(corpus), gather, ep, route)
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  local runs = {}
  for stage, sum, rows, loss in out:gmatch("stage (%d) (%x+) ([%d,]+) (%S+)") do
    runs[#runs + 1] = { stage = tonumber(stage), sum = sum, rows = rows, loss = tonumber(loss) }
  end
  return out, runs
end

-- Under adversarial routing each expert gets the rows of one rank alone,
-- so its owner computes the same GEMMs over the same rows as that rank
-- does without expert parallelism, and the gradient reduction adds only
-- zeros to them: every ep_size ends on ep_size 1's bits.
local function adversarial(n)
  local _, base = check(n, "block", 1, "adversarial")
  eq(#base, 4, "stages run at ep_size 1")
  for _, ep in ipairs({ 2, 4 }) do
    if ep <= n and n % ep == 0 then
      for _, gather in ipairs({ "block", "expert" }) do
        local out, runs = check(n, gather, ep, "adversarial")
        assert(out:find("\ndone", 1, true), out)
        eq(#runs, 4, ("stages run (ep_size %d, %s)"):format(ep, gather))
        for _, r in ipairs(runs) do
          eq(r.rows, "32,0,0,0,0,0,0,0", ("rank 0's tokens at expert 0 (stage %d)"):format(r.stage))
          eq(r.sum, base[1].sum, ("checksum at ep_size %d, stage %d, %s")
                                 :format(ep, r.stage, gather))
        end
        assert(out:find(("ep_size %d (expert-parallel ranks"):format(ep), 1, true), out)
      end
    end
  end
  print(("    world %d: ep_size 1%s, stages 0-3, end on %s"):format(n,
        n >= 4 and ", 2, 4" or n >= 2 and n % 2 == 0 and ", 2" or "", base[1].sum))
end

for n = 2, 4 do
  if n ~= 3 then
    T[("adversarial_routing_under_expert_parallelism_at_world_%d"):format(n)] =
      function() adversarial(n) end
  end
end

function T.router_routing_at_world_4_ends_on_one_checksum_per_ep_size()
  local loss1
  for _, ep in ipairs({ 1, 2, 4 }) do
    local out, runs = check(4, "block", ep, "router")
    eq(#runs, 4, "stages run at ep_size " .. ep)
    for _, r in ipairs(runs) do
      eq(r.sum, runs[1].sum, ("ep_size %d, stage %d checksum"):format(ep, r.stage))
    end
    -- OpenMPI's groups exchange the same rows (where mpirun is installed)
    if ep == 2 and os.execute("command -v mpirun >/dev/null 2>&1") == 0 then
      local mout, mpi = check(4, "block", ep, "router", "mpi")
      eq(#mpi, 4, "stages run under mpi\n" .. mout)
      for _, r in ipairs(mpi) do
        eq(r.sum, runs[1].sum, ("mpi, stage %d checksum"):format(r.stage))
      end
    end
    loss1 = loss1 or runs[1].loss
    assert(math.abs(runs[1].loss - loss1) <= 1e-6 * loss1,
           ("first-step loss %.9g at ep_size %d, %.9g at 1"):format(runs[1].loss, ep, loss1))
    if ep == 4 then
      assert(out:find("experts 0-1 | 2-3 | 4-5 | 6-7 on its ranks (their parameters under ZeRO " ..
                      "over their expert-data-parallel group)", 1, true), out)
    end
  end
end

-- Every token of every rank to expert 0: its rank receives the rows of all
-- ep_size ranks, the most the arenas are sized for (an arena sized for its
-- own rows alone fails here), and the others receive none.
function T.all_tokens_to_one_expert_fit_and_finish()
  for _, ep in ipairs({ 2, 4 }) do
    local out, runs = check(4, "expert", ep, "pile")
    assert(out:find("\ndone", 1, true), out)
    eq(#runs, 4, "stages run at ep_size " .. ep)
    for _, r in ipairs(runs) do
      eq(r.sum, runs[1].sum, ("ep_size %d, stage %d checksum"):format(ep, r.stage))
    end
  end
end

-- The checkpoint holds every expert whatever ep_size saved it: saved under
-- ep_size 2 on 4 ranks at step 2, it resumes under ep_size 2 on the
-- straight run's checksum, and under ep_size 4 and 1 on one checksum (on 4
-- ranks ep_size 4 computes ep_size 1's bits: one rank adds all four source
-- ranks' expert gradients in the order the all-reduce would).
function T.a_checkpoint_resumes_under_another_ep_size()
  local dir = scratch_dir .. "/ep-ck"
  local model = "--model mixtral-tiny --seq-len 16 --micro-batch 2 --sample 0 --eval-batches 1 " ..
                "--steps 4 --stage 3 --dtype bf16 --data " .. q(corpus)
  local _, ok_train = support.trainer(model)
  local function cfg(ep)
    return write_file(("ep%d.json"):format(ep),
                      ('{"train_micro_batch_size_per_gpu": 2, "moe": {"ep_size": %d}}'):format(ep))
  end
  local _, straight = ok_train(4, ("--config %s --save-every 2 --save %s")
                                     :format(q(cfg(2)), q(dir)))
  local from = q(dir .. "/step-000002")
  local _, again = ok_train(4, ("--config %s --resume %s"):format(q(cfg(2)), from))
  eq(again, straight, "resumed under ep_size 2")
  local _, four = ok_train(4, ("--config %s --resume %s"):format(q(cfg(4)), from))
  local _, one = ok_train(4, ("--config %s --resume %s"):format(q(cfg(1)), from))
  eq(four, one, "resumed under ep_size 4 and 1")
end

-- Runs moe_edp_check.lua on x.n ranks (4); returns { sum, placement,
-- norms (the steps' gradient norms, one string), params, grads (the
-- ledger's bytes), gathered, describe }, after checking that
-- engine:master_params() holds the checksum's bytes (the whole model's,
-- every group's experts included). x (optional): n, backend (the
-- launcher's --backend, shm by default), placement (moe.placement, group
-- by default; "world": the reference placement). A run that neither saves
-- nor loads is a function of its arguments (training is deterministic),
-- so one already made is not made again.
local made = {}
local function edp(ep, stage, save, load, accum, gather, optimizer, dtype, device, offload, x)
  x = x or {}
  local cmd = ("cd %s && timeout 600 %s %s -n %d tests/lua/moe_edp_check.lua %s %d %d %s %s %d " ..
               "%s %s %s %s %s %s 2>&1")
              :format(q(lz.root), q(lz.executable()), x.backend and ("--backend " .. x.backend) or "",
                      x.n or 4, q(corpus), ep, stage, save or "-",
                      load or "-", accum or 1, dtype or "fp32", gather or "expert",
                      optimizer or "AdamW", device or "cpu", offload or "none",
                      x.placement or "group")
  local again = not save and not load and made[cmd]
  if again then return again end
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  local sum, placement, norms, params, grads, gathered =
    out:match("sum (%x+) (%a+) (.-) params (%d+) grads (%d+) gathered (%d+)")
  assert(sum, out)
  local master, numel = out:match("master_params (%x+) (%d+)")
  eq(master, sum, "engine:master_params() against the checksum")
  local r = { sum = sum, placement = placement, norms = norms, params = tonumber(params),
              grads = tonumber(grads), gathered = tonumber(gathered),
              describe = out:match("describe ([^\n]*)"), numel = tonumber(numel) }
  if not save and not load then made[cmd] = r end
  return r
end

-- Experts under ZeRO within their expert-data-parallel group (stages 0-3,
-- experts gathered per expert, and as whole blocks): a rank keeps only the experts it computes
-- (the ledger's parameter bytes fall by (P - 1) / P of the experts' at
-- stages 0-2, and at stages 0-1 the whole gradients' too; a shard is 1 / W of
-- them either way; stage 3 gathers a rank's own experts only, over its
-- group: fewer bytes sent as P grows), and training with clipping in effect ends on the
-- world placement's bits (moe.placement "world" at stage 0), gradient
-- norms included; engine:master_params() holds every expert; a checkpoint it saves (at stage 0 one shard per rank,
-- each rank's slices) holds every expert once and resumes under either
-- placement and any ep_size, and one saved under the world placement
-- resumes under it; with gradient accumulation too.
function T.experts_live_in_their_group_at_stages_0_to_3()
  local layout = require("luazero.zero.layout")
  local mixtral = require("models.mixtral")
  local pt = mixtral.new(mixtral.config("mixtral-tiny", { moe_gather = "expert" })).param_table
  local experts = 0 -- bytes of the experts' padded segments, fp32
  for _, seg in ipairs(layout.new(pt, 4).segments) do
    local m = seg.module
    if m.expert_of and m.expert_of[seg.entries[1].entry.key] then
      experts = experts + 4 * seg.padded
    end
  end
  local function world(ep, stage, accum, gather, load, save)
    return edp(ep, stage, save, load, accum, gather, nil, nil, nil, nil, { placement = "world" })
  end
  local w0 = world(2, 0)
  local s0, s1, s2, s3 = edp(2, 0), edp(2, 1), edp(2, 2), edp(2, 3)
  eq(s0.placement, "edp", "stage 0's placement")
  eq(s1.placement, "edp", "stage 1's placement")
  eq(s2.placement, "edp", "stage 2's placement")
  eq(s3.placement, "edp", "stage 3's placement")
  eq(w0.placement, "world", "moe.placement world's placement")
  assert(s3.describe:find("ep_size 2 (expert-parallel ranks 0 1, expert-data-parallel ranks 0 " ..
                          "2), experts 0-3 | 4-7 on its ranks (their parameters under ZeRO over " ..
                          "their expert-data-parallel group)", 1, true), s3.describe)
  assert(w0.describe:find("(their parameters under ZeRO over all ranks)", 1, true), w0.describe)
  for _, r in ipairs({ s0, s1, s2, s3 }) do
    eq(r.sum, w0.sum, "checksum against stage 0 under the world placement")
    eq(r.norms, w0.norms, "gradient norms against stage 0 under the world placement")
    eq(r.numel, w0.numel, "engine:master_params()'s elements against the world placement's")
  end
  -- experts gathered as whole blocks: each block's segment is cut per
  -- owner under either placement, so the norms agree too (stages 2-3 per
  -- block run with 8-bit states, Muon, on sim and on NVMe below)
  local b0, b1 = world(2, 0, 1, "block"), edp(2, 1, nil, nil, 1, "block")
  eq(b1.placement, "edp", "placement, block gather")
  eq(b1.sum, b0.sum, "checksum, block gather")
  eq(b1.norms, b0.norms, "gradient norms, block gather")
  eq(b1.params, s1.params, "parameter bytes, block gather")
  -- with gradient accumulation (every micro-step's gradients reduced)
  local a0 = world(2, 0, 2)
  for _, stage in ipairs({ 0, 2, 3 }) do
    local a = edp(2, stage, nil, nil, 2)
    eq(a.placement, "edp", "placement with accumulation")
    eq(a.sum, a0.sum, "checksum with accumulation at stage " .. stage)
    eq(a.norms, a0.norms, "gradient norms with accumulation at stage " .. stage)
  end
  for _, stage in ipairs({ 0, 1, 2, 3 }) do
    local one = edp(1, stage)
    eq(one.placement, "world", "ep_size 1's placement")
    for _, P in ipairs({ 2, 4 }) do
      local r = P == 2 and ({ [0] = s0, s1, s2, s3 })[stage] or edp(4, stage)
      eq(r.placement, "edp", "placement at ep_size " .. P)
      local what = (" at stage %d, ep_size %d"):format(stage, P)
      eq(one.params - r.params, stage < 3 and experts * (P - 1) / P or 0, "parameter bytes" .. what)
      eq(one.grads - r.grads, stage <= 1 and experts * (P - 1) / P or 0, "gradient bytes" .. what)
      -- stage 3 gathers this rank's experts alone, over its group
      if stage == 3 then
        assert(r.gathered < (P == 2 and one.gathered or s3.gathered),
               ("gathered %d bytes at ep_size %d"):format(r.gathered, P))
      end
    end
  end
  -- saved under either placement, resumed under both (each stage once)
  local dir = scratch_dir .. "/edp-ck"
  edp(2, 1, dir .. "/edp")
  edp(2, 0, dir .. "/edp0")
  world(2, 0, 1, nil, nil, dir .. "/world")
  for _, c in ipairs({ { "edp", 0 }, { "edp", 3 }, { "edp0", 1 }, { "edp0", 2 }, { "world", 0 },
                       { "world", 2 } }) do
    eq(edp(2, c[2], nil, dir .. "/" .. c[1] .. "/step-000002").sum, w0.sum,
       ("%s checkpoint resumed at stage %d"):format(c[1], c[2]))
  end
  eq(world(2, 0, 1, nil, dir .. "/edp0/step-000002").sum, w0.sum,
     "a stage-0 checkpoint of the group placement resumed under the world placement")
  for _, saved in ipairs({ "edp", "edp0", "world" }) do
    -- (on 4 ranks ep_size 4 adds an expert's four sources in the world's
    -- all-reduce order, as ep_size 1 does)
    local from = dir .. "/" .. saved .. "/step-000002"
    local four, single = edp(4, 1, nil, from), edp(1, 1, nil, from)
    eq(four.placement, "edp", "ep_size 4's placement")
    eq(four.sum, single.sum, saved .. " checkpoint resumed under ep_size 4 and 1")
  end
end

-- run(2, 1) keeps the experts in their group and fewer parameter bytes at
-- stage 1 than run(1, 1).
local function fewer_bytes_at_ep_size_2(run)
  local two, one = run(2, 1), run(1, 1)
  eq(two.placement, "edp", "ep_size 2's placement")
  assert(two.params < one.params, ("stage 1 parameter bytes %d at ep_size 2, %d at 1")
                                  :format(two.params, one.params))
end

-- Each { saved, stage } of cases: dir/saved's step-2 checkpoint resumed by
-- run at that stage ends on want.
local function resumed(run, dir, cases, want, what)
  for _, c in ipairs(cases) do
    eq(run(2, c[2], { load = dir .. "/" .. c[1] .. "/step-000002" }).sum, want,
       ("%s saved under the %s placement resumed at stage %d"):format(what, c[1], c[2]))
  end
end

-- 8-bit AdamW (block-scaled states) with the experts in their group: a
-- segment pads to world x 256 elements under either placement, so an
-- expert's group slice holds whole blocks of the world layout and every
-- block is quantised as under ZeRO over the world. Stages 1-3 end on
-- stage 0's checksum and gradient norms at ep_size 2 and 4, gathered per
-- expert and per block, with accumulation and in bf16; stage 1 holds
-- fewer parameter bytes than at ep_size 1; a checkpoint saved under
-- either placement resumes under the other.
function T.eight_bit_adamw_keeps_the_experts_in_their_group()
  local function q8(ep, stage, o)
    o = o or {}
    return edp(ep, stage, o.save, o.load, o.accum, o.gather, "AdamW8bit", o.dtype, nil, nil,
               { placement = o.placement })
  end
  local base, runs = support.same_as_stage_0(q8, {
    { 2, {}, "ep_size 2" },
    { 4, { gather = "block", accum = 2 }, "ep_size 4, per block, accumulation" },
    { 2, { dtype = "bf16" }, "ep_size 2, bf16" },
  })
  fewer_bytes_at_ep_size_2(q8)
  local dir = scratch_dir .. "/q8-ck"
  q8(2, 1, { save = dir .. "/edp" })
  q8(2, 0, { save = dir .. "/edp0" })
  q8(2, 0, { save = dir .. "/world", placement = "world" })
  resumed(q8, dir, { { "edp", 0 }, { "edp0", 3 }, { "world", 1 } }, base.sum, "8-bit states")
  print(("    %d runs with 8-bit states in the experts' group on stage 0's bits"):format(runs))
end

-- Muon (whole matrices) with the experts in their group: each expert's
-- matrices are owned whole by a rank of its expert-data-parallel group,
-- gathered and broadcast over that group, the others' over the world, and
-- a matrix orthogonalised from the same bits by the same GEMMs on any
-- rank. Stages 1-3 end on stage 0's checksum and gradient norms at
-- ep_size 2 and 4, per expert and per block, with accumulation, in bf16,
-- on sim with the states on the device (the groups' collectives of device
-- tensors) and offloaded to the cpu, and at stage 3 with the parameter
-- shard on NVMe; stage 1 holds fewer parameter bytes than at ep_size 1; a
-- checkpoint saved under either placement resumes under the other, and
-- under ep_size 4 as under ep_size 1.
function T.muon_keeps_the_experts_in_their_group()
  local function mu(ep, stage, o)
    o = o or {}
    return edp(ep, stage, o.save, o.load, o.accum, o.gather, "Muon", o.dtype, o.device, o.offload,
               { placement = o.placement })
  end
  local base, runs = support.same_as_stage_0(mu, {
    { 2, {}, "ep_size 2" },
    { 4, { device = "sim", gather = "block" }, "ep_size 4, sim, per block" },
    { 2, { accum = 2, dtype = "bf16", device = "sim", offload = "cpu" },
      "ep_size 2, accumulation, bf16, sim, offloaded" },
  })
  local nvme = scratch_dir .. "/muon-nvme"
  os.execute("mkdir -p " .. q(nvme))
  local shard = mu(2, 3, { offload = "cpu+param-nvme:" .. nvme })
  eq(shard.placement, "edp", "placement, the parameter shard on NVMe")
  eq(shard.sum, base.sum, "checksum, the parameter shard on NVMe")
  eq(shard.norms, base.norms, "gradient norms, the parameter shard on NVMe")
  fewer_bytes_at_ep_size_2(mu)
  local dir = scratch_dir .. "/muon-ck"
  mu(2, 2, { save = dir .. "/edp" })
  mu(2, 0, { save = dir .. "/world", placement = "world" })
  resumed(mu, dir, { { "edp", 0 }, { "edp", 3 }, { "world", 1 } }, base.sum, "Muon")
  local from = dir .. "/edp/step-000002"
  local four, single = mu(4, 1, { load = from }), mu(1, 1, { load = from })
  eq(four.placement, "edp", "ep_size 4's placement resuming Muon")
  eq(four.sum, single.sum, "Muon checkpoint resumed under ep_size 4 and 1")
  print(("    %d runs of Muon with the experts in their group on stage 0's bits"):format(runs + 1))
end

-- Half-precision gradients (data_types.grad_accum_dtype bf16 or fp16):
-- the experts live in their group at stages 1-3, the group's sum divided
-- by the world size before its one rounding to the gradients' dtype (as
-- the world's average divides), and end on stage 0's checksum and gradient
-- norms at ep_size 2 and 4 (groups of one rank: the division alone), with
-- accumulation, under OpenMPI too; a checkpoint saved under the group
-- placement resumes at stage 0.
function T.half_gradients_keep_the_experts_in_their_group()
  local function half(ep, stage, o)
    o = o or {}
    return edp(ep, stage, o.save, o.load, o.accum, o.gather, nil, o.dtype, nil, nil,
               { backend = o.backend, placement = o.placement })
  end
  local base, runs = support.same_as_stage_0(half, {
    { 2, { dtype = "bf16-grads" }, "ep_size 2, bf16 gradients" },
    { 4, { dtype = "bf16-grads" }, "ep_size 4, bf16 gradients" },
    { 2, { dtype = "bf16-grads", accum = 2, gather = "block" },
      "ep_size 2, bf16 gradients, accumulation, per block" },
    { 2, { dtype = "fp16-grads" }, "ep_size 2, fp16 gradients" },
  })
  if os.execute("command -v mpirun >/dev/null 2>&1") == 0 then
    local m = half(2, 2, { dtype = "bf16-grads", backend = "mpi" })
    eq(m.placement, "edp", "placement under mpi")
    eq(m.sum, base.sum, "bf16 gradients under mpi, stage 2")
    eq(m.norms, base.norms, "bf16 gradients under mpi, stage 2's gradient norms")
    runs = runs + 1
  end
  local dir = scratch_dir .. "/half-ck"
  half(2, 3, { dtype = "bf16-grads", save = dir .. "/edp" })
  eq(half(2, 0, { dtype = "bf16-grads", load = dir .. "/edp/step-000002" }).sum, base.sum,
     "bf16 gradients: saved under the group placement, resumed at stage 0")
  print(("    %d runs with half gradients in the experts' group on stage 0's bits"):format(runs))
end

-- On the sim device (its memory apart from the host's, as a GPU's): the
-- experts live in their group at stages 0-3 and end on the cpu's stage-0
-- checksum and gradient norms (the experts over the world there), at ep_size 2 and 4, per expert and per
-- block, with accumulation, in bf16, with the optimizer (and at stage 3
-- the parameters) offloaded to the cpu, and to NVMe (the states; in bf16
-- the master; at stage 3 the parameter shard); a checkpoint saved on sim
-- resumes on the cpu, and one saved on the cpu on sim.
function T.experts_live_in_their_group_on_sim()
  local function on(ep, stage, o)
    o = o or {}
    return edp(ep, stage, o.save, o.load, o.accum, o.gather, nil, o.dtype, o.device or "sim",
               o.offload, { placement = o.placement })
  end
  local runs = 0
  local function same_as_cpu_stage_0(ep, o, what)
    local c0 = on(ep, 0, { accum = o.accum, gather = o.gather, dtype = o.dtype, device = "cpu",
                           placement = "world" })
    eq(c0.placement, "world", "the reference's placement, " .. what)
    for stage = 0, 3 do
      local r = on(ep, stage, o)
      eq(r.placement, "edp", ("stage %d's placement, %s"):format(stage, what))
      eq(r.sum, c0.sum, ("checksum at stage %d, %s"):format(stage, what))
      eq(r.norms, c0.norms, ("gradient norms at stage %d, %s"):format(stage, what))
      runs = runs + 1
    end
    return c0
  end
  local base = same_as_cpu_stage_0(2, {}, "ep_size 2")
  same_as_cpu_stage_0(4, { gather = "block", accum = 2 }, "ep_size 4, per block, accumulation")
  same_as_cpu_stage_0(2, { dtype = "bf16", offload = "cpu" },
                      "ep_size 2, bf16, offloaded to the cpu")
  local nvme = scratch_dir .. "/sim-nvme"
  os.execute("mkdir -p " .. q(nvme))
  same_as_cpu_stage_0(2, { offload = "nvme:" .. nvme }, "ep_size 2, the states on NVMe")
  same_as_cpu_stage_0(4, { dtype = "bf16", gather = "block", offload = "nvme+param:" .. nvme },
                      "ep_size 4, bf16, per block, the master and at stage 3 the parameters " ..
                      "on NVMe")
  local dir = scratch_dir .. "/sim-ck"
  on(2, 1, { save = dir .. "/sim" })
  on(2, 3, { save = dir .. "/cpu", device = "cpu" })
  on(2, 0, { save = dir .. "/sim0" })
  eq(on(2, 0, { load = dir .. "/sim/step-000002", device = "cpu" }).sum, base.sum,
     "saved on sim, resumed on the cpu")
  eq(on(2, 1, { load = dir .. "/sim0/step-000002", device = "cpu" }).sum, base.sum,
     "saved on sim at stage 0, resumed on the cpu")
  eq(on(2, 2, { load = dir .. "/cpu/step-000002" }).sum, base.sum,
     "saved on the cpu, resumed on sim")
  on(2, 3, { save = dir .. "/sim-nvme", offload = "nvme+param:" .. nvme })
  eq(on(2, 0, { load = dir .. "/sim-nvme/step-000002", device = "cpu" }).sum, base.sum,
     "saved on sim from NVMe, resumed on the cpu")
  eq(on(2, 2, { load = dir .. "/cpu/step-000002", offload = "nvme:" .. nvme }).sum, base.sum,
     "saved on the cpu, resumed on sim onto NVMe")
  print(("    %d runs on sim on the cpu's stage-0 bits"):format(runs))
end

-- The optimizer's states on NVMe: the experts live in their group at
-- stages 1-3, the gradients spilled to NVMe at stages 2-3 with one norm
-- partial per world slice, on stage 0's checksum and gradient norms at
-- ep_size 2 and 4, with accumulation and 8-bit states, in fp32 (the
-- parameters are the master) and in bf16 (the fp32 master in the state
-- file: start-up writes each group's slice of the drawn weights there, the
-- checksum and checkpoints read it back group by group); checkpoints
-- resume across the placements and dtypes' tiers, and under ep_size 4 as
-- under ep_size 1 (and on 2 ranks under ep_size 2 as under 1).
function T.experts_live_in_their_group_with_states_on_nvme()
  local dir = scratch_dir .. "/nvme-states"
  os.execute("mkdir -p " .. q(dir))
  local function nv(ep, stage, o)
    o = o or {}
    return edp(ep, stage, o.save, o.load, o.accum, o.gather, o.optimizer, o.dtype, nil,
               stage > 0 and "nvme:" .. dir or nil, { n = o.n, placement = o.placement })
  end
  local base, runs = support.same_as_stage_0(nv, {
    { 2, {}, "ep_size 2" },
    { 4, { accum = 2, optimizer = "AdamW8bit" }, "ep_size 4, accumulation, 8-bit states" },
    { 2, { dtype = "bf16", gather = "block" }, "ep_size 2, bf16 (the master on NVMe), per block" },
    { 4, { dtype = "bf16", accum = 2, optimizer = "AdamW8bit" },
      "ep_size 4, bf16, accumulation, 8-bit states" },
  })
  local ck = scratch_dir .. "/nvme-ck"
  nv(2, 2, { save = ck .. "/nvme" })
  eq(nv(2, 0, { load = ck .. "/nvme/step-000002" }).sum, base.sum, "NVMe states resumed at stage 0")
  eq(nv(2, 3, { load = ck .. "/nvme/step-000002" }).sum, base.sum, "NVMe states resumed at stage 3")
  -- a bf16 master saved from the state file, and one saved from memory
  -- under the world placement loaded into it
  local b0 = nv(2, 0, { dtype = "bf16", save = ck .. "/bf16-world", placement = "world" })
  nv(2, 2, { dtype = "bf16", save = ck .. "/bf16-nvme" })
  for _, c in ipairs({ { "bf16-nvme", 0 }, { "bf16-nvme", 3 }, { "bf16-world", 1 } }) do
    local r = nv(2, c[2], { dtype = "bf16", load = ck .. "/" .. c[1] .. "/step-000002" })
    eq(r.placement, "edp", "placement resuming " .. c[1])
    eq(r.sum, b0.sum, ("%s checkpoint resumed at stage %d"):format(c[1], c[2]))
  end
  -- the NVMe checkpoints under another ep_size (on 4 ranks ep_size 4 adds
  -- an expert's sources in the world's all-reduce order, as ep_size 1
  -- does; on 2 ranks ep_size 2 as ep_size 1) and another world size
  for _, c in ipairs({ { "nvme", "fp32" }, { "bf16-nvme", "bf16" } }) do
    local from = ck .. "/" .. c[1] .. "/step-000002"
    local four = nv(4, 2, { dtype = c[2], load = from })
    local one = nv(1, 2, { dtype = c[2], load = from })
    eq(four.placement, "edp", "ep_size 4's placement resuming " .. c[1])
    eq(four.sum, one.sum, c[1] .. " checkpoint resumed under ep_size 4 and 1")
  end
  local from = ck .. "/nvme/step-000002"
  local two, one = nv(2, 3, { load = from, n = 2 }), nv(1, 3, { load = from, n = 2 })
  eq(two.placement, "edp", "ep_size 2's placement on 2 ranks")
  eq(two.sum, one.sum, "NVMe checkpoint resumed on 2 ranks under ep_size 2 and 1")
  print(("    %d runs with the states on NVMe on stage 0's bits"):format(runs))
end

-- The parameter shard on NVMe (offload_param at stage 3, the states on
-- NVMe at stages 1-3): each rank's parameter file holds its slices of its
-- own experts, sliced over its group, and a gather reads them from there;
-- stages 1-3 end on stage 0's checksum and gradient norms at ep_size 2 and
-- 4, per expert and per block, in fp32 and bf16, with accumulation and
-- 8-bit states; checkpoints resume across the placements and tiers.
function T.experts_live_in_their_group_with_the_parameter_shard_on_nvme()
  local dir = scratch_dir .. "/nvme-param"
  os.execute("mkdir -p " .. q(dir))
  local function nv(ep, stage, o)
    o = o or {}
    return edp(ep, stage, o.save, o.load, o.accum, o.gather, o.optimizer, o.dtype, nil,
               stage > 0 and "nvme+param:" .. dir or nil, { placement = o.placement })
  end
  local base, runs = support.same_as_stage_0(nv, {
    { 2, {}, "ep_size 2" },
    { 4, { dtype = "bf16", accum = 2, gather = "block", optimizer = "AdamW8bit" },
      "ep_size 4, bf16, accumulation, per block, 8-bit states" },
  })
  local ck = scratch_dir .. "/nvme-param-ck"
  nv(2, 3, { save = ck .. "/nvme" })
  nv(2, 0, { save = ck .. "/world", placement = "world" })
  eq(nv(2, 0, { load = ck .. "/nvme/step-000002" }).sum, base.sum,
     "saved from NVMe, resumed at stage 0")
  eq(nv(2, 3, { load = ck .. "/nvme/step-000002" }).sum, base.sum, "saved from NVMe, resumed there")
  eq(nv(2, 3, { load = ck .. "/world/step-000002" }).sum, base.sum,
     "saved under the world placement, resumed onto NVMe")
  print(("    %d runs with the parameter shard on NVMe on stage 0's bits"):format(runs))
end

-- moe_edp_check.lua takes the OFFLOAD forms it names, whole: a misspelt
-- one stops it rather than running another placement.
function T.the_edp_check_refuses_an_offload_it_does_not_name()
  for _, how in ipairs({ "nvme+par:/tmp", "nvme+paramx:/tmp", "nvm:/tmp", "cpu+param" }) do
    local p = io.popen(("cd %s && %s tests/lua/moe_edp_check.lua %s 1 3 - - 1 fp32 expert " ..
                        "AdamW cpu %s 2>&1"):format(q(lz.root), q(lz.executable()), q(corpus),
                                                    q(how)))
    local out = p:read("*a")
    p:close()
    assert(out:find(("OFFLOAD %q: expected none, cpu, nvme:DIR"):format(how), 1, true), out)
    assert(not out:find("\nsum ", 1, true), out)
  end
end

function T.experts_must_divide_among_the_ranks()
  local out = check(3, "block", 3, "adversarial")
  assert(out:find("moe: expert parallelism places the 8 experts on the 3 ranks of an " ..
                  "expert-parallel group, as many each: set moe.ep_size to a divisor of 8", 1,
                  true), out)
  assert(not out:find("\ndone", 1, true), out)
end

return T
