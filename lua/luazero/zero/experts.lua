-- zero/experts.lua — expert parameters under ZeRO within their
-- expert-data-parallel group (the plan's experts "edp"; DeepSpeed-MoE's
-- placement): the engine's layout keeps only the experts this rank
-- computes, sliced over its group (zero/layout.lua's place), beside the
-- world layout (Lw) that says where every segment lies for everyone. What
-- the engine asks of the placement: whether it can hold (place), the group
-- a segment's collectives run over (comm_of), and the gradient norm's
-- partials in the world placement's order (norm_slots).
--
--   experts.place(engine)   -- engine.L, engine.Lw, engine.place_of; or the
--                           -- plan's experts set back to "world"
local layout = require("luazero.zero.layout")

local M = {}

-- The layout keeps only this rank's experts. It needs every segment of
-- the world layout to hold one owner's experts or none (experts gathered
-- per expert), so that each gradient-norm partial and each reduced element
-- is the world placement's, bit for bit; and an optimizer that updates
-- elements one by one (not whole matrices). Else the experts stay under
-- ZeRO over the world (P.experts = "world").
function M.place(engine)
  local P, s = engine.P, engine.s
  if P.experts ~= "edp" then return end
  local owner = layout.expert_owner(s.ep_size)
  local ok = engine.optimizer.matrix == nil
  for _, seg in ipairs(engine.L.segments) do
    local o = owner(seg.entries[1].entry)
    for _, se in ipairs(seg.entries) do ok = ok and owner(se.entry) == o end
  end
  if not ok then P.experts = "world"; return end
  engine.place_of = function(r) return { rank = r, ep_size = s.ep_size, owner = owner } end
  engine.owner = owner
  engine.Lw = engine.L
  engine.L = layout.new(engine.ptable, engine.world, nil, engine.place_of(engine.rank))
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
-- order. A world slice of an expert segment is taken from the whole
-- reduced gradients (stage 1 keeps them whole) by the owner whose group
-- index covers it. Returns K, { {slot, g (the slice's gradients)} }.
function M.norm_slots(engine)
  local W, Pn = engine.world, engine.s.ep_size
  local slots = {}
  for _, seg in ipairs(engine.L.segments) do
    local wslice = seg.padded / W
    for r = 0, W - 1 do
      local mine = seg.group == "edp" and math.floor(r / Pn) == seg.grank or
                   seg.group ~= "edp" and r == engine.rank
      if mine then
        slots[#slots + 1] = { slot = (seg.world_index - 1) * W + r + 1,
                              g = engine.ograds:view(seg.full_offset + r * wslice, { wslice }) }
      end
    end
  end
  return #engine.Lw.segments * W, slots
end

return M
