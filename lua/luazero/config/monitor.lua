-- config/monitor.lua — the keys that say what a run reports about itself:
-- the monitors ("tensorboard", "csv_monitor", "wandb"), "wall_clock_breakdown"
-- and "flops_profiler", with DeepSpeed's defaults and meaning.
--   monitor.read(raw, cfg, unimpl)  -- fills cfg.monitor, cfg.wall_clock_breakdown,
--                                   -- cfg.flops_profiler; reports unknown keys
local values = require("luazero.config.values")

local M = {}

local fail, show, given = values.fail, values.show, values.given
local boolean, block, whole_at_least = values.boolean, values.block, values.whole_at_least
local asks_for_nothing, sorted_keys, deep_copy = values.asks_for_nothing, values.sorted_keys,
                                                 values.deep_copy

-- DeepSpeed's monitor/config.py: files go to output_path/job_name
-- (output_path "": job_name under the folder the run starts in).
M.monitor_defaults = { enabled = false, output_path = "", job_name = "DeepSpeedJobName" }
-- DeepSpeed's profiling/config.py.
M.flops_profiler_defaults = { enabled = false, recompute_fwd_factor = 0.0, profile_step = 1,
                              module_depth = -1, top_modules = 1, detailed = true,
                              output_file = nil }

-- The keys every top-level monitor block here reads.
M.top_keys = { tensorboard = true, csv_monitor = true, wandb = true, wall_clock_breakdown = true,
               flops_profiler = true }

local function string_value(key, v)
  if type(v) ~= "string" then fail("%s must be a string (got %s)", key, show(v)) end
  return v
end

local function file_monitor(name, raw, unimpl)
  local out = deep_copy(M.monitor_defaults)
  if not given(raw) then return out end
  block(name, raw)
  for _, k in ipairs(sorted_keys(raw)) do
    local v, key = raw[k], name .. "." .. k
    if k == "enabled" then
      if given(v) then out.enabled = boolean(key, v) end
    elseif k == "output_path" or k == "job_name" then
      if given(v) then out[k] = string_value(key, v) end
    else
      values.refuse_misspelt(k, { enabled = true, output_path = true, job_name = true },
                             name .. ".", { team = true, group = true, project = true })
      if not asks_for_nothing(v) then unimpl[#unimpl + 1] = key end
    end
  end
  if out.job_name == "" then
    fail("%s.job_name is empty; it names the folder inside output_path the files go to", name)
  end
  return out
end

local function flops_profiler(raw, unimpl)
  local out = deep_copy(M.flops_profiler_defaults)
  if not given(raw) then return out end
  local name = "flops_profiler."
  block("flops_profiler", raw)
  for _, k in ipairs(sorted_keys(raw)) do
    local v, key = raw[k], name .. k
    if not given(v) then
      -- the default stays
    elseif k == "enabled" or k == "detailed" then
      out[k] = boolean(key, v)
    elseif k == "profile_step" or k == "top_modules" then
      out[k] = whole_at_least(key, v, 1)
    elseif k == "module_depth" then
      out[k] = whole_at_least(key, v, -1)
    elseif k == "output_file" then
      out[k] = string_value(key, v)
    elseif k == "recompute_fwd_factor" then
      -- the FLOPs of forwards replayed by activation checkpointing: not counted here
      if v ~= 0 then unimpl[#unimpl + 1] = key end
    else
      values.refuse_misspelt(k, { enabled = true, detailed = true, profile_step = true,
                                  top_modules = true, module_depth = true, output_file = true,
                                  recompute_fwd_factor = true }, name)
      unimpl[#unimpl + 1] = key
    end
  end
  return out
end

function M.read(raw, cfg, unimpl)
  local w = raw.wandb
  if given(w) then
    block("wandb", w)
    if given(w.enabled) and boolean("wandb.enabled", w.enabled) then
      fail("wandb.enabled: luazero does not send metrics to Weights & Biases; record them " ..
           "offline with tensorboard, csv_monitor or --log FILE (JSON Lines)")
    end
  end
  cfg.monitor = { tensorboard = file_monitor("tensorboard", raw.tensorboard, unimpl),
                  csv_monitor = file_monitor("csv_monitor", raw.csv_monitor, unimpl) }
  cfg.wall_clock_breakdown = false
  if given(raw.wall_clock_breakdown) then
    cfg.wall_clock_breakdown = boolean("wall_clock_breakdown", raw.wall_clock_breakdown)
  end
  cfg.flops_profiler = flops_profiler(raw.flops_profiler, unimpl)
end

return M
