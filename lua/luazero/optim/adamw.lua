-- optim/adamw.lua — AdamW (decoupled weight decay, torch.optim.AdamW's
-- update): its declaration in the optimizer table (optim/registry.lua).
-- The engine hands step calls, pieces of the flat fp32 master with
-- matching views, and each is one fused lz_adamw_step that also writes the
-- working copy.
local lz = require("luazero")
local values = require("luazero.config.values")

local ops = lz.ops

return {
  name = "AdamW",
  -- DeepSpeed's "Adam" is AdamW unless adam_w_mode is false.
  types = { "Adam", "AdamW" },
  -- FusedAdam's defaults (what DeepSpeed builds for "Adam" and "AdamW").
  params = {
    { "lr", "number", min = 0, default = 1e-3 },
    { "betas", "betas", default = { 0.9, 0.999 } },
    { "eps", "number", min = 0, default = 1e-8 },
    { "weight_decay", "number", min = 0, default = 0 },
  },
  defaults_name = "adam_defaults",
  states = { { name = "m", dtype = "f32" }, { name = "v", dtype = "f32" } },
  -- torch_adam picks among DeepSpeed's implementations of the same update.
  accepted = { adam_w_mode = true, torch_adam = true },
  -- bias_correction: false is reported (the kernel always corrects).
  quiet = { bias_correction = true },

  -- luazero's update is always AdamW (decoupled weight decay): "Adam" with
  -- adam_w_mode false (L2 in the gradient) is reported.
  read_config = function(p, key, type_name, unimplemented)
    local w_mode = true
    if values.given(p.adam_w_mode) then w_mode = values.boolean(key .. "adam_w_mode", p.adam_w_mode) end
    if type_name == "Adam" and not w_mode then unimplemented(key .. "adam_w_mode") end
    if p.max_grad_norm ~= nil then
      values.fail("%smax_grad_norm is not an optimizer parameter in DeepSpeed; use the " ..
                  "top-level gradient_clipping", key)
    end
    return { decoupled_weight_decay = type_name ~= "Adam" or w_mode }
  end,

  init = function(self) self.args = lz.adamw_args({}) end,

  -- call: p, g (f32 views), s = { m, v }, w (working copy view or nil), decay
  -- (weight decay applies). step: 1-based; lr: this step's; grad_scale: g is
  -- multiplied by it first (loss-scale undo and clipping).
  step = function(self, call, step, lr, grad_scale)
    local a = self.args
    a.lr, a.beta1, a.beta2, a.eps = lr, self.beta1, self.beta2, self.eps
    a.grad_scale, a.step = grad_scale, step
    a.weight_decay = call.decay and self.weight_decay or 0
    ops.adamw_step(call.p, call.g, call.s[1], call.s[2], call.w, a)
  end,
}
