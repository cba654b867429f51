-- zero/scaler.lua — fp16 loss scaling with DeepSpeed's semantics
-- (runtime/fp16/loss_scaler.py, DynamicLossScaler.update_scale): on
-- overflow skip the step and, once `hysteresis` overflows have been
-- absorbed, halve the scale (not below min_loss_scale); when the steps since
-- the last overflow (the overflow's own step counted; from the start, steps
-- since step 0) are a multiple of loss_scale_window, that is after
-- loss_scale_window clean steps, double it (and refill the hysteresis; with
-- consecutive_hysteresis every step without overflow refills it); an
-- overflow that would halve a scale already at min_loss_scale stops the
-- run, as ZeRO's scaler does (raise_error_at_min_scale): it would only skip
-- every step from then on. A non-zero loss_scale is static. Without fp16
-- the scale is 1 and never moves.
local Scaler = {}
Scaler.__index = Scaler

-- fp16: the config's fp16 section (nil: no scaling).
function Scaler.new(fp16)
  if not fp16 then
    return setmetatable({ scale = 1, dynamic = false }, Scaler)
  end
  local static = fp16.loss_scale or 0
  local hysteresis = fp16.hysteresis or 2
  return setmetatable({
    dynamic = static == 0,
    scale = static ~= 0 and static or 2 ^ (fp16.initial_scale_power or 16),
    window = fp16.loss_scale_window or 1000,
    min_scale = fp16.min_loss_scale or 1,
    delayed_shift = hysteresis, hysteresis = hysteresis,
    consecutive = fp16.consecutive_hysteresis or false,
    iter = 0, last_overflow = -1,
  }, Scaler)
end

function Scaler:update(overflow)
  if not self.dynamic then return end
  if overflow then
    if self.delayed_shift == 1 or self.hysteresis == 1 then
      if self.scale == self.min_scale then
        error(("fp16: the gradients overflowed at the minimum loss scale (%g, " ..
               "fp16.min_loss_scale), so every step from here on would be skipped; the run " ..
               "stops. Lower fp16.min_loss_scale, lower the learning rate, or train in bf16 " ..
               "(--dtype bf16)"):format(self.scale), 0)
      end
      self.scale = math.max(self.scale / 2, self.min_scale)
    else
      self.hysteresis = self.hysteresis - 1
    end
    self.last_overflow = self.iter
  else
    if self.consecutive then self.hysteresis = self.delayed_shift end
    if (self.iter - self.last_overflow) % self.window == 0 then
      if not self.consecutive then self.hysteresis = self.delayed_shift end
      self.scale = self.scale * 2
    end
  end
  self.iter = self.iter + 1
end

-- Its state for a checkpoint: every number and flag.
function Scaler:state()
  local t = {}
  for k, v in pairs(self) do
    if type(v) == "number" or type(v) == "boolean" then t[k] = v end
  end
  return t
end

-- What a resume takes back: where the dynamic scaler stood. The rest
-- (dynamic or static, the window, the minimum, the hysteresis it refills
-- to) is this run's config.
local STATE = { scale = true, hysteresis = true, iter = true, last_overflow = true }

-- Takes a saved state back: a dynamic scaler from a dynamic one's state
-- (a static scale is the config's; a static run's state starts a dynamic
-- one at its initial scale).
function Scaler:restore(t)
  if not self.dynamic or not (t and t.dynamic) then return end
  for k, v in pairs(t) do
    if STATE[k] and type(self[k]) == type(v) then self[k] = v end
  end
end

return Scaler
