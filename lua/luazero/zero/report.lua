-- zero/report.lua — what an engine says about itself: its start-up lines
-- (the run's settings, where offload put the states), its own model-state
-- bytes, and the bytes its swap files moved. Functions of an engine, above
-- it: they read what its plan, layout and components hold and change
-- nothing. luazero.zero.initialize hands this module to the engine
-- (above.report), whose describe, offload_summary, nvme_bytes and
-- state_bytes methods call it; what the estimate says of a live engine
-- (engine:estimate(), the out-of-memory advice) is estimate/live.lua.
--
--   local report = require("luazero.zero.report")
--   print(report.describe(engine)); print(report.state_bytes(engine).total)
local Placement = require("luazero.zero.plan")
local offloaded = Placement.offloaded

local M = {}

-- The start-up line of the run's settings: "zero stage 2, bf16 (grads
-- bf16), AdamW (m, v in bf16), 4 ranks, overlap_comm, ep_size 2
-- (expert-parallel ranks 0 1, expert-data-parallel ranks 0 2)".
-- An MoE model adds how its experts are gathered: whole blocks (each
-- block's experts one segment) or expert by expert (every expert each
-- pass, or only those some rank routed to: the plan's moe field); an optimizer with
-- whole matrices (Muon) adds a line of their placement (zero/matrices.lua).
-- An optimizer's states kept in other formats than f32, and a bf16 master:
-- " (m, v in u8; bf16 master)"; "" for f32 states over an fp32 master.
function M.formats(optimizer)
  local by, order = {}, {}
  for _, name in ipairs(optimizer.states or {}) do
    local f = (optimizer.state_formats or {})[name]
    if f and f ~= "f32" then
      if not by[f] then by[f] = {}; order[#order + 1] = f end
      table.insert(by[f], name)
    end
  end
  local parts = {}
  for _, f in ipairs(order) do parts[#parts + 1] = table.concat(by[f], ", ") .. " in " .. f end
  if optimizer.master_format == "bf16" then parts[#parts + 1] = "bf16 master" end
  return #parts > 0 and " (" .. table.concat(parts, "; ") .. ")" or ""
end

function M.describe(engine)
  local W, s = engine.world, engine.s
  local ep = ""
  if engine.ep_group then
    ep = (", ep_size %d (expert-parallel ranks %s, expert-data-parallel ranks %s)"):format(
      s.ep_size, table.concat(engine.ep_group:ranks(), " "),
      table.concat(engine.edp_group:ranks(), " ")) .. M.placement(engine)
  end
  local moe = engine.P.moe and ", moe gather: " .. Placement.describe_moe(engine.P.moe) or ""
  local line = ("zero stage %d, %s, %s, %d rank%s%s%s%s"):format(engine.stage,
    engine.dtype .. (engine.half_grads and (" (grads " .. s.grad_dtype .. ")") or ""),
    engine.optimizer.name .. M.formats(engine.optimizer), W, W == 1 and "" or "s", s.overlap and ", overlap_comm" or "", moe, ep)
  if engine.matrices then line = line .. "\n" .. engine.matrices:describe(engine.optimizer.name) end
  return line
end

-- Where expert parallelism puts a model's E experts a block over an
-- expert-parallel group of P ranks (nn/moe_experts.lua): ", experts 0-3 |
-- 4-7 on its ranks", and where their parameters live (the plan's experts:
-- over the whole world, as the others, or the expert-data-parallel group).
-- "" for a model without MoE blocks.
function M.placement(engine)
  local routers = engine.model and engine.model.routers or {}
  if #routers == 0 then return "" end
  local E, P = routers[1].n_experts, engine.s.ep_size
  if E % P ~= 0 then return "" end
  local L, parts = E / P, {}
  for q = 0, P - 1 do
    parts[#parts + 1] = L == 1 and tostring(q) or ("%d-%d"):format(q * L, (q + 1) * L - 1)
  end
  local over = engine.P.experts == "edp" and "their expert-data-parallel group" or "all ranks"
  return ", experts " .. table.concat(parts, " | ") ..
         " on its ranks (their parameters under ZeRO over " .. over .. ")"
end

-- Bytes this rank has read from and written to its NVMe swap files so far
-- (nil when nothing is on NVMe).
function M.nvme_bytes(engine)
  local P = engine.P
  if not P:swapped("optimizer") and not P:swapped("params") then return nil end
  local r, w = engine.states:io_bytes()
  -- (the frozen parameters' own file at stage 3)
  local ps = engine.frozen:pshard()
  if ps then
    local s = ps.swap:stats()
    r, w = r + s.bytes_read, w + s.bytes_written
  end
  return r, w
end

-- Where the states live, for the start-up line: nil without offload.
function M.offload_summary(engine)
  local oo, op, st = engine.s.offload_opt, engine.s.offload_param, engine.states
  local opt_off, par_off = offloaded(oo.device), offloaded(op.device)
  if not opt_off and not par_off then return nil end
  local parts = {}
  if opt_off then parts[#parts + 1] = "optimizer states on " .. oo.device end
  if par_off then parts[#parts + 1] = "parameter shard on " .. op.device end
  local line = "offload: " .. table.concat(parts, ", ")
  if st.nb > 0 then
    local function n_of(n, what) return ("%d %s%s"):format(n, what, n == 1 and "" or "s") end
    line = line .. ("; %s of %d elements, %s (%.1f MiB)")
                   :format(n_of(#st.groups, "sub-group"), st.G, n_of(st.nb, "staging buffer"),
                           st:staging_bytes() / 2 ^ 20)
    local P = engine.P
    local sw = P:swapped("optimizer") and st.swap
               or P:swapped("params") and engine.pshard.swap
    if sw and not sw:stats().direct then line = line .. ", buffered I/O" end
  end
  return line
end

-- The engine's own model-state bytes on this rank, from its plan and
-- layout (never the process-wide ledger, which also counts every other live
-- engine and tensor): { params, grads, optimizer, total } over the device
-- and host tiers, frozen parameters under params; nvme = bytes in swap files.
function M.state_bytes(engine)
  local L = engine.L
  local persistent = 0
  for _, seg in ipairs(L.segments) do
    if seg.persistent then persistent = persistent + seg.padded end
  end
  local by = engine.P:bytes{ full = L.full_numel, shard = L.shard_numel, persistent = persistent }
  local out = { nvme = by.nvme.total }
  for _, cat in ipairs({ "params", "grads", "optimizer" }) do
    out[cat] = by.device[cat] + by.host[cat]
  end
  out.params = out.params + engine.frozen:bytes()
  out.total = out.params + out.grads + out.optimizer
  return out
end

return M
