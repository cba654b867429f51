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
    if ep == 4 then assert(out:find("experts 0-1 | 2-3 | 4-5 | 6-7 on its ranks", 1, true), out) end
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

function T.experts_must_divide_among_the_ranks()
  local out = check(3, "block", 3, "adversarial")
  assert(out:find("moe: expert parallelism places the 8 experts on the 3 ranks of an " ..
                  "expert-parallel group, as many each: set moe.ep_size to a divisor of 8", 1,
                  true), out)
  assert(not out:find("\ndone", 1, true), out)
end

return T
