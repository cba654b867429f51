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
-- opts.config may be a ds_config.json path: read as luazero.config.load
-- reads it, for the ranks of opts.comm (default luazero.comm).
local function initialize(opts)
  if type(opts.config) == "string" then
    local o = {}
    for k, v in pairs(opts) do o[k] = v end
    o.config = require("luazero.config").load(opts.config,
                                              (opts.comm or require("luazero.comm")).size())
    opts = o
  end
  -- every rank given the same seed, settings and model, before any other
  -- collective (zero/agree.lua)
  require("luazero.zero.api").initialize(opts)
  if opts.model then
    require("luazero.zero.agree").check(opts.comm or require("luazero.comm"),
                                        engine.settings(opts.config), opts, opts.model)
  end
  return engine.initialize(opts, above)
end

return {
  initialize = initialize,
  plan = require("luazero.zero.plan"),
  settings = engine.settings,
  plan_of = engine.plan_of,
}
