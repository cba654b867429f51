-- zero — the ZeRO engine's package: initialize (zero/engine.lua) and the
-- placement plan it reads (zero/plan.lua).
--   local zero = require("luazero.zero")
--   local engine = zero.initialize{ model = model, config = cfg, seed = 1337, batch = {B, T} }
-- The engine is made here with what estimates it (estimate/live.lua), which
-- sits above it.
local engine = require("luazero.zero.engine")
local live = require("luazero.estimate.live")
return {
  initialize = function(opts) return engine.initialize(opts, live) end,
  plan = require("luazero.zero.plan"),
  settings = engine.settings,
  plan_of = engine.plan_of,
}
