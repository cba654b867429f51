-- zero/report.lua — what the engine says about itself: its start-up lines
-- (the run's settings, where offload put the states), its own
-- model-state bytes, and the time and bytes its copies and swap files took. Methods of the engine
-- (zero/engine.lua mixes them in).

local offloaded = require("luazero.zero.plan").offloaded

local M = {}

-- What the estimate says of a live engine (engine:estimate(), the
-- out-of-memory advice) sits above the engine, in estimate/live.lua.

-- The start-up line of the run's settings: "zero stage 2, bf16 (grads
-- bf16), AdamW, 2 ranks, overlap_comm".
function M:describe()
  local W = self.world
  return ("zero stage %d, %s, %s, %d rank%s%s"):format(self.stage,
    self.dtype .. (self.half_grads and (" (grads " .. self.s.grad_dtype .. ")") or ""),
    self.optimizer.name, W, W == 1 and "" or "s", self.s.overlap and ", overlap_comm" or "")
end

-- Where the weights were loaded from (--init), kept for the checkpoint's
-- manifest: an absolute path (a relative one is taken from $PWD), and the
-- xxh64 of its files where a resume must find the same base (LoRA).
function M:set_init_path(path, xxh64)
  self.init_path = path:sub(1, 1) == "/" and path or ((os.getenv("PWD") or ".") .. "/" .. path)
  self.init_xxh64 = xxh64
end

-- Seconds the host has waited so far for host<->device copies queued to
-- overlap with compute (overlap_comm): the part of their time not hidden.
function M:copy_wait_s() return self.reducer.copy_wait end

-- Bytes this rank has read from and written to its NVMe swap files so far
-- (nil when nothing is on NVMe).
function M:nvme_bytes()
  local P = self.P
  if not P:swapped("optimizer") and not P:swapped("params") then return nil end
  local r, w = self.states:io_bytes()
  -- (the frozen parameters' own file at stage 3)
  local ps = self.fstore and self.fstore.pshard
  if ps then
    local s = ps.swap:stats()
    r, w = r + s.bytes_read, w + s.bytes_written
  end
  return r, w
end

-- Where the states live, for the start-up line: nil without offload.
function M:offload_summary()
  local oo, op, st = self.s.offload_opt, self.s.offload_param, self.states
  local opt_off, par_off = offloaded(oo.device), offloaded(op.device)
  if not opt_off and not par_off then return nil end
  local parts = {}
  if opt_off then parts[#parts + 1] = "optimizer states on " .. oo.device end
  if par_off then parts[#parts + 1] = "parameter shard on " .. op.device end
  local line = "offload: " .. table.concat(parts, ", ")
  if st.nb > 0 then
    line = line .. ("; %d sub-groups of %d elements, %d staging buffers (%.1f MiB)")
                   :format(#st.groups, st.G, st.nb, st:staging_bytes() / 2 ^ 20)
    local P = self.P
    local sw = P:swapped("optimizer") and st.swap
               or P:swapped("params") and self.pshard.swap
    if sw and not sw:stats().direct then line = line .. ", buffered I/O" end
  end
  return line
end

-- This engine's own model-state bytes on this rank, from its plan and
-- layout (never the process-wide ledger, which also counts every other live
-- engine and tensor): { params, grads, optimizer, total } over the device
-- and host tiers, frozen parameters under params; nvme = bytes in swap files.
function M:state_bytes()
  local persistent = 0
  for _, seg in ipairs(self.L.segments) do
    if seg.persistent then persistent = persistent + seg.padded end
  end
  local by = self.P:bytes{ full = self.L.full_numel, shard = self.L.shard_numel,
                           persistent = persistent }
  local out = { nvme = by.nvme.total }
  for _, cat in ipairs({ "params", "grads", "optimizer" }) do
    out[cat] = by.device[cat] + by.host[cat]
  end
  out.params = out.params + self:frozen_bytes()
  out.total = out.params + out.grads + out.optimizer
  return out
end

function M:model_state_bytes() return self:state_bytes().total end

return M
