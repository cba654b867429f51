-- nn/embedding.lua — token plus position embedding, GPT-2's input layer.
-- One kernel does both lookups, so one module holds both tables; their names
-- stay Hugging Face's (wte.weight, wpe.weight) because the module sits in its
-- parent's namespace (added with name false).
local lz = require("luazero")
local Module = require("luazero.nn.module")

local ops = lz.ops
local Embedding = Module:extend("Embedding")

-- vocab: rows of the token table (may be padded past the real vocabulary);
-- positions: rows of the position table (the model's context).
function Embedding.new(vocab, positions, n_embd, std)
  local self = setmetatable({}, Embedding):init()
  self.vocab, self.positions, self.n_embd = vocab, positions, n_embd
  self.token_key = "wte" -- the token table (an LM head tied to it reads it)
  local init = { kind = "normal", std = std or 0.02 }
  self:param("wte", { vocab, n_embd }, init, true, "wte.weight")
  self:param("wpe", { positions, n_embd }, init, true, "wpe.weight")
  return self
end

-- tokens i32 [B, T] -> [B, T, C]. Positions are 0..T-1, or the model's
-- ctx.extra.pos when a batch packs documents (each restarts at 0).
function Embedding:forward(tokens)
  local y = self:activation({ tokens:dim(1), tokens:dim(2), self.n_embd })
  local extra = self.ctx.extra
  local pos = extra and extra.pos
  local wte, wpe = self:table_operand(self.p.wte), self:table_operand(self.p.wpe)
  if pos then
    ops.embedding_pos_forward(y, tokens, pos, wte, wpe)
  else
    ops.embedding_forward(y, tokens, wte, wpe)
  end
  self.input, self.pos = tokens, pos
  return y
end

-- Tokens have no gradient: returns nothing.
function Embedding:backward(dy)
  if self.pos then
    ops.embedding_pos_backward(self.g.wte, self.g.wpe, dy, self.input, self.pos)
  else
    ops.embedding_backward(self.g.wte, self.g.wpe, dy, self.input)
  end
end

-- Input: the i32 token ids. Casts: both tables in forward (none in bf16).
function Embedding:own_memory(B, T, dtype)
  return { input = lz.arena_bytes(B * T, "i32"), activations = lz.arena_bytes(B * T * self.n_embd),
           casts = Module.table_cast_bytes(self.vocab * self.n_embd, dtype) +
                   Module.table_cast_bytes(self.positions * self.n_embd, dtype) }
end

return Embedding
