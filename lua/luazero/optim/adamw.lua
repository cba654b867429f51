-- optim/adamw.lua — AdamW (decoupled weight decay, torch.optim.AdamW's
-- update) behind the optimizer interface: the engine hands it calls, pieces
-- of the flat fp32 master with matching views, and each is one fused
-- lz_adamw_step that also writes the working copy.
local lz = require("luazero")
local config = require("luazero.config")
local hyper = require("luazero.optim.hyper")

local ops = lz.ops
-- states: per-element fp32 states the engine allocates, zero-initialised, in
-- this order (call.s).
local AdamW = { name = "AdamW", states = { "m", "v" } }
AdamW.__index = AdamW

-- params: the config's optimizer.params (lr, betas, eps, weight_decay);
-- what is absent takes config.adam_defaults (DeepSpeed FusedAdam's).
function AdamW.new(params)
  local self = hyper.read(params, config.adam_defaults)
  self.args = lz.adamw_args({})
  return setmetatable(self, AdamW)
end

-- call: p, g (f32 views), s = { m, v }, w (working copy view or nil), decay
-- (weight decay applies). step: 1-based; lr: this step's; grad_scale: g is
-- multiplied by it first (loss-scale undo and clipping).
function AdamW:update(call, step, lr, grad_scale)
  local a = self.args
  a.lr, a.beta1, a.beta2, a.eps = lr, self.beta1, self.beta2, self.eps
  a.grad_scale, a.step = grad_scale, step
  a.weight_decay = call.decay and self.weight_decay or 0
  ops.adamw_step(call.p, call.g, call.s[1], call.s[2], call.w, a)
end

return AdamW
