-- zero/experts.lua — expert parameters under ZeRO within their
-- expert-data-parallel group (the plan's experts "edp"; DeepSpeed-MoE's
-- placement): the engine's layout keeps only the experts this rank
-- computes, sliced over its group (zero/layout.lua's place), beside the
-- world layout (Lw) that says where every segment lies for everyone. What
-- the engine asks of the placement: its layout (place), the group a
-- segment's collectives run over (comm_of), the gradient norm's partials
-- in the world placement's order (norm_slots), and, where the optimizer
-- is replicated (stage 0), the slices a checkpoint's writers save
-- (save_view).
--
--   engine.L = experts.world_layout(engine)
--   experts.place(engine)   -- engine.L, engine.Lw, engine.place_of
local layout = require("luazero.zero.layout")
local Placement = require("luazero.zero.plan")

local M = {}

-- The world layout under expert parallelism: a module's parameters cut
-- where the experts' owner changes (a block's experts gathered whole are
-- one segment per owner), every segment kept and sliced over the world,
-- so that each segment's gradient-norm partials are the same under either
-- placement. Without expert parallelism, the plain one.
function M.world_layout(engine, block)
  local P = engine.s.ep_size
  if P <= 1 then return layout.new(engine.ptable, engine.world, nil, block) end
  return layout.new(engine.ptable, engine.world, nil, block, { rank = engine.rank, ep_size = P,
                    owner = layout.expert_owner(P), everywhere = true })
end

-- The layout keeps only this rank's experts: each reduced element and
-- each gradient-norm partial is then the world placement's, bit for bit.
-- An optimizer of whole matrices (Muon) orthogonalises an expert's on a
-- rank of its group (zero/matrices.lua), from the same bits. Block-scaled
-- states (8-bit AdamW's) keep their blocks: a segment pads to world x
-- block elements under either placement, so an expert's group slice k is
-- world slices kP..kP+P-1 and its blocks are the world layout's, each in
-- one parameter, counted from its start.
function M.place(engine)
  local P, s = engine.P, engine.s
  if P.experts ~= "edp" then return end
  local owner = layout.expert_owner(s.ep_size)
  engine.place_of = function(r) return { rank = r, ep_size = s.ep_size, owner = owner } end
  engine.owner = owner
  engine.Lw = engine.L
  engine.L = layout.new(engine.ptable, engine.world, nil, engine.block,
                        engine.place_of(engine.rank))
  -- which world segment each of this rank's is (the same first parameter)
  local at = {}
  for i, seg in ipairs(engine.Lw.segments) do at[seg.entries[1].entry] = i end
  for _, seg in ipairs(engine.L.segments) do seg.world_index = at[seg.entries[1].entry] end
end

-- The group a segment's collectives run over: its expert-data-parallel
-- group, or nil (the world).
function M.comm_of(engine, seg)
  return seg.group == "edp" and engine.edp_group or nil
end

-- The gradient norm's partials: one slot per world segment and slice (K
-- of them, after the loss's), each filled by one rank (the others' zeros
-- add nothing), so the sum runs over the world placement's partials in its
-- order. An expert segment's group slice k is world slices k*P .. k*P+P-1
-- (padding is world-granular), so the owner of group index k takes those
-- from its reduced gradients, whole (stage 1) or its shard (stage 2), or,
-- where the gradients spill to NVMe (zero/spill.lua), from each slice's
-- final values as the reducer writes them (by_seg).
-- Returns K, { {slot, seg, at (the world slice's offset in this rank's
-- slice of seg), n, g (its gradients; nil when they spill)} }, by_seg
-- (segment index -> its slots).
function M.norm_slots(engine)
  local W, Pn, P = engine.world, engine.s.ep_size, engine.P
  local slots, by_seg = {}, {}
  for _, seg in ipairs(engine.L.segments) do
    local wslice = seg.padded / W
    local k = layout.slice_of(engine.L, seg, engine.rank)
    -- (where this rank's slice k starts in the gradients the optimizer reads)
    local base = engine.ograds and Placement.offset(P.opt_grads.extent, seg.mine) - k * seg.slice
    by_seg[seg.index] = {}
    for r = 0, W - 1 do
      local mine = seg.group == "edp" and math.floor(r / Pn) == k or
                   seg.group ~= "edp" and r == engine.rank
      if mine then
        local s = { slot = (seg.world_index - 1) * W + r + 1, seg = seg,
                    at = r * wslice - k * seg.slice, n = wslice,
                    g = base and engine.ograds:view(base + r * wslice, { wslice }) }
        slots[#slots + 1] = s
        table.insert(by_seg[seg.index], s)
      end
    end
  end
  return #engine.Lw.segments * W, slots, by_seg
end

-- A checkpoint's view of a replicated optimizer (stage 0) with the
-- experts in their group: every rank holds the non-experts and its own
-- experts whole, so no one rank holds every expert. Each rank writes its
-- slices instead, as stage 1 would hold them (world slice r of a
-- non-expert segment, group slice k of its experts'), so every element is
-- saved once. shard: the engine's (state_parts) replicated view, whose
-- visit goes over the whole layout; returns the fields a save reads:
-- numel, replicated (false), runs_of(r), visit(false, fn) over this
-- rank's slices in order. A load keeps the whole view (every rank reads
-- all it holds).
function M.save_view(engine, shard)
  local L, rank = engine.L, engine.rank
  -- this rank's slices: { full (offset in the whole layout), at (in the
  -- saved shard), n }, in order
  local pieces = {}
  for _, seg in ipairs(L.segments) do
    local k = layout.slice_of(L, seg, rank)
    pieces[#pieces + 1] = { full = seg.full_offset + k * seg.slice, at = seg.shard_offset,
                            n = seg.slice }
  end
  local view = {}
  for k, v in pairs(shard) do view[k] = v end
  view.numel, view.replicated = L.shard_numel, false
  view.runs_of = function(r)
    local Lr = r == rank and L or layout.new(engine.ptable, engine.world, nil, engine.block,
                                             engine.place_of(r))
    return layout.canonical_runs(Lr, r)
  end
  view.visit = function(writing, fn)
    if writing then return shard.visit(true, fn) end
    local i = 1
    shard.visit(false, function(lo, ...)
      local chunk = { ... }
      local hi = lo + chunk[1]:numel()
      while i <= #pieces and pieces[i].full + pieces[i].n <= lo do i = i + 1 end
      local j = i
      while j <= #pieces and pieces[j].full < hi do
        local p = pieces[j]
        local a, b = math.max(lo, p.full), math.min(hi, p.full + p.n)
        if b > a then
          local part = {}
          for s, t in ipairs(chunk) do part[s] = t:view(a - lo, { b - a }) end
          fn(p.at + (a - p.full), unpack(part))
          for _, t in ipairs(part) do t:free() end
        end
        j = j + 1
      end
    end)
  end
  return view
end

return M
