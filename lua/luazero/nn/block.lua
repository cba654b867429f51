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
-- Optional parts attn_post_norm and mlp_post_norm (Gemma 2's
-- post_attention_layernorm and post_feedforward_layernorm) norm a branch's
-- output before the residual add:
--   x = x + attn_post_norm(attn(attn_norm(x))); likewise the MLP.
local lz = require("luazero")
local Module = require("luazero.nn.module")

local ops = lz.ops
local Block = Module:extend("Block")

-- In the order they run (their parameters' canonical order).
local ROLES = { "attn_norm", "attn", "attn_post_norm", "mlp_norm", "mlp", "mlp_post_norm" }
local OPTIONAL = { attn_post_norm = true, mlp_post_norm = true }

function Block.new(parts)
  local self = setmetatable({}, Block):init()
  for _, role in ipairs(ROLES) do
    local part = parts[role]
    if part or not OPTIONAL[role] then
      assert(part and part[1] and part[2], "block: parts." .. role .. " must be { name, module }")
      self[role] = self:add(part[1], part[2])
    end
  end
  -- each pre-norm's output goes to its branch only (a norm may write it
  -- as the branch's GEMMs read it: Module:output_for)
  self.attn_norm.feeds, self.mlp_norm.feeds = self.attn, self.mlp
  return self
end

-- A branch's output, through its post-norm where there is one.
function Block:post(norm, y)
  if not norm then return y end
  return self:run_forward(norm, y)
end

-- The residual sums land in the branch outputs (which backward never reads),
-- so a block allocates no extra tensor for them.
function Block:forward(x)
  local a = self:post(self.attn_post_norm,
                      self:run_forward(self.attn, self:run_forward(self.attn_norm, x)))
  ops.add(a, a, x)
  local m = self:post(self.mlp_post_norm,
                      self:run_forward(self.mlp, self:run_forward(self.mlp_norm, a)))
  ops.add(m, m, a)
  return m
end

-- dy through a post-norm where there is one.
function Block:unpost(norm, dy)
  if not norm then return dy end
  return self:run_backward(norm, dy)
end

-- The residual path carries dy straight through; each branch's dx adds to it.
function Block:backward(dy)
  local d2 = self:run_backward(self.mlp_norm,
                               self:run_backward(self.mlp, self:unpost(self.mlp_post_norm, dy)))
  ops.add(d2, d2, dy)
  local d1 = self:run_backward(self.attn_norm,
                               self:run_backward(self.attn, self:unpost(self.attn_post_norm, d2)))
  ops.add(d1, d1, d2)
  return d1
end

-- Generation: as forward, attention reading and extending the layer's
-- key/value cache `kv` (nn/gqa.lua's forward_cached).
function Block:forward_cached(x, kv)
  local a = self:post(self.attn_post_norm,
                      self.attn:forward_cached(self:run_forward(self.attn_norm, x), kv))
  ops.add(a, a, x)
  local m = self:post(self.mlp_post_norm,
                      self:run_forward(self.mlp, self:run_forward(self.mlp_norm, a)))
  ops.add(m, m, a)
  return m
end

return Block
