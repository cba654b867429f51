-- nn/llama_block.lua — a Llama decoder layer (Hugging Face's
-- LlamaDecoderLayer): RMSNorm before each branch,
--   x = x + self_attn(input_layernorm(x));  x = x + mlp(post_attention_layernorm(x))
local lz = require("luazero")
local Module = require("luazero.nn.module")
local RMSNorm = require("luazero.nn.rmsnorm")
local GQA = require("luazero.nn.gqa")
local SwiGLUMLP = require("luazero.nn.swiglu_mlp")

local ops = lz.ops
local LlamaBlock = Module:extend("LlamaBlock")

-- cfg: n_embd, n_head, n_kv_head, head_dim, n_hidden, eps, std; rope: the
-- shared rotary frequencies (nn/gqa.lua).
function LlamaBlock.new(cfg, rope)
  local self = setmetatable({}, LlamaBlock):init()
  self:add("input_layernorm", RMSNorm.new(cfg.n_embd, cfg.eps))
  self:add("self_attn", GQA.new(cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim, rope,
                                cfg.std))
  self:add("post_attention_layernorm", RMSNorm.new(cfg.n_embd, cfg.eps))
  self:add("mlp", SwiGLUMLP.new(cfg.n_embd, cfg.n_hidden, cfg.std))
  return self
end

-- The residual sums land in the branch outputs (which backward never reads).
function LlamaBlock:forward(x)
  local a = self:run_forward(self.self_attn, self:run_forward(self.input_layernorm, x))
  ops.add(a, a, x)
  local m = self:run_forward(self.mlp, self:run_forward(self.post_attention_layernorm, a))
  ops.add(m, m, a)
  return m
end

function LlamaBlock:backward(dy)
  local d2 = self:run_backward(self.post_attention_layernorm, self:run_backward(self.mlp, dy))
  ops.add(d2, d2, dy)
  local d1 = self:run_backward(self.input_layernorm, self:run_backward(self.self_attn, d2))
  ops.add(d1, d1, d2)
  return d1
end

return LlamaBlock
