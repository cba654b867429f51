-- nn — modules that own their forward and backward (Torch7 style): the Module
-- base, layers (Linear, LayerNorm, RMSNorm, Embedding, TokenEmbedding),
-- GPT-2's parts (CausalSelfAttention, MLP, Block), Llama's (GQA, SwiGLUMLP,
-- LlamaBlock), an LM head tied to the embedding (TiedHead), the Sequential
-- container and the Model base (arenas sized
-- from the modules' memory reports).
return {
  Module = require("luazero.nn.module"),
  Linear = require("luazero.nn.linear"),
  LayerNorm = require("luazero.nn.layernorm"),
  Embedding = require("luazero.nn.embedding"),
  CausalSelfAttention = require("luazero.nn.attention"),
  MLP = require("luazero.nn.mlp"),
  Block = require("luazero.nn.block"),
  RMSNorm = require("luazero.nn.rmsnorm"),
  TokenEmbedding = require("luazero.nn.token_embedding"),
  GQA = require("luazero.nn.gqa"),
  SwiGLUMLP = require("luazero.nn.swiglu_mlp"),
  LlamaBlock = require("luazero.nn.llama_block"),
  TiedHead = require("luazero.nn.tied_head"),
  Sequential = require("luazero.nn.sequential"),
  Model = require("luazero.nn.model"),
}
