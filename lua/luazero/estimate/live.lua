-- estimate/live.lua — what the estimate says of a live engine: its bytes per
-- tier beside what it holds (engine:estimate()), and the error when device
-- memory runs out while it places its buffers. Above the engine: it reads
-- the engine it is handed, and luazero.zero hands it to the engines it
-- makes (zero/engine.lua does not require it).
local lz = require("luazero")
local estimate = require("luazero.estimate")
local Placement = require("luazero.zero.plan")

local M = {}

-- The error when device memory runs out while the engine places its
-- buffers: what this configuration wants on the device per rank (model
-- states as the plan places them, and activations), the device's
-- capacity, and the first placement that fits (estimate.lua's rows).
function M.out_of_memory(engine, batch)
  local L, s = engine.L, engine.s
  local persistent = 0
  for _, seg in ipairs(L.segments) do
    if seg.numel <= s.persistence then persistent = persistent + seg.padded end
  end
  local acts = batch and estimate.activations(engine.model, batch[1], batch[2], engine.dtype).device
               or 0
  local function wants(stage, offload)
    local r = estimate.model_states(L.numel, engine.world, stage, {
      dtype = engine.dtype, offload = offload, device = "cuda",
      grads = engine.half_grads and "working" or "fp32",
      layout = { full = L.full_numel, shard = L.shard_numel }, persistent = persistent,
      states = engine.optimizer.states, formats = engine.optimizer.state_formats,
      master_format = engine.optimizer.master_format })
    return r and r.device + acts
  end
  local offload = Placement.offloaded(s.offload_opt.device) and "cpu" or "none"
  if Placement.offloaded(s.offload_param.device) then offload = "cpu+param" end
  local want = wants(engine.stage, offload)
  local cap = lz.device_capacity(engine.dev)
  local mib = function(b) return ("%.1f MiB"):format(b / 2 ^ 20) end
  local names = { none = "", cpu = " with offload_optimizer", ["cpu+param"] =
                  " with offload_optimizer and offload_param" }
  local fit
  if cap then
    for _, c in ipairs({ { 1, "none" }, { 2, "none" }, { 3, "none" }, { 2, "cpu" }, { 3, "cpu" },
                         { 3, "cpu+param" } }) do
      local w = wants(c[1], c[2])
      if w and w < cap and (c[1] > engine.stage or c[2] ~= "none") then
        fit = ("ZeRO stage %d%s (device: \"cpu\") wants %s and fits"):format(c[1], names[c[2]],
                                                                           mib(w))
        break
      end
    end
  end
  return ("initialize: %s: out of device memory: ZeRO stage %d%s with %s wants %s of device " ..
          "memory per rank (model states %s, activations %s)%s; %s"):format(
    engine.dev, engine.stage, names[offload], engine.dtype, mib(want), mib(want - acts), mib(acts),
    cap and (", more than the device's %s"):format(mib(cap)) or "",
    fit or "no ZeRO stage or offload tier fits: use a smaller model or micro-batch, or more ranks")
end

-- The error when a swap file cannot be made full size (the disk is too
-- full): what this configuration's swap files take per rank, part by part,
-- beside what nvme_path's disk has free.
function M.out_of_disk(engine, err)
  local o = estimate.settings_from(engine.s, engine.dev == "cuda" and "cuda" or engine.dev,
                                   engine.optimizer.states, engine.optimizer.state_formats)
  local r = estimate.rank(estimate.counts(engine.model, engine.world, engine.s.persistence,
                                          engine.L.block, engine.s.ep_size), o)
  local parts = {}
  for k, v in pairs(r.nvme) do
    if k ~= "total" then parts[#parts + 1] = ("%s %s"):format(k, estimate.format_bytes(v)) end
  end
  table.sort(parts)
  local path = err:match("swap: (.-)/luazero%-swap") or engine.s.offload_opt.nvme_path or
               engine.s.offload_param.nvme_path
  local free = path and require("luazero.io.fs").free_bytes(path)
  return ("%s; this configuration's swap files take %s a rank (%s)%s: free that much there " ..
          "for each rank on this machine, or point nvme_path at a larger disk")
         :format(err:gsub(" %(free space in .*$", ""), estimate.format_bytes(r.nvme.total),
                 table.concat(parts, ", "), free and (", and %s has %s free"):format(path,
                   estimate.format_bytes(free)) or "")
end

-- The error to raise for a failure while the engine places its buffers: out
-- of device memory or of disk, explained (above); else nil (err as it is).
function M.allocation_error(engine, batch, err)
  err = tostring(err)
  if err:find("out of device memory", 1, true) then return M.out_of_memory(engine, batch) end
  if err:find("cannot preallocate", 1, true) then return M.out_of_disk(engine, err) end
end

-- What tools/estimate figures for this engine, per rank: device, host and
-- NVMe bytes part by part (states, frozen parameters, staging, comm
-- buffers), the NVMe bytes read and written per optimizer step and the
-- step time the disk allows (opts: read_gbps, write_gbps; luazero.estimate's
-- assumed figures else). Beside them, live: what this engine holds now
-- where it can say without the process-wide ledger: staging (its offload
-- staging buffers) and nvme (its swap files' sizes). print() shows it.
function M.estimate(engine, opts)
  local o = estimate.settings_from(engine.s, engine.dev == "cuda" and "cuda" or engine.dev,
                                   engine.optimizer.states, engine.optimizer.state_formats)
  for k, v in pairs(opts or {}) do o[k] = v end
  local r = estimate.rank(estimate.counts(engine.model, engine.world, engine.s.persistence,
                                          engine.L.block, engine.s.ep_size), o)
  local st = engine.states
  local staging, nvme = st:staging_bytes(), 0
  if engine.pshard then
    for _, t in ipairs(engine.pshard.all_stages) do staging = staging + t:bytes() end
    nvme = nvme + engine.pshard.swap:stats().size
  end
  local fps = engine.frozen:pshard() -- frozen parameters on NVMe
  if fps then
    for _, t in ipairs(fps.all_stages) do staging = staging + t:bytes() end
    nvme = nvme + fps.swap:stats().size
  end
  if st.swap then nvme = nvme + st.swap:stats().size end
  if engine.spill then nvme = nvme + engine.spill.swap:stats().size end
  r.live = { staging = staging, nvme = nvme }
  return setmetatable(r, { __tostring = function(t)
    return table.concat(estimate.rank_lines(t), "\n")
  end })
end

return M
