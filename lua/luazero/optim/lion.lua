-- optim/lion.lua — Lion (Chen et al. 2023): its declaration in the
-- optimizer table (optim/registry.lua). Each step call is one fused
-- lz_lion_step. One fp32 state per parameter, the momentum; the step is lr
-- times the sign of an interpolation of momentum and gradient, so Lion
-- wants a learning rate 3-10x smaller than AdamW's.
local lz = require("luazero")

local ops = lz.ops

return {
  name = "Lion",
  types = { "Lion" },
  -- FusedLion's defaults (what DeepSpeed builds for "Lion").
  params = {
    { "lr", "number", min = 0, default = 1e-3 },
    { "betas", "betas", default = { 0.9, 0.999 } },
    { "weight_decay", "number", min = 0, default = 0 },
  },
  defaults_name = "lion_defaults",
  states = { { name = "m", format = "f32" } },

  -- Its weight decay is decoupled, as FusedLion's.
  read_config = function() return { decoupled_weight_decay = true } end,

  init = function(self) self.args = lz.lion_args({}) end,

  -- call: p, g (f32 views), s = { m }, w (working copy view or nil), decay.
  -- Lion keeps no step count; `step` is part of the interface.
  step = function(self, call, _, lr, grad_scale)
    local a = self.args
    a.lr, a.beta1, a.beta2, a.grad_scale = lr, self.beta1, self.beta2, grad_scale
    a.weight_decay = call.decay and self.weight_decay or 0
    ops.lion_step(call.p, call.g, call.s[1], call.w, a)
  end,
}
