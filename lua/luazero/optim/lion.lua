-- optim/lion.lua — Lion (Chen et al. 2023) behind the optimizer interface
-- (see optim/adamw.lua): each call is one fused lz_lion_step, on the cpu.
-- One fp32 state per parameter, the momentum; the step is lr times the sign
-- of an interpolation of momentum and gradient, so Lion wants a learning
-- rate 3-10x smaller than AdamW's.
local lz = require("luazero")
local config = require("luazero.config")
local hyper = require("luazero.optim.hyper")

local ops = lz.ops
local Lion = { name = "Lion", states = { "m" } }
Lion.__index = Lion

-- params: the config's optimizer.params (lr, betas, weight_decay); what is
-- absent takes config.lion_defaults (DeepSpeed FusedLion's).
function Lion.new(params)
  local self = hyper.read(params, config.lion_defaults)
  self.args = lz.lion_args({})
  return setmetatable(self, Lion)
end

-- call: p, g (f32 views), s = { m }, w (working copy view or nil), decay.
-- Lion keeps no step count; `step` is part of the interface.
function Lion:update(call, step, lr, grad_scale)
  local a = self.args
  a.lr, a.beta1, a.beta2, a.grad_scale = lr, self.beta1, self.beta2, grad_scale
  a.weight_decay = call.decay and self.weight_decay or 0
  ops.lion_step(call.p, call.g, call.s[1], call.w, a)
end

return Lion
