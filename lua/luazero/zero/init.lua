-- zero — the ZeRO engine's package: initialize (zero/engine.lua) and the
-- placement plan it reads (zero/plan.lua).
--   local zero = require("luazero.zero")
--   local engine = zero.initialize{ model = model, config = cfg, seed = 1337, batch = {B, T} }
-- The engine is made here with the modules above it that it hands itself
-- to: what estimates it (estimate/live.lua), what it says of itself
-- (zero/report.lua) and the checkpoints.
local engine = require("luazero.zero.engine")
local above = { estimate = require("luazero.estimate.live"),
                report = require("luazero.zero.report"),
                checkpoint = require("luazero.checkpoint") }
return {
  initialize = function(opts) return engine.initialize(opts, above) end,
  plan = require("luazero.zero.plan"),
  settings = engine.settings,
  plan_of = engine.plan_of,
}
