-- nn/tied_head.lua — an LM head tied to the token embedding: logits = x @
-- table^T, the embedding's table borrowed, no parameter of its own (Hugging
-- Face's lm_head.weight is the embedding's weight when tied). A ZeRO-3
-- engine reads `tied` to gather that table before this module runs.
--   TiedHead.new(embedding, key, name, padded_vocab)
--   key: the table's field in embedding.p/.g; name: its full parameter name.
local lz = require("luazero")
local Module = require("luazero.nn.module")

local ops = lz.ops
local TiedHead = Module:extend("TiedHead")

function TiedHead.new(embedding, key, name, padded_vocab)
  local self = setmetatable({}, TiedHead):init()
  self.embedding, self.key, self.padded_vocab = embedding, key, padded_vocab
  self.tied = { weight = name }
  return self
end

function TiedHead:forward(x)
  local logits = self:activation({ x:dim(1), x:dim(2), self.padded_vocab })
  local xw, w = self:matmul_operands(x, self.embedding.p[self.key])
  ops.linear_forward(logits, xw, w, nil)
  self.input = xw
  return logits
end

function TiedHead:backward(dlogits)
  local x = self.input
  local dx = self:scratch({ x:dim(1), x:dim(2), x:dim(3) })
  local dw, w = self:matmul_operands(dlogits, self.embedding.p[self.key])
  ops.linear_backward(dx, self.embedding.g[self.key], nil, dw, x, w)
  return dx
end

function TiedHead:gemm_input() return 1 end

-- Casts: the matmul operands in forward and backward.
function TiedHead:own_memory(B, T, dtype)
  local C = self.embedding.n_embd
  local x, logits, w = B * T * C, B * T * self.padded_vocab, self.padded_vocab * C
  return { input = lz.arena_bytes(x), activations = lz.arena_bytes(logits),
           scratch = lz.arena_bytes(x),
           casts = Module.matmul_cast_bytes(x, w, dtype) + Module.matmul_cast_bytes(logits, w, dtype) }
end

return TiedHead
