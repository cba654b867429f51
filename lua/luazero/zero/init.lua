-- zero — the ZeRO engine's package: initialize (zero/engine.lua) and the
-- placement plan it reads (zero/plan.lua).
--   local zero = require("luazero.zero")
--   local engine = zero.initialize{ model = model, config = cfg, seed = 1337, batch = {B, T} }
local engine = require("luazero.zero.engine")
return {
  initialize = engine.initialize,
  plan = require("luazero.zero.plan"),
  settings = engine.settings,
  plan_of = engine.plan_of,
}
