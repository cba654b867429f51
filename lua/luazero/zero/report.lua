-- zero/report.lua — what the engine says about itself: its start-up lines
-- (the run's settings, where offload put the states), the error when
-- device memory runs out, its own model-state bytes, and the time and
-- bytes its copies and swap files took. Methods of the engine
-- (zero/engine.lua mixes them in).
local lz = require("luazero")

local M = {}

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

-- The error when device memory runs out while the engine places its
-- buffers: what this configuration wants on the device per rank (model
-- states as the plan places them, and activations), the device's
-- capacity, and the first placement that fits (estimate.lua's rows).
function M:out_of_memory(batch)
  local estimate = require("luazero.estimate")
  local L, s = self.L, self.s
  local persistent = 0
  for _, seg in ipairs(L.segments) do
    if seg.numel <= s.persistence then persistent = persistent + seg.padded end
  end
  local acts = batch and estimate.activations(self.model, batch[1], batch[2], self.dtype).device
               or 0
  local function wants(stage, offload)
    local r = estimate.model_states(L.numel, self.world, stage, {
      dtype = self.dtype, offload = offload, device = "cuda",
      grads = self.half_grads and "working" or "fp32",
      layout = { full = L.full_numel, shard = L.shard_numel }, persistent = persistent })
    return r and r.device + acts
  end
  local offload = s.offload_opt.device ~= "none" and "cpu" or "none"
  if s.offload_param.device ~= "none" then offload = "cpu+param" end
  local want = wants(self.stage, offload)
  local cap = lz.device_capacity(self.dev)
  local mib = function(b) return ("%.1f MiB"):format(b / 2 ^ 20) end
  local names = { none = "", cpu = " with offload_optimizer", ["cpu+param"] =
                  " with offload_optimizer and offload_param" }
  local fit
  if cap then
    for _, c in ipairs({ { 1, "none" }, { 2, "none" }, { 3, "none" }, { 2, "cpu" }, { 3, "cpu" },
                         { 3, "cpu+param" } }) do
      local w = wants(c[1], c[2])
      if w and w < cap and (c[1] > self.stage or c[2] ~= "none") then
        fit = ("ZeRO stage %d%s (device: \"cpu\") wants %s and fits"):format(c[1], names[c[2]],
                                                                           mib(w))
        break
      end
    end
  end
  return ("initialize: %s: out of device memory: ZeRO stage %d%s with %s wants %s of device " ..
          "memory per rank (model states %s, activations %s)%s; %s"):format(
    self.dev, self.stage, names[offload], self.dtype, mib(want), mib(want - acts), mib(acts),
    cap and (", more than the device's %s"):format(mib(cap)) or "",
    fit or "no ZeRO stage or offload tier fits: use a smaller model or micro-batch, or more ranks")
end

-- Seconds the host has waited so far for host<->device copies queued to
-- overlap with compute (overlap_comm): the part of their time not hidden.
function M:copy_wait_s() return self.copy_wait end

-- Bytes this rank has read from and written to its NVMe swap files so far
-- (nil when nothing is on NVMe).
function M:nvme_bytes()
  local P = self.P
  if P.optimizer.tier ~= "nvme" and P.params.tier ~= "nvme" then return nil end
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
  if oo.device == "none" and op.device == "none" then return nil end
  local parts = {}
  if oo.device ~= "none" then
    parts[#parts + 1] = "optimizer states on " .. oo.device
  end
  if op.device ~= "none" then parts[#parts + 1] = "parameter shard on " .. op.device end
  local line = "offload: " .. table.concat(parts, ", ")
  if st.nb > 0 then
    line = line .. ("; %d sub-groups of %d elements, %d staging buffers (%.1f MiB)")
                   :format(#st.groups, st.G, st.nb, st:staging_bytes() / 2 ^ 20)
    local P = self.P
    local sw = P.optimizer.tier == "nvme" and st.swap
               or P.params.tier == "nvme" and self.pshard.swap
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

-- What tools/estimate figures for this engine, per rank: device, host and
-- NVMe bytes part by part (states, frozen parameters, staging, comm
-- buffers), the NVMe bytes read and written per optimizer step and the
-- step time the disk allows (opts: read_gbps, write_gbps; luazero.estimate's
-- assumed figures else). Beside them, live: what this engine holds now
-- where it can say without the process-wide ledger: staging (its offload
-- staging buffers) and nvme (its swap files' sizes). print() shows it.
function M:estimate(opts)
  local estimate = require("luazero.estimate")
  local o = estimate.settings_from(self.s, self.dev == "cpu" and "cpu" or "cuda",
                                   self.optimizer.states)
  for k, v in pairs(opts or {}) do o[k] = v end
  local r = estimate.rank(estimate.counts(self.model, self.world, self.s.persistence), o)
  local st = self.states
  local staging, nvme = st:staging_bytes(), 0
  if self.pshard then
    for _, t in ipairs(self.pshard.all_stages) do staging = staging + t:bytes() end
    nvme = nvme + self.pshard.swap:stats().size
  end
  local fps = self.fstore and self.fstore.pshard -- frozen parameters on NVMe
  if fps then
    for _, t in ipairs(fps.all_stages) do staging = staging + t:bytes() end
    nvme = nvme + fps.swap:stats().size
  end
  if st.swap then nvme = nvme + st.swap:stats().size end
  if self.spill then nvme = nvme + self.spill.swap:stats().size end
  r.live = { staging = staging, nvme = nvme }
  return setmetatable(r, { __tostring = function(t)
    return table.concat(estimate.rank_lines(t), "\n")
  end })
end

return M
