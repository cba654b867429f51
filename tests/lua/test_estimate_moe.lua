-- test_estimate_moe.lua — the estimator under expert parallelism
-- (lua/luazero/estimate/rank.lua's counts and rank with ep_size): on 4
-- ranks, at ep_size 1, 2 and 4, every ZeRO stage, 8-bit AdamW (its
-- block-scaled states in the group too), Muon (each expert's whole
-- matrices owned by a rank of its group), bf16 gradients (in the group
-- too: divided by the world size before rounding), the states, master and
-- parameter shard on NVMe, on the cpu and
-- (ep_size 2) the sim device, the estimate's placement of the experts,
-- host, device and parameter bytes equal the engine's ledger to the byte,
-- and its activation arenas (sized for every rank of the group's rows)
-- what the engine prepares; with
-- moe.routed_only a stage-3 NVMe row reads the experts at the share the
-- moe: lines expect; tools/estimate --ep-size says where the experts are.
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local estimate = require("luazero.estimate")
local emoe = require("luazero.estimate.moe")
local models = require("models.registry")

local T = {}
local q, eq = support.quote, support.eq
local _, scratch_dir, corpus = support.scratch_corpus(support.YORK, 40)
local nvme_dir = scratch_dir .. "/nvme"
os.execute("mkdir -p " .. q(nvme_dir))

-- Runs moe_estimate_check.lua on 4 ranks; returns its cases by "stage optimizer".
local function check(ep, gather, device)
  local out = support.sh(("cd %s && timeout 600 %s -n 4 tests/lua/moe_estimate_check.lua %s %d " ..
                          "%s %s %s 2>&1"):format(q(lz.root), q(lz.executable()), q(corpus), ep,
                                                  gather, device or "cpu",
                                                  q(nvme_dir)))
  assert(out:find("\ndone", 1, true) or out:find("^done"), out)
  local cases = {}
  for stage, opt, engine, est, host, ehost, params, eparams, acts, eacts, dev, edev in
      out:gmatch("case (%d) (%S+) (%a+) (%a+) host (%d+) (%d+) params (%d+) (%d+) acts (%d+) " ..
                 "(%d+) device (%d+) (%d+)") do
    cases[stage .. " " .. opt] = { engine = engine, estimate = est, host = tonumber(host),
                                   ehost = tonumber(ehost), params = tonumber(params),
                                   eparams = tonumber(eparams), acts = tonumber(acts),
                                   eacts = tonumber(eacts), dev = tonumber(dev),
                                   edev = tonumber(edev) }
  end
  return cases
end

function T.ep_estimate_matches_the_engines_ledger_at_ep_size_1_2_and_4()
  local by_ep = {}
  for _, c in ipairs({ { 1, "expert" }, { 2, "expert" }, { 4, "expert" }, { 2, "block" },
                       { 2, "expert", "sim" } }) do
    local ep, gather, device = c[1], c[2], c[3]
    local cases = check(ep, gather, device)
    local n = 0
    for name, r in pairs(cases) do
      n = n + 1
      local what = ("ep_size %d, %s, %s, stage/optimizer %s"):format(ep, gather, device or "cpu",
                                                                    name)
      local want = ep > 1 and "edp" or "world"
      eq(r.engine, want, what .. ": the engine's placement")
      eq(r.estimate, r.engine, what .. ": the estimate's placement")
      eq(r.ehost, r.host, what .. ": host bytes")
      eq(r.edev, r.dev, what .. ": device bytes")
      eq(r.eparams, r.params, what .. ": parameter bytes")
      -- (sim's allocations are whole 256-byte units)
      assert(r.acts >= r.eacts and r.acts - r.eacts < (device and 4096 or 1),
             ("%s: activation arenas %d, the estimate %d"):format(what, r.acts, r.eacts))
    end
    -- (bf16 gradients at stage 2; the states on NVMe at stage 2 too, in
    -- fp32 and bf16, and the parameter shard on NVMe at stage 3)
    eq(n, 11, ("cases at ep_size %d"):format(ep))
    if gather == "expert" and not device then by_ep[ep] = cases end
    if device then assert(cases["1 adamw"].dev > 0, "sim: the states on the device") end
  end
  -- What expert parallelism changes: a rank's working copy at stage 1 holds
  -- 1/P of the experts (docs/moe.md's ledger figures), its arenas every
  -- rank's rows (8-bit AdamW's states and Muon's whole matrices too);
  -- stage 3 holds what it did.
  eq(by_ep[1]["1 adamw"].params, 824576, "stage 1, ep_size 1")
  eq(by_ep[2]["1 adamw"].params, 529664, "stage 1, ep_size 2")
  eq(by_ep[4]["1 adamw"].params, 382208, "stage 1, ep_size 4")
  eq(by_ep[4]["3 adamw"].host, by_ep[1]["3 adamw"].host, "stage 3: a shard is 1/W either way")
  assert(by_ep[2]["2 muon"].host < by_ep[1]["2 muon"].host, "Muon in the group")
  assert(by_ep[2]["1 adamw8bit"].host < by_ep[1]["1 adamw8bit"].host, "8-bit AdamW in the group")
  assert(by_ep[1]["1 adamw"].acts < by_ep[2]["1 adamw"].acts and
         by_ep[2]["1 adamw"].acts < by_ep[4]["1 adamw"].acts, "arenas grow with ep_size")
  print(("    stage 1 parameters %d | %d | %d bytes, arenas %d | %d | %d at ep_size 1 | 2 | 4")
        :format(by_ep[1]["1 adamw"].params, by_ep[2]["1 adamw"].params,
                by_ep[4]["1 adamw"].params, by_ep[1]["1 adamw"].acts, by_ep[2]["1 adamw"].acts,
                by_ep[4]["1 adamw"].acts))
end

-- moe.routed_only at stage 3 with the frozen base on NVMe: an expert's
-- page-rounded slice is read at the share of experts uniform routing
-- reaches (estimate/moe.lua's), the rest as before; without routed_only
-- or with the experts gathered per block, every expert.
function T.routed_only_nvme_reads_count_the_routed_experts()
  local function lora_model(gather)
    local model = models.new(models.config("mixtral-tiny", { moe_gather = gather }))
    require("models.lora").apply(model, { r = 8, targets = { "q_proj", "v_proj" } })
    return model
  end
  local model = lora_model("expert")
  local counts = estimate.counts(model, 2, 0)
  local function frozen_read(c, routed)
    local r = estimate.rank(c, { stage = 3, offload = "nvme+param", dtype = "fp32", device = "cpu",
                                 tokens = 4, routed_only = routed })
    return r.traffic.parts["frozen parameters"].read
  end
  local all, routed = frozen_read(counts, false), frozen_read(counts, true)
  local m = emoe.of(model, { world = 2, dtype = "fp32", threshold = 0, tokens = 4 })
  local share = emoe.routed_share(8, 2, 8)
  -- every expert's reads (whole pages of its slice): at least the moe: line's
  local expert_pages, n = 0, 0
  for _, seg in ipairs(counts.frozen.segments) do
    if seg.expert then
      n = n + 1
      local a = math.floor(seg.shard_offset * 4 / 4096) * 4096
      expert_pages = expert_pages + 2 * (math.ceil((seg.shard_offset + seg.slice) * 4 / 4096) *
                                         4096 - a)
    end
  end
  eq(n, 2 * 8, "the frozen experts, one segment each")
  assert(expert_pages >= m.read_per_step, ("%d < %d"):format(expert_pages, m.read_per_step))
  assert(math.abs((all - routed) - (1 - share) * expert_pages) < 1e-6 * all,
         ("read %d, routed only %d: not the unrouted share %.4f of %d"):format(all, routed,
                                                                      1 - share, expert_pages))
  local block = estimate.counts(lora_model("block"), 2, 0)
  eq(frozen_read(block, true), frozen_read(block, false), "gathered per block: every expert")
  print(("    frozen reads per step %d, routed only %d (%.1f of 8 experts a block)")
        :format(all, routed, 8 * share))
end

function T.tools_estimate_says_where_the_experts_are()
  local out = support.sh(("cd %s && tools/estimate --model mixtral-tiny --world 4 --ep-size 2 " ..
                          "--device cpu --micro-batch 1 --seq-len 4 2>&1"):format(q(lz.root)))
  assert(out:find("moe: ep_size 2: each rank computes 4 of each block's 8 experts", 1, true), out)
  assert(out:find("experts: ep_size 2; in every row the experts' parameters under ZeRO over " ..
                  "their expert-data-parallel group (a rank holds 1/2 of them)\n", 1, true), out)
  -- moe.placement "world" asks for every expert under ZeRO over all ranks
  local cfg = scratch_dir .. "/world-placement.json"
  local f = assert(io.open(cfg, "w"))
  f:write('{"moe": {"ep_size": 2, "placement": "world"}, "train_micro_batch_size_per_gpu": 1}')
  f:close()
  out = support.sh(("cd %s && tools/estimate --model mixtral-tiny --world 4 --config %s " ..
                    "--device cpu --micro-batch 1 --seq-len 4 2>&1"):format(q(lz.root), q(cfg)))
  assert(out:find('experts: ep_size 2; in every row under ZeRO over all ranks (moe.placement ' ..
                  '"world"; docs/moe.md)', 1, true), out)
  out = support.sh(("cd %s && tools/estimate --model mixtral-tiny --world 4 --ep-size 3 2>&1")
                   :format(q(lz.root)))
  assert(out:find("--ep-size 3 must divide the world size 4", 1, true), out)
  out = support.sh(("cd %s && tools/estimate --model mixtral-tiny --world 6 --ep-size 3 2>&1")
                   :format(q(lz.root)))
  assert(out:find("set moe.ep_size to a divisor of 8", 1, true), out)
  -- the config's moe.gather and routed_only, as --moe-gather would give them
  cfg = scratch_dir .. "/expert-gather.json"
  f = assert(io.open(cfg, "w"))
  f:write('{"moe": {"gather": "expert", "routed_only": true}, ' ..
          '"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}')
  f:close()
  local by = {}
  for _, how in ipairs({ "--config " .. q(cfg), "--moe-gather expert" }) do
    by[how] = support.sh(("cd %s && tools/estimate --model mixtral-tiny --world 2 %s " ..
                          "--micro-batch 1 --seq-len 4 2>&1"):format(q(lz.root), how))
    assert(by[how]:find("moe: at stage 3, gathered per expert, ", 1, true) and
           by[how]:find("moe: with moe.routed_only, at 4 tokens", 1, true), by[how])
  end
  local function moe_lines(s) return assert(s:match("\n(moe: at stage 3.-)\n\n"), s) end
  eq(moe_lines(by["--config " .. q(cfg)]), moe_lines(by["--moe-gather expert"]),
     "the config's gather and --moe-gather's")
end

return T
