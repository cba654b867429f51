-- nn — modules that own their forward and backward (Torch7 style): the Module
-- base, layers (Linear, PackedLinear, LayerNorm, RMSNorm, Embedding,
-- TokenEmbedding), attention (GPT-2's CausalSelfAttention; Llama's GQA with
-- its shared Rope and QK-norm), MLPs (GELU, SwiGLU), the pre-norm Block made of those
-- parts, LoRA adapters around a Linear, an LM head tied to the embedding
-- (TiedHead), the Sequential container, the Model base (arenas sized from
-- the modules' memory reports) and the CausalLM a model family fills in.
return {
  Module = require("luazero.nn.module"),
  Linear = require("luazero.nn.linear"),
  PackedLinear = require("luazero.nn.packed_linear"),
  LayerNorm = require("luazero.nn.layernorm"),
  Embedding = require("luazero.nn.embedding"),
  CausalSelfAttention = require("luazero.nn.attention"),
  MLP = require("luazero.nn.mlp"),
  Block = require("luazero.nn.block"),
  RMSNorm = require("luazero.nn.rmsnorm"),
  TokenEmbedding = require("luazero.nn.token_embedding"),
  Rope = require("luazero.nn.rope"),
  QKNorm = require("luazero.nn.qk_norm"),
  GQA = require("luazero.nn.gqa"),
  SwiGLUMLP = require("luazero.nn.swiglu_mlp"),
  LoRA = require("luazero.nn.lora"),
  MoE = require("luazero.nn.moe"),
  TiedHead = require("luazero.nn.tied_head"),
  Sequential = require("luazero.nn.sequential"),
  Model = require("luazero.nn.model"),
  CausalLM = require("luazero.nn.causal_lm"),
}
