-- nn/block.lua — a pre-LayerNorm transformer block (GPT-2):
--   x = x + attn(ln_1(x));  x = x + mlp(ln_2(x))
local lz = require("luazero")
local Module = require("luazero.nn.module")
local LayerNorm = require("luazero.nn.layernorm")
local CausalSelfAttention = require("luazero.nn.attention")
local MLP = require("luazero.nn.mlp")

local ops = lz.ops
local Block = Module:extend("Block")

function Block.new(n_embd, n_head, proj_std)
  local self = setmetatable({}, Block):init()
  self:add("ln_1", LayerNorm.new(n_embd))
  self:add("attn", CausalSelfAttention.new(n_embd, n_head, proj_std))
  self:add("ln_2", LayerNorm.new(n_embd))
  self:add("mlp", MLP.new(n_embd, proj_std))
  return self
end

-- The residual sums land in the branch outputs (which backward never reads),
-- so a block allocates no extra tensor for them.
function Block:forward(x)
  local a = self:run_forward(self.attn, self:run_forward(self.ln_1, x))
  ops.add(a, a, x)
  local m = self:run_forward(self.mlp, self:run_forward(self.ln_2, a))
  ops.add(m, m, a)
  return m
end

-- The residual path carries dy straight through; each branch's dx adds to it.
function Block:backward(dy)
  local d2 = self:run_backward(self.ln_2, self:run_backward(self.mlp, dy))
  ops.add(d2, d2, dy)
  local d1 = self:run_backward(self.ln_1, self:run_backward(self.attn, d2))
  ops.add(d1, d1, d2)
  return d1
end

return Block
