-- nn/token_embedding.lua — a token table alone, no position table (Llama's
-- embed_tokens: positions come from the rotary embeddings inside attention).
-- With a scale, each row comes out times it (Gemma's sqrt(hidden_size)
-- normalizer), rounded as transformers rounds it: to the dtype of the
-- hidden states, f32, or bf16 under bf16 working parameters. With a
-- padding_idx (transformers' pad_token_id) the positions holding that
-- token add no gradient to its row, as torch's nn.Embedding(padding_idx).
local bit = require("bit")
local ffi = require("ffi")
local lz = require("luazero")
local Module = require("luazero.nn.module")

local ops = lz.ops
local TokenEmbedding = Module:extend("TokenEmbedding")

local f32 = ffi.new("float[1]")

-- x rounded to f32, or to bf16 (nearest, ties to even) under "bf16".
local function rounded(x, dtype)
  f32[0] = x
  if dtype ~= "bf16" then return f32[0] end
  local u = ffi.cast("uint32_t *", f32)
  u[0] = bit.band(u[0] + 0x7fff + bit.band(bit.rshift(u[0], 16), 1), 0xffff0000)
  return f32[0]
end

-- vocab: rows of the table (may be padded past the real vocabulary).
-- scale: what every row is multiplied by (nil: none). padding_idx: the
-- row the input side never trains (nil, or past the table: none).
function TokenEmbedding.new(vocab, n_embd, std, scale, padding_idx)
  local self = setmetatable({}, TokenEmbedding):init()
  self.vocab, self.n_embd, self.scale = vocab, n_embd, scale
  if padding_idx and padding_idx >= 0 and padding_idx < vocab then
    self.padding_idx = padding_idx
  end
  self.token_key = "weight" -- the token table (an LM head tied to it reads it)
  self:param("weight", { vocab, n_embd }, { kind = "normal", std = std or 0.02 }, true)
  return self
end

-- tokens i32 [B, T] -> [B, T, C]
function TokenEmbedding:forward(tokens)
  local y = self:activation({ tokens:dim(1), tokens:dim(2), self.n_embd })
  ops.embedding_forward(y, tokens, self:table_operand(self.p.weight), nil)
  if self.scale then ops.scale(y, self:scale_factor()) end
  self.input = tokens
  return y
end

function TokenEmbedding:scale_factor()
  return rounded(self.scale, self.ctx.cast_dtype)
end

-- Tokens have no gradient: returns nothing. A scale scales dy in place
-- (nothing reads it after this, the first module).
function TokenEmbedding:backward(dy)
  if self.scale then ops.scale(dy, self:scale_factor()) end
  if self.padding_idx then
    ops.embedding_skip_backward(self.g.weight, nil, dy, self.input, nil, self.padding_idx)
  else
    ops.embedding_backward(self.g.weight, nil, dy, self.input)
  end
end

-- Input: the i32 token ids. Casts: the table in forward (none in bf16).
function TokenEmbedding:own_memory(B, T, dtype)
  return { input = lz.arena_bytes(B * T, "i32"), activations = lz.arena_bytes(B * T * self.n_embd),
           casts = Module.table_cast_bytes(self.vocab * self.n_embd, dtype) }
end

return TokenEmbedding
