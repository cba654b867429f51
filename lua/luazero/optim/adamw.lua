-- optim/adamw.lua — AdamW (decoupled weight decay) through the fused kernel.
local lz = require("luazero")

local ops = lz.ops
local AdamW = { name = "AdamW", states = { "m", "v" } }
AdamW.__index = AdamW

function AdamW.new(params)
  params = params or {}
  local betas = params.betas or { 0.9, 0.999 }
  return setmetatable({ lr = params.lr or 1e-3, beta1 = betas[1], beta2 = betas[2],
                        eps = params.eps or 1e-8, weight_decay = params.weight_decay or 0,
                        args = lz.adamw_args({}) }, AdamW)
end

function AdamW:update(call, step, lr, grad_scale)
  local a = self.args
  a.lr, a.beta1, a.beta2, a.eps = lr, self.beta1, self.beta2, self.eps
  a.grad_scale, a.step = grad_scale, step
  a.weight_decay = call.decay and self.weight_decay or 0
  ops.adamw_step(call.p, call.g, call.s[1], call.s[2], call.w, a)
end

return AdamW
