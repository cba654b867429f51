-- test_moe_layout.lua — the layout's expert placement (zero/layout.lua's
-- place): with ep_size P, a rank's layout holds the parameters every rank
-- trains and only the experts its expert-parallel group rank computes,
-- those sliced over its expert-data-parallel group; over all ranks every
-- element lies in exactly one shard (each expert written once, by its
-- owners), a rank holds 1/P of the expert elements, and ep_size 1 (or no
-- place) is the world layout, offset for offset. The plan's experts field.
local lz = require("luazero")
local layout = require("luazero.zero.layout")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local mixtral = require("models.mixtral")

local T = {}
local eq = support.eq

local function model(gather)
  return mixtral.new(mixtral.config("mixtral-tiny", { moe_gather = gather }))
end

local function place(rank, P)
  return { rank = rank, ep_size = P, owner = layout.expert_owner(P) }
end

-- Elements of expert parameters, and of all.
local function counts(pt)
  local experts, all = 0, 0
  for _, e in ipairs(pt) do
    local m = e.module
    if m.expert_of and m.expert_of[e.key] then experts = experts + e.numel end
    all = all + e.numel
  end
  return experts, all
end

-- Marks the canonical elements runs cover; fails on one covered twice.
local function cover(seen, runs, what)
  for _, r in ipairs(runs) do
    for i = r.canonical, r.canonical + r.numel - 1 do
      assert(not seen[i], ("%s: element %d in two shards"):format(what, i))
      seen[i] = true
    end
  end
end

function T.ep_size_1_is_the_world_layout()
  local pt = model("block").param_table
  local W = layout.new(pt, 4)
  for r = 0, 3 do
    local L = layout.new(pt, 4, nil, nil, place(r, 1))
    eq(#L.segments, #W.segments, "segments")
    eq(L.full_numel, W.full_numel, "full")
    eq(L.shard_numel, W.shard_numel, "shard")
    for i, s in ipairs(L.segments) do
      local w = W.segments[i]
      assert(s.full_offset == w.full_offset and s.shard_offset == w.shard_offset and
             s.slice == w.slice and s.group == nil, "segment " .. i)
    end
    local a, b = layout.canonical_runs(L, r), layout.canonical_runs(W, r)
    eq(#a, #b, "runs")
  end
end

for _, gather in ipairs({ "block", "expert" }) do
  for _, wp in ipairs({ { 2, 2 }, { 4, 2 }, { 4, 4 } }) do
    local W, P = wp[1], wp[2]
    T[("experts_live_with_their_owners_%s_world_%d_ep_%d"):format(gather, W, P)] = function()
      local pt = model(gather).param_table
      local experts, all = counts(pt)
      assert(experts > 0 and experts % P == 0)
      local world = layout.new(pt, W)
      local seen = {}
      for r = 0, W - 1 do
        local L = layout.new(pt, W, nil, nil, place(r, P))
        -- 1/P of the expert elements here, the others elsewhere
        eq(L.elsewhere, experts - experts / P, "elsewhere")
        eq(L.numel, all - L.elsewhere, "numel")
        local own_experts, padded_experts, world_experts = 0, 0, 0
        for _, s in ipairs(L.segments) do
          if s.group == "edp" then
            own_experts = own_experts + s.numel
            padded_experts = padded_experts + s.padded
            eq(s.gworld, W / P, "edp size")
            eq(s.grank, math.floor(r / P), "edp rank")
            eq(s.owner, r % P, "owner")
          end
        end
        for _, s in ipairs(world.segments) do
          if s.module.expert_of and s.module.expert_of[s.entries[1].entry.key] then
            world_experts = world_experts + s.padded
          end
        end
        eq(own_experts, experts / P, "own experts")
        -- the full buffer (stages 0-2's working copy) holds 1/P of the
        -- expert bytes the world layout does (block: each segment cut P ways)
        if gather == "expert" then eq(padded_experts * P, world_experts, "padded experts") end
        eq(L.full_numel, world.full_numel - (world_experts - padded_experts), "full numel")
        -- this rank's shard: the runs cover it, padding included
        local n = 0
        for _, run in ipairs(layout.shard_runs(L, r)) do n = n + run.numel end
        eq(n, L.shard_numel, "shard runs")
        cover(seen, layout.canonical_runs(L, r), ("rank %d"):format(r))
        -- a rank of another expert-data-parallel group has no slice of an
        -- expert segment; one of this group has one, at its own index
        for q = 0, W - 1 do
          for _, s in ipairs(L.segments) do
            local k = layout.slice_of(L, s, q)
            if s.group == "edp" then
              eq(k, q % P == r % P and math.floor(q / P) or nil, "slice of")
            else
              eq(k, q, "slice of")
            end
          end
        end
      end
      -- every element in exactly one rank's shard
      for i = 0, all - 1 do assert(seen[i], ("element %d in no shard"):format(i)) end
    end
  end
end

-- The world placement under expert parallelism (place.everywhere): the
-- same segments as any rank's group layout holds, cut per owner, every one
-- kept and sliced over the world.
function T.the_world_placement_cuts_alike()
  local pt = model("block").param_table
  local W = layout.new(pt, 4, nil, nil, { rank = 1, ep_size = 2, owner = layout.expert_owner(2),
                                     everywhere = true })
  eq(W.elsewhere, 0, "elsewhere")
  local plain = layout.new(pt, 4)
  -- each block's one segment of experts becomes two
  local blocks = 0
  for _, s in ipairs(plain.segments) do
    if s.module.expert_of and s.module.expert_of[s.entries[1].entry.key] then
      blocks = blocks + 1
    end
  end
  eq(#W.segments, #plain.segments + blocks, "segments")
  local mine = layout.new(pt, 4, nil, nil, place(1, 2))
  local at = {}
  for _, s in ipairs(W.segments) do
    assert(s.group == nil and s.slice == s.padded / 4, "sliced over the world")
    at[s.entries[1].entry] = s
  end
  for _, s in ipairs(mine.segments) do
    local w = at[s.entries[1].entry]
    assert(w and w.numel == s.numel and w.padded == s.padded, "a segment the world layout has")
  end
end

-- The replicated optimizer's view (stage 0: every rank's slices, rank nil)
-- covers this rank's parameters whole: the shared ones and its own experts.
function T.full_runs_cover_own_experts()
  local pt = model("block").param_table
  local experts, all = counts(pt)
  local L = layout.new(pt, 4, nil, nil, place(1, 2))
  local n = 0
  for _, run in ipairs(layout.canonical_runs(L, nil)) do n = n + run.numel end
  eq(n, all - experts / 2, "full runs")
  local m = 0
  for r = 0, 3 do
    for _, run in ipairs(layout.shard_runs(L, r)) do m = m + run.numel end
  end
  eq(m, L.full_numel, "every slice once")
end

-- The plan says where the experts' parameters live under expert
-- parallelism: their group at stages 0-3 on every device, with gradients
-- in any dtype, wherever the states, master and parameter shard live, the
-- world where moe.placement says "world"; and nothing of experts without it.
function T.the_plan_says_where_experts_live()
  local Placement = require("luazero.zero.plan")
  for stage = 0, 3 do
    for _, where in ipairs({ "group", "world" }) do
      local p = Placement.new{ stage = stage, ep_size = 2, expert_placement = where }
      local edp = where == "group"
      eq(p.experts, edp and "edp" or "world", ("placement at stage %d, %s"):format(stage, where))
      local text = tostring(p)
      assert(text:find("experts    ep_size 2, parameters under ZeRO over " ..
                       (edp and "the expert-data-parallel group" or "all ranks"), 1, true),
             text)
    end
    assert(not tostring(Placement.new{ stage = stage }):find("experts", 1, true))
  end
  eq(Placement.new{ stage = 1, ep_size = 2, accum = 2 }.experts, "edp", "accumulation")
  eq(Placement.new{ stage = 2, ep_size = 2, dtype = "bf16", grad_dtype = "bf16" }.experts, "edp",
     "bf16 gradients")
  eq(Placement.new{ stage = 0, ep_size = 2, dtype = "fp16", grad_dtype = "fp16" }.experts, "edp",
     "fp16 gradients at stage 0")
  eq(Placement.new{ stage = 1, ep_size = 2, offload_optimizer = "nvme" }.experts, "edp",
     "nvme states, fp32 (the parameters are the master)")
  eq(Placement.new{ stage = 2, ep_size = 2, offload_optimizer = "nvme", dtype = "bf16" }.experts,
     "edp", "nvme states with a bf16 run's master")
  eq(Placement.new{ stage = 1, ep_size = 2, offload_optimizer = "nvme", device = "sim" }.experts,
     "edp", "nvme states on sim")
  eq(Placement.new{ stage = 3, ep_size = 2, offload_param = "nvme", offload_optimizer = "nvme" }
     .experts, "edp", "the parameter shard on nvme")
  eq(Placement.new{ stage = 1, ep_size = 2, device = "sim" }.experts, "edp", "sim device")
  eq(Placement.new{ stage = 1, ep_size = 2, device = "cuda" }.experts, "edp", "cuda device")
  eq(Placement.new{ stage = 0, ep_size = 2, device = "cuda" }.experts, "edp", "cuda device, stage 0")
end

return T
