-- monitor/breakdown.lua — wall_clock_breakdown: the milliseconds of one
-- optimizer step spent in each of the engine's phases: forward, backward,
-- reduce (gradient reductions, waiting for them, the loss and norm
-- exchange), step (the optimizer) and gather (parameter gathers). The
-- engine's methods are timed on the engine itself, by wrapping them
-- (engine.forward = timed(engine.forward)...): a phase nested in another
-- (a gather in a forward, a reduction in a backward) is counted in the inner
-- one only, so the phases add up to at most the step's time. Host time: on a
-- device, a phase ends when the host has queued its work.
--
--   local b = breakdown.attach(engine)
--   engine:train_batch(loader)
--   local ms = b:last()    -- { forward = , backward = , reduce = , step = , gather = }
local clock = require("luazero.clock")

local M = {}

M.phases = { "forward", "backward", "reduce", "step", "gather" }

-- The engine's methods (zero/engine.lua) and the phase each one's time goes
-- to; and its components' (the gatherer's, zero/gather.lua, whose module
-- hooks run inside forward and backward; the reducer's, zero/reduce.lua).
M.methods = {
  forward = "forward", backward = "backward", step = "step",
  wait_all = "reduce", pull_grads = "reduce", exchange = "reduce", gather_params = "gather",
}
-- (the module hooks as luazero.profile counts them: gathers before and after
-- a module runs, the reduction after its backward)
M.components = {
  gatherer = { pre_forward = "gather", post_forward = "gather", pre_backward = "gather",
               pre_recompute = "gather", post_recompute = "gather", post_backward = "reduce",
               gather_params = "gather" },
  reducer = { grads_ready = "reduce", flush_bucket = "reduce", wait_all = "reduce",
              pull_grads = "reduce" },
}

local Breakdown = {}
Breakdown.__index = Breakdown

function Breakdown:reset()
  for _, p in ipairs(M.phases) do self.s[p] = 0 end
end

function Breakdown:start(phase)
  local now, top = clock.now(), self.stack[#self.stack]
  if top then self.s[top.phase] = self.s[top.phase] + (now - top.t0) end
  self.stack[#self.stack + 1] = { phase = phase, t0 = now }
end

function Breakdown:stop()
  local now = clock.now()
  local top = table.remove(self.stack)
  self.s[top.phase] = self.s[top.phase] + (now - top.t0)
  local parent = self.stack[#self.stack]
  if parent then parent.t0 = now end
end

-- The phases of the last engine:train_batch, in milliseconds.
function Breakdown:last() return self.done end

local function timed(b, fn, phase)
  return function(...)
    b:start(phase)
    local out = { pcall(fn, ...) }
    b:stop()
    if not out[1] then error(out[2], 0) end
    return unpack(out, 2, table.maxn(out))
  end
end

-- Times `engine`'s phases from now on; what one train_batch spent is
-- b:last() after it (an evaluation's forwards afterwards do not count).
function M.attach(engine)
  local b = setmetatable({ s = {}, stack = {}, done = nil }, Breakdown)
  b:reset()
  for name, phase in pairs(M.methods) do
    -- a method this engine lacks (a stage or layout without it) times nothing
    local fn = engine[name]
    if type(fn) == "function" then engine[name] = timed(b, fn, phase) end
  end
  for field, methods in pairs(M.components) do
    local obj = engine[field]
    for name, phase in pairs(obj and methods or {}) do
      local fn = obj[name]
      if type(fn) == "function" then obj[name] = timed(b, fn, phase) end
    end
  end
  local train_batch = engine.train_batch
  engine.train_batch = function(...)
    b:reset()
    b.stack = {}
    local out = { pcall(train_batch, ...) }
    local ms = {}
    for _, p in ipairs(M.phases) do ms[p] = b.s[p] * 1000 end
    b.done = ms
    if not out[1] then error(out[2], 0) end
    return unpack(out, 2, table.maxn(out))
  end
  engine.breakdown = b
  return b
end

-- " | forward 12 backward 30 reduce 1 step 4 gather 2 ms" for the step line.
function M.line(ms)
  local parts = {}
  for _, p in ipairs(M.phases) do parts[#parts + 1] = ("%s %.0f"):format(p, ms[p]) end
  return " | " .. table.concat(parts, " ") .. " ms"
end

return M
