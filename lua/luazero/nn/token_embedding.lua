-- nn/token_embedding.lua — a token table alone, no position table (Llama's
-- embed_tokens: positions come from the rotary embeddings inside attention).
local lz = require("luazero")
local Module = require("luazero.nn.module")

local ops = lz.ops
local TokenEmbedding = Module:extend("TokenEmbedding")

-- vocab: rows of the table (may be padded past the real vocabulary).
function TokenEmbedding.new(vocab, n_embd, std)
  local self = setmetatable({}, TokenEmbedding):init()
  self.vocab, self.n_embd = vocab, n_embd
  self.token_key = "weight" -- the token table (an LM head tied to it reads it)
  self:param("weight", { vocab, n_embd }, { kind = "normal", std = std or 0.02 }, true)
  return self
end

-- tokens i32 [B, T] -> [B, T, C]
function TokenEmbedding:forward(tokens)
  local y = self:activation({ tokens:dim(1), tokens:dim(2), self.n_embd })
  ops.embedding_forward(y, tokens, self:table_operand(self.p.weight), nil)
  self.input = tokens
  return y
end

-- Tokens have no gradient: returns nothing.
function TokenEmbedding:backward(dy)
  ops.embedding_backward(self.g.weight, nil, dy, self.input)
end

-- Input: the i32 token ids. Casts: the table in forward (none in bf16).
function TokenEmbedding:own_memory(B, T, dtype)
  return { input = lz.arena_bytes(B * T, "i32"), activations = lz.arena_bytes(B * T * self.n_embd),
           casts = Module.table_cast_bytes(self.vocab * self.n_embd, dtype) }
end

return TokenEmbedding
