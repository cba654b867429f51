-- optim/adamw8bit.lua — 8-bit AdamW, bitsandbytes' AdamW8bit: its
-- declaration in the optimizer table (optim/registry.lua). m and v are one
-- byte an element (u8: optim/formats.lua), an index into bitsandbytes'
-- signed and unsigned dynamic maps times one f32 absmax per block of 256
-- elements of a tensor; a tensor under min_8bit_size elements keeps fp32
-- m, v, as bitsandbytes does. Each step call is one lz_adamw8bit_step
-- (core/optim/adamw8bit.c), bit for bit bitsandbytes 0.50.2's update.
--
-- The engine gives each parameter tensor a block-aligned start and cuts
-- shards on block multiples (zero/layout.lua), so every block lies in one
-- tensor on one rank and a call starts on a block: the states are the same
-- bits at every stage and world size. A call over a small tensor carries
-- f32 m, v and no scales.
local lz = require("luazero")
local schema = require("luazero.optim.schema")

local ops = lz.ops

-- bitsandbytes' keyword arguments that luazero's update already is (their
-- defaults) or that ask for a feature it does not have.
local QUIET = { amsgrad = false, is_paged = false, block_wise = true, percentile_clipping = 100,
                optim_bits = 8 }

return {
  name = "AdamW8bit",
  types = { "AdamW8bit" },
  -- bitsandbytes.optim.AdamW8bit's defaults.
  params = {
    { "lr", "number", min = 0, default = 1e-3 },
    { "betas", "betas", default = { 0.9, 0.999 } },
    { "eps", "number", min = 0, default = 1e-8 },
    { "weight_decay", "number", min = 0, default = 1e-2 },
    { "min_8bit_size", "count", default = 4096 },
  },
  states = { { name = "m", format = "u8", signed = true }, { name = "v", format = "u8" } },
  quiet = QUIET,
  keeps = { "u8" },
  -- (the same moments in f32 or bf16: a checkpoint converted to them
  -- resumes as AdamW)
  converts_to = { f32 = "AdamW", bf16 = "AdamW" },
  -- (Adam8bit is this update under another default weight decay)
  resumes = { "Adam8bit" },

  -- bf16_stochastic_round (torchao's flag, as AdamW reads it): no fp32
  -- master, the bf16 parameters updated through stochastic rounding.
  accepted = { bf16_stochastic_round = true },

  -- Weight decay is decoupled in bitsandbytes' 8-bit Adam and AdamW alike.
  read_config = function(p, key)
    return { decoupled_weight_decay = true, master_format = schema.master_format(p, key) }
  end,

  -- Tensors of fewer elements keep their states in f32.
  small_below = "min_8bit_size",

  init = function(self) self.args = lz.adamw_args({}) end,

  -- call: p, g (f32 views), s = { m, v } (u8, or f32 for a small tensor),
  -- scales = { absmax_m, absmax_v } (f32, one per block; nil beside f32
  -- states), w (working copy view or nil), decay (weight decay applies).
  step = function(self, call, step, lr, grad_scale)
    local a = self.args
    a.lr, a.beta1, a.beta2, a.eps = lr, self.beta1, self.beta2, self.eps
    a.grad_scale, a.step = grad_scale, step
    a.weight_decay = call.decay and self.weight_decay or 0
    local sc = call.scales
    ops.adamw8bit_step(call.p, call.g, call.s[1], call.s[2], sc and sc[1], sc and sc[2], call.w, a)
  end,

  -- The same over a bf16 master, rounded stochastically in the one pass.
  step_sround = function(self, call, step, lr, grad_scale, seed, index)
    local a = self.args
    a.lr, a.beta1, a.beta2, a.eps = lr, self.beta1, self.beta2, self.eps
    a.grad_scale, a.step = grad_scale, step
    a.weight_decay = call.decay and self.weight_decay or 0
    local sc = call.scales
    ops.adamw8bit_step_bf16(call.p, call.g, call.s[1], call.s[2], sc and sc[1], sc and sc[2],
                            call.w, a, seed, index)
  end,
}
