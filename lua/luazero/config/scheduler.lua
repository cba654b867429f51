-- config/scheduler.lua — ds_config's "scheduler" block: DeepSpeed's five
-- schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle,
-- LRRangeTest), their params with DeepSpeed's defaults
-- (config/defaults.lua's scheduler_params) and the flags that fill them
-- (--warmup, --steps, --lr); the rates themselves are optim/schedule.lua's.
--
--   scheduler.read(raw.scheduler, cfg, unimpl, overrides)  -- sets cfg.scheduler = { type, params }
local values = require("luazero.config.values")
local defaults = require("luazero.config.defaults")

local M = {}

local fail, show, given, block = values.fail, values.show, values.given, values.block
local number_at_least, whole_at_least = values.number_at_least, values.whole_at_least
local boolean, sorted_keys, deep_copy = values.boolean, values.sorted_keys, values.deep_copy

local scheduler_names = "WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle or LRRangeTest"

-- Scheduler parameters that are whole numbers (with their least value) or
-- booleans; every other one is a number >= 0.
local scheduler_whole = { warmup_num_steps = 1, total_num_steps = 1, cycle_first_step_size = 1,
                          cycle_second_step_size = 1, cycle_first_stair_count = 0,
                          cycle_second_stair_count = 0, decay_step_size = 0,
                          lr_range_test_step_size = 1 }
local scheduler_boolean = { cycle_momentum = true, lr_range_test_staircase = true }

-- cfg.scheduler = { type, params } from the block raw (nothing when it is
-- not given); ov: the flags that fill it (warmup, total_steps, lr).
function M.read(raw, cfg, unimpl, ov)
  if not given(raw) then return end
  block("scheduler", raw)
  local t = raw.type
  local spec = type(t) == "string" and defaults.scheduler_params[t]
  if not spec then
    fail("scheduler.type must be %s (got %s)", scheduler_names, show(t))
  end
  for _, k in ipairs(sorted_keys(raw)) do
    if k ~= "type" and k ~= "params" then
      values.refuse_misspelt(k, { type = true, params = true }, "scheduler.")
      unimpl[#unimpl + 1] = "scheduler." .. k
    end
  end
  local p = given(raw.params) and block("scheduler.params", raw.params) or {}
  p = deep_copy(p)
  -- --warmup and --steps fill the schedulers that take a warmup and a total.
  local function takes(k)
    if spec.defaults[k] ~= nil then return true end
    for _, r in ipairs(spec.required or {}) do if r == k then return true end end
  end
  if ov.warmup ~= nil then
    if not takes("warmup_num_steps") then
      fail("--warmup does not apply to scheduler %s (it has no warmup); remove --warmup", t)
    end
    p.warmup_num_steps = ov.warmup
  end
  if ov.total_steps ~= nil and not given(p.total_num_steps) and takes("total_num_steps") then
    if p.total_num_steps == "auto" and cfg.auto_filled then
      cfg.auto_filled[#cfg.auto_filled + 1] = ("scheduler.params.total_num_steps %d")
                                               :format(ov.total_steps)
    end
    p.total_num_steps = ov.total_steps
  end
  -- --lr is the schedule's peak (spec.peak: WarmupLR's and WarmupDecayLR's
  -- warmup_max_lr; none, WarmupCosineLR's, is the optimizer's lr, which --lr
  -- sets); a schedule whose params are its rates (spec.rates: OneCycle,
  -- LRRangeTest) refuses it. A peak of "auto" (Hugging Face's template) is
  -- the optimizer's lr, as its Trainer fills it in.
  local peak_auto = spec.peak and not spec.rates and p[spec.peak] == "auto"
  if ov.lr ~= nil then
    if spec.rates then
      fail("--lr does not apply to scheduler %s (its rates are scheduler.params.%s); set them " ..
           "in the config and remove --lr", t, spec.rates)
    end
    if spec.peak then p[spec.peak], peak_auto = ov.lr, false end
  end
  local out, key = {}, "scheduler.params."
  for k, v in pairs(spec.defaults) do out[k] = v end
  for _, k in ipairs(sorted_keys(p)) do
    local v = p[k]
    local known = spec.defaults[k] ~= nil or (spec.optional and spec.optional[k])
    for _, r in ipairs(spec.required or {}) do known = known or r == k end
    if k == "last_batch_iteration" then
      if given(v) and v ~= -1 then unimpl[#unimpl + 1] = key .. k end
    elseif not known then
      local names = sorted_keys(spec.defaults)
      for _, r in ipairs(spec.required or {}) do names[#names + 1] = r end
      for _, o in ipairs(sorted_keys(spec.optional or {})) do names[#names + 1] = o end
      table.sort(names)
      fail("%s%s is not a parameter of %s (it takes %s)", key, k, t, table.concat(names, ", "))
    elseif given(v) then
      if k == "warmup_type" then
        if v ~= "log" and v ~= "linear" then
          fail('%swarmup_type must be "log" or "linear" (got %s)', key, show(v))
        end
      elseif scheduler_whole[k] then
        whole_at_least(key .. k, v, scheduler_whole[k])
      elseif scheduler_boolean[k] then
        boolean(key .. k, v)
      else
        number_at_least(key .. k, v, 0)
      end
      out[k] = v
    end
  end
  for _, r in ipairs(spec.required or {}) do
    if out[r] == nil then
      fail("%s%s is required by %s (%s)", key, r, t, defaults.scheduler_required[r])
    end
  end
  if peak_auto then -- (lr_at_iteration: the optimizer's lr)
    out[spec.peak] = nil
    local lr = cfg.optimizer and cfg.optimizer.params and cfg.optimizer.params.lr
    if cfg.auto_filled and lr then
      cfg.auto_filled[#cfg.auto_filled + 1] = ("scheduler.params.%s %g"):format(spec.peak, lr)
    end
  end
  cfg.scheduler = { type = t, params = out, peak = spec.peak }
end

return M
