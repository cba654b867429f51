-- estimate/moe.lua — what a mixture-of-experts model's experts cost, for
-- tools/estimate: all parameters against those a token runs through (each
-- MoE block's top_k experts), the experts' bytes, and the expert bytes one
-- rank's stage-3 gathers read per optimizer step: every expert at each
-- gather (the default), or, with moe.routed_only, the experts some rank
-- routed to, expected for uniform routing.
--
--   local moe = require("luazero.estimate.moe")
--   local m = moe.of(model, { world = 8, dtype = "bf16", gather = "expert",
--                             tokens = B * T, accum = 1, threshold = 1e5 })
--   for _, line in ipairs(moe.lines(m)) do print(line) end
local Placement = require("luazero.zero.plan")
local layout = require("luazero.zero.layout")

local M = {}

-- A block's experts at one rank: elements of its slices of every expert
-- gathered per pass (each expert a segment, or the block's experts one;
-- under expert parallelism over P ranks one per owner, E / P experts
-- each), nothing where the segment is kept whole (persistence threshold).
-- The experts in their expert-data-parallel group read the same: E / P
-- experts, each sliced over world / P ranks, padded alike.
local function block_slices(b, per, world, gather, threshold, P)
  local units = gather == "expert" and b.n_experts or P
  local unit = per * b.n_experts / units
  if unit <= threshold then return 0 end
  return layout.round_up(unit, world * layout.ALIGN) / world * units
end

-- The expected share of E experts that N tokens, each picking k distinct
-- experts uniformly, leave with at least one token: 1 - (1 - k/E)^N.
function M.routed_share(E, k, N) return 1 - (1 - k / E) ^ N end

-- opts: world (ranks; 1), dtype (the working dtype: fp32, bf16, fp16;
-- bf16), gather (block or expert; the model's), tokens (per micro-batch
-- on one rank; nil: no routed-only figure), accum (micro-steps a step; 1),
-- threshold (stage3_param_persistence_threshold; 1e5), ep_size
-- (moe.ep_size; 1). nil for a model without MoE blocks.
function M.of(model, opts)
  local routers = model.routers or {}
  if #routers == 0 then return nil end
  opts = opts or {}
  local world, accum = opts.world or 1, opts.accum or 1
  local esz = Placement.esize[Placement.dtypes[opts.dtype or "bf16"]]
  local gather = opts.gather or routers[1].gather
  local threshold = opts.threshold or 1e5
  local m = { blocks = #routers, experts = routers[1].n_experts, top_k = routers[1].top_k,
              gather = gather, world = world, accum = accum, dtype = opts.dtype or "bf16",
              total = model:count_params(), active = model:count_active_params(),
              expert_params = 0, active_expert_params = 0, tokens = opts.tokens,
              ep_size = opts.ep_size or 1 }
  local slices, routed = 0, 0
  for _, b in ipairs(routers) do
    local per = 3 * b.n_embd * b.experts.n_hidden
    m.expert_params = m.expert_params + per * b.n_experts
    m.active_expert_params = m.active_expert_params + per * b.top_k
    local s = block_slices(b, per, world, gather, threshold, opts.ep_size or 1)
    slices = slices + s
    if opts.tokens and gather == "expert" then
      routed = routed + s * M.routed_share(b.n_experts, b.top_k, opts.tokens * world)
    end
  end
  m.expert_bytes = m.expert_params * esz
  -- Each micro-step gathers a block's experts twice: for its forward, and
  -- for its backward (or for the replay of activation checkpointing, whose
  -- backward finds them gathered).
  m.read_per_step = 2 * accum * slices * esz
  if opts.tokens and gather == "expert" then m.routed_read_per_step = 2 * accum * routed * esz end
  return m
end

local function thousands(n)
  local s = ("%d"):format(n)
  local out = s:reverse():gsub("(%d%d%d)", "%1,"):reverse()
  return (out:gsub("^,", ""))
end

local function gb(b)
  if b >= 1e9 then return ("%.2f GB"):format(b / 1e9) end
  if b >= 1e6 then return ("%.2f MB"):format(b / 1e6) end
  return ("%.1f kB"):format(b / 1e3)
end

-- What tools/estimate prints of it.
function M.lines(m)
  local lines = {
    ("moe: %d blocks of %d experts, top %d a token: %s parameters, %s active a token (%.1f%%); " ..
     "the experts %s (%s in %s), %s of them active")
      :format(m.blocks, m.experts, m.top_k, thousands(m.total), thousands(m.active),
              100 * m.active / m.total, thousands(m.expert_params), gb(m.expert_bytes), m.dtype,
              thousands(m.active_expert_params)),
    ("moe: at stage 3, gathered %s, each rank's gathers read %s of expert slices per step " ..
     "(forward and backward of %d micro-batch%s, every expert; from NVMe under offload_param nvme)")
      :format(m.gather == "expert" and "per expert" or "per block", gb(m.read_per_step), m.accum,
              m.accum == 1 and "" or "es"),
  }
  if m.ep_size > 1 then
    lines[#lines + 1] = ("moe: ep_size %d: each rank computes %d of each block's %d experts, " ..
                         "over the rows of its %d-rank expert-parallel group (arenas for all " ..
                         "of them); at stages 0-3 with the states, the master and the " ..
                         "parameter shard in memory or on NVMe and gradients in any dtype, " ..
                         "their parameters under ZeRO over the %d ranks " ..
                         "of its expert-data-parallel group (a rank's stage-3 gathers read " ..
                         "the slice bytes they read under ZeRO over all ranks)")
      :format(m.ep_size, m.experts / m.ep_size, m.experts, m.ep_size, m.ep_size,
              m.world / m.ep_size)
  end
  if m.routed_read_per_step then
    lines[#lines + 1] = ("moe: with moe.routed_only, at %d tokens a micro-batch on each of %d " ..
                         "rank%s, about %s (%.1f of %d experts a block routed, for uniform " ..
                         "routing)"):format(m.tokens, m.world, m.world == 1 and "" or "s",
      gb(m.routed_read_per_step), m.experts * M.routed_share(m.experts, m.top_k,
                                                              m.tokens * m.world), m.experts)
  end
  return lines
end

return M
