-- nn/block.lua — a pre-norm transformer block, made of its parts:
--   x = x + attn(attn_norm(x));  x = x + mlp(mlp_norm(x))
-- GPT-2's: LayerNorm, causal self-attention, the GELU MLP (ln_1, attn, ln_2,
-- mlp); Llama's: RMSNorm, grouped-query attention with rotary embeddings,
-- the SwiGLU MLP (input_layernorm, self_attn, post_attention_layernorm, mlp).
--
--   Block.new({ attn_norm = { "ln_1", LayerNorm.new(C) }, attn = { "attn", ... },
--               mlp_norm = { "ln_2", LayerNorm.new(C) }, mlp = { "mlp", ... } })
-- Each part is { name, module }: the name is its Hugging Face name (the
-- parameters' names and the field it is added under), the role its field
-- here (block.attn_norm, block.attn, block.mlp_norm, block.mlp).
local lz = require("luazero")
local Module = require("luazero.nn.module")

local ops = lz.ops
local Block = Module:extend("Block")

local ROLES = { "attn_norm", "attn", "mlp_norm", "mlp" }

function Block.new(parts)
  local self = setmetatable({}, Block):init()
  for _, role in ipairs(ROLES) do
    local part = parts[role]
    assert(part and part[1] and part[2], "block: parts." .. role .. " must be { name, module }")
    self[role] = self:add(part[1], part[2])
  end
  return self
end

-- The residual sums land in the branch outputs (which backward never reads),
-- so a block allocates no extra tensor for them.
function Block:forward(x)
  local a = self:run_forward(self.attn, self:run_forward(self.attn_norm, x))
  ops.add(a, a, x)
  local m = self:run_forward(self.mlp, self:run_forward(self.mlp_norm, a))
  ops.add(m, m, a)
  return m
end

-- The residual path carries dy straight through; each branch's dx adds to it.
function Block:backward(dy)
  local d2 = self:run_backward(self.mlp_norm, self:run_backward(self.mlp, dy))
  ops.add(d2, d2, dy)
  local d1 = self:run_backward(self.attn_norm, self:run_backward(self.attn, d2))
  ops.add(d1, d1, d2)
  return d1
end

return Block
