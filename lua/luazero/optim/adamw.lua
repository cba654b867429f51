-- optim/adamw.lua — AdamW (decoupled weight decay, torch.optim.AdamW's
-- update): its declaration in the optimizer table (optim/registry.lua).
-- The engine hands step calls, pieces of the flat fp32 master with
-- matching views, and each is one fused lz_adamw_step that also writes the
-- working copy.
local lz = require("luazero")
local values = require("luazero.config.values")
local schema = require("luazero.optim.schema")

local ops = lz.ops

-- A moment's dtype as AnyPrecisionAdamW spells it (torch's names, with or
-- without "torch.") -> its state format; absent: float32.
local MOMENT_DTYPES = { float32 = "f32", fp32 = "f32", bfloat16 = "bf16", bf16 = "bf16" }
local function moment_format(key, v)
  if not values.given(v) then return "f32" end
  local f = type(v) == "string" and MOMENT_DTYPES[v:gsub("^torch%.", "")]
  if not f then
    values.fail("%s must be \"float32\" or \"bfloat16\" (got %s)", key, values.show(v))
  end
  return f
end

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
  states = { { name = "m", format = "f32" }, { name = "v", format = "f32" } },
  keeps = { "f32", "bf16" },
  -- (the same moments, 8-bit: a checkpoint converted to u8 resumes as AdamW8bit)
  converts_to = { u8 = "AdamW8bit" },
  -- torch_adam picks among DeepSpeed's implementations of the same update;
  -- momentum_dtype and variance_dtype (AnyPrecisionAdamW's names) the
  -- moments' format.
  accepted = { adam_w_mode = true, torch_adam = true, momentum_dtype = true,
               variance_dtype = true, bf16_stochastic_round = true },
  -- bias_correction: false is refused (the kernel always corrects).
  quiet = { bias_correction = true },

  -- luazero's update is always AdamW (decoupled weight decay): "Adam" with
  -- adam_w_mode false (L2 in the gradient) is refused unless weight_decay is 0.
  read_config = function(p, key, type_name, unimplemented)
    local w_mode = true
    if values.given(p.adam_w_mode) then w_mode = values.boolean(key .. "adam_w_mode", p.adam_w_mode) end
    -- (Adam with L2 decay is another update wherever the decay is not 0;
    -- amsgrad and no bias correction likewise: refused, not run otherwise)
    local decay = values.given(p.weight_decay) and p.weight_decay or 0
    if type_name == "Adam" and not w_mode and decay ~= 0 then
      values.fail("%sadam_w_mode false asks for Adam with L2 weight decay (added to the " ..
                  "gradient), which luazero does not have: its update decouples the decay " ..
                  "(AdamW); drop adam_w_mode, or set weight_decay 0, where the two agree", key)
    end
    if p.amsgrad == true then
      values.fail("%samsgrad true (AMSGrad) is not implemented, and the update would differ " ..
                  "from the one asked for; set it false or drop it", key)
    end
    if p.bias_correction == false then
      values.fail("%sbias_correction false is not implemented (the update always corrects " ..
                  "the moments' bias), and the update would differ; drop it", key)
    end
    if p.max_grad_norm ~= nil then
      values.fail("%smax_grad_norm is not an optimizer parameter in DeepSpeed; use the " ..
                  "top-level gradient_clipping", key)
    end
    -- The moments in bf16 (8 bytes a parameter with the fp32 master, not
    -- 12): both or neither, as the fused step updates them together.
    local m_fmt = moment_format(key .. "momentum_dtype", p.momentum_dtype)
    local v_fmt = moment_format(key .. "variance_dtype", p.variance_dtype)
    if m_fmt ~= v_fmt then
      values.fail("%smomentum_dtype and %svariance_dtype must be the same (both float32 or both " ..
                  "bfloat16; got %s and %s)", key, key, values.show(p.momentum_dtype),
                  values.show(p.variance_dtype))
    end
    -- bf16_stochastic_round (torchao's AdamW flag): no fp32 master.
    return { decoupled_weight_decay = type_name ~= "Adam" or w_mode,
             state_formats = { m = m_fmt, v = v_fmt },
             master_format = schema.master_format(p, key) }
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
