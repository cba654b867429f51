-- config/moe.lua — the "moe" block: expert parallelism, and how ZeRO-3
-- gathers the experts. DeepSpeed has no
-- config key for it: its MoE layer takes the size as an argument
-- (deepspeed.moe.layer.MoE(..., ep_size=...)) and builds the groups in
-- deepspeed/utils/groups.py; luazero reads that name here, and builds the
-- same groups:
--   { "moe": { "ep_size": 2 } }
-- The expert-parallel group: ep_size consecutive ranks, which hold different
-- experts and exchange tokens (world 4, ep_size 2: ranks 0 1 and 2 3). The
-- expert-data-parallel group: the ranks ep_size apart, which hold the same
-- experts and reduce their gradients (0 2 and 1 3).
-- How the experts are gathered (luazero's own keys; DeepSpeed marks leaf
-- modules by hand instead): "gather" is "block" (a block's experts one
-- unit) or "expert" (one unit each; absent: as the model was built,
-- models.config's moe_gather); "routed_only" true makes the ranks agree,
-- by one all-reduce of a bitmask per block and micro-batch, on the experts
-- any rank routed to, and gather and reduce those alone (needs "expert").
--   { "moe": { "gather": "expert", "routed_only": true } }
-- Where the experts' parameters live under expert parallelism (luazero's
-- own key): "placement" "group" (the default: under ZeRO within their
-- expert-data-parallel group, DeepSpeed-MoE's, where the plan allows it) or
-- "world" (under ZeRO over all ranks like every other parameter: every
-- rank keeps slices of every expert; the same bits, more memory).
--   moe.read(raw, cfg, unimpl)        -- fills cfg.moe = { ep_size =, gather =, routed_only =, placement = }
--   moe.groups(ep_size, world, rank)  -- this rank's two lists of 0-based ranks
local values = require("luazero.config.values")

local M = {}

local block, given, whole_at_least = values.block, values.given, values.whole_at_least
local boolean = values.boolean
local asks_for_nothing, sorted_keys, fail = values.asks_for_nothing, values.sorted_keys, values.fail

M.top_keys = { moe = true }
-- The keys of the block luazero reads.
M.keys = { ep_size = true, gather = true, routed_only = true, placement = true }
M.defaults = { ep_size = 1, routed_only = false }
-- The keys that name one of a few values, in the order an error lists them.
M.choices = { gather = { "block", "expert" }, placement = { "group", "world" } }

-- v if it is one of key's choices; else the error that lists them.
local function one_of(key, v)
  for _, c in ipairs(M.choices[key]) do
    if v == c then return v end
  end
  fail("moe.%s must be \"%s\" (got %s)", key, table.concat(M.choices[key], "\" or \""),
       values.show(v))
end

function M.read(raw, cfg, unimpl)
  cfg.moe = { ep_size = M.defaults.ep_size, routed_only = M.defaults.routed_only }
  local m = raw.moe
  if not given(m) then return end
  block("moe", m)
  for _, k in ipairs(sorted_keys(m)) do
    if k == "ep_size" then
      if given(m.ep_size) then
        local n = whole_at_least("moe.ep_size", m.ep_size, 1)
        if cfg.world_size % n ~= 0 then
          fail("moe.ep_size must divide the world size %d (got %d); each expert-parallel group " ..
               "is ep_size consecutive ranks", cfg.world_size, n)
        end
        cfg.moe.ep_size = n
      end
    elseif M.choices[k] then
      if given(m[k]) then cfg.moe[k] = one_of(k, m[k]) end
    elseif k == "routed_only" then
      if given(m.routed_only) then cfg.moe.routed_only = boolean("moe.routed_only", m.routed_only) end
    elseif not asks_for_nothing(m[k]) then
      unimpl[#unimpl + 1] = "moe." .. k .. values.did_you_mean(k, M.keys, "moe.")
    end
  end
end

function M.groups(ep_size, world, rank)
  local ep, edp = {}, {}
  local first = rank - rank % ep_size
  for r = first, first + ep_size - 1 do ep[#ep + 1] = r end
  for r = rank % ep_size, world - 1, ep_size do edp[#edp + 1] = r end
  return ep, edp
end

return M
