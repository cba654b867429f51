-- optim/adamw.lua — AdamW over a model's flat parameter buffer, with
-- global-norm gradient clipping. Weight decay applies to 2-D weights only, so
-- the buffer is cut into runs of neighbouring parameters that share a decay
-- setting; each run is one lz_adamw_step call over views of the flat buffers.
-- A ZeRO engine intersects the same runs with its shard.
local lz = require("luazero")

local ops = lz.ops
local AdamW = {}
AdamW.__index = AdamW

-- Runs {offset, numel, decay} of neighbouring entries with the same decay.
local function decay_runs(param_table)
  local runs = {}
  for _, e in ipairs(param_table) do
    local last = runs[#runs]
    if last and last.decay == e.decay and last.offset + last.numel == e.offset then
      last.numel = last.numel + e.numel
    else
      runs[#runs + 1] = { offset = e.offset, numel = e.numel, decay = e.decay }
    end
  end
  return runs
end
AdamW.decay_runs = decay_runs

-- params, grads: flat f32 tensors; param_table: the model's. opts: beta1
-- (0.9), beta2 (0.95), eps (1e-8), weight_decay (0.1), clip (1.0; 0 = off).
function AdamW.new(params, grads, param_table, opts)
  opts = opts or {}
  local n = params:numel()
  local self = setmetatable({
    beta1 = opts.beta1 or 0.9, beta2 = opts.beta2 or 0.95, eps = opts.eps or 1e-8,
    weight_decay = opts.weight_decay or 0.1, clip = opts.clip or 1.0,
    params = params, grads = grads, step_count = 0,
    m = lz.tensor({ n }, "f32", "optimizer"), v = lz.tensor({ n }, "f32", "optimizer"),
    runs = {},
  }, AdamW)
  for _, r in ipairs(decay_runs(param_table)) do
    local shape = { r.numel }
    self.runs[#self.runs + 1] = {
      decay = r.decay,
      p = params:view(r.offset, shape), g = grads:view(r.offset, shape),
      m = self.m:view(r.offset, shape), v = self.v:view(r.offset, shape),
    }
  end
  self.args = lz.adamw_args({})
  return self
end

-- The L2 norm of all gradients: lz_sq_norm sums fixed blocks in a fixed
-- order, so the norm does not depend on the thread count.
function AdamW:grad_norm()
  return math.sqrt(self.grads:sq_norm())
end

-- One update at learning rate lr. Returns the gradient norm before clipping.
-- Clipping scales the gradients by clip / (norm + 1e-6) when that is below 1
-- (torch.nn.utils.clip_grad_norm_), folded into the kernel's grad_scale.
function AdamW:step(lr)
  local norm = self:grad_norm()
  local scale = 1.0
  if self.clip > 0 then
    local c = self.clip / (norm + 1e-6)
    if c < 1 then scale = c end
  end
  self.step_count = self.step_count + 1
  local a = self.args
  a.lr, a.beta1, a.beta2, a.eps = lr, self.beta1, self.beta2, self.eps
  a.grad_scale, a.step = scale, self.step_count
  for _, r in ipairs(self.runs) do
    a.weight_decay = r.decay and self.weight_decay or 0
    ops.adamw_step(r.p, r.g, r.m, r.v, nil, a)
  end
  return norm
end

function AdamW:free()
  self.m:free()
  self.v:free()
end

return AdamW
