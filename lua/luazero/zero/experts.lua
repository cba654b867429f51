-- zero/experts.lua — expert parameters under ZeRO within their
-- expert-data-parallel group (the plan's experts "edp"; DeepSpeed-MoE's
-- placement): the engine's layout keeps only the experts this rank
-- computes, sliced over its group (zero/layout.lua's place), beside the
-- world layout (Lw) that says where every segment lies for everyone. What
-- the engine asks of the placement: its layout (place), the group a
-- segment's collectives run over (comm_of), and the gradient norm's
-- partials in the world placement's order (norm_slots).
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

return M
