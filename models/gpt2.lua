-- models/gpt2.lua — the GPT-2 family: pre-LayerNorm blocks, learned position
-- embeddings, GELU (tanh), the token embedding tied to the LM head.
--
--   local gpt2 = require("models.gpt2")
--   local cfg = gpt2.config("gpt2-nano", { n_layer = 2 })
--   local model = gpt2.new(cfg)       -- declares the parameter table
--   model:allocate()                  -- flat fp32 params and grads, views bound
--   model:init_weights(seed)          -- N(0, 0.02), residual projections scaled
--   model:checkpoint_activations(opts) -- optional: keep each block's input only
--   model:prepare(B, T)               -- activation arenas sized for B x T
--   local loss = model:forward(tokens, targets); model:backward(scale)
-- (nn/causal_lm.lua runs it; this file describes it: its sizes and parts.)
--
-- Parameter names are Hugging Face's (transformer.h.0.attn.c_attn.weight,
-- ...) and the parameter table lists them in that canonical order. Linear
-- weights are [out, in] (nn.Linear); Hugging Face's Conv1D stores [in, out].
local cjson = require("cjson")
local nn = require("luazero.nn")
local families = require("luazero.families")

local M = { name = "gpt2" }

------------------------------------------------------------------ configs

-- GPT-2's BPE vocabulary: 50257 tokens, the last <|endoftext|>, which also
-- begins a document (samples start from it).
M.VOCAB, M.END_OF_TEXT = 50257, 50256

-- lr: a learning rate that trains the size well, used when --lr is not given.
M.configs = {
  -- micro_batch: scripts/train.lua's default for this size (else 8): a
  -- short run on a small corpus learns (docs/training.md, "Defaults that learn")
  ["gpt2-nano"] = { n_layer = 4, n_head = 4, n_embd = 128, context = 256, vocab = 256,
                    lr = 3e-3, micro_batch = 64 },
  ["gpt2"] = { n_layer = 12, n_head = 12, n_embd = 768, context = 1024, vocab = M.VOCAB,
               lr = 6e-4 },
  ["gpt2-medium"] = { n_layer = 24, n_head = 16, n_embd = 1024, context = 1024,
                      vocab = M.VOCAB, lr = 3e-4 },
  ["gpt2-large"] = { n_layer = 36, n_head = 20, n_embd = 1280, context = 1024,
                     vocab = M.VOCAB, lr = 2.5e-4 },
  ["gpt2-xl"] = { n_layer = 48, n_head = 25, n_embd = 1600, context = 1024, vocab = M.VOCAB,
                  lr = 2e-4 },
}
M.names = { "gpt2-nano", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl" }

-- The embedding table gets rows up to a multiple of 64 (50257 -> 50304) so
-- the LM-head GEMM runs on friendly shapes; the loss uses the real vocab.
local function padded(vocab) return math.ceil(vocab / 64) * 64 end

-- A complete config from a table of fields (a named size's, or one read
-- from a config.json): checked, with the derived sizes.
function M.finish(cfg)
  for _, k in ipairs({ "n_layer", "n_head", "n_embd", "context", "vocab" }) do
    local v = cfg[k]
    if type(v) ~= "number" or v < 1 or v ~= math.floor(v) then
      error(("%s must be a whole number >= 1 (got %s)"):format(k, tostring(v)), 0)
    end
  end
  if cfg.n_embd % cfg.n_head ~= 0 then
    error(("n_embd %d is not a multiple of n_head %d"):format(cfg.n_embd, cfg.n_head), 0)
  end
  if cfg.eps ~= nil and (type(cfg.eps) ~= "number" or not (cfg.eps > 0)) then
    error(("eps must be a number > 0 (got %s)"):format(tostring(cfg.eps)), 0)
  end
  if cfg.vocab > 65536 then
    error(("vocab %d is above 65536, the most a token file's uint16 ids can name")
          :format(cfg.vocab), 0)
  end
  cfg.family = "gpt2"
  cfg.padded_vocab = padded(cfg.vocab)
  return cfg
end

-- A named size with overrides (n_layer, n_head, n_embd, context, vocab).
M.config = families.sizes(M)

-------------------------------------------------------------------- model

-- GPT-2: residual projections start smaller, so the residual stream's
-- variance does not grow with depth.
local function proj_std(cfg) return 0.02 / math.sqrt(2 * cfg.n_layer) end

-- The model as nn.CausalLM builds it, with Hugging Face's names:
-- transformer.{wte,wpe}.weight, transformer.h.N.{ln_1,attn,ln_2,mlp}.*,
-- transformer.ln_f.*; lm_head tied to wte.
M.description = {
  names = { body = "transformer", embedding = false, blocks = "h", norm = "ln_f",
            head = "lm_head",
            block = { attn_norm = "ln_1", attn = "attn", mlp_norm = "ln_2", mlp = "mlp" } },
  embedding = function(cfg) return nn.Embedding.new(cfg.padded_vocab, cfg.context, cfg.n_embd) end,
  norm = function(cfg) return nn.LayerNorm.new(cfg.n_embd, cfg.eps) end,
  attention = function(cfg)
    return nn.CausalSelfAttention.new(cfg.n_embd, cfg.n_head, proj_std(cfg))
  end,
  mlp = function(cfg) return nn.MLP.new(cfg.n_embd, proj_std(cfg)) end,
  -- LoRA targets (models/lora.lua): a module name -> the Linears it names,
  -- as the ends of their paths.
  lora_targets = {
    c_attn = { "attn.c_attn" },
    c_proj = { "attn.c_proj", "mlp.c_proj" },
    c_fc = { "mlp.c_fc" },
  },
  -- what LoRA adapts when no targets are given (PEFT's default for gpt2)
  lora_default = { "c_attn" },
}

local GPT = nn.CausalLM:extend("GPT")
M.GPT = GPT

function M.new(cfg) return GPT:new(M.description, cfg) end

-- A sample of a model with GPT-2's BPE vocabulary starts from <|endoftext|>
-- (models/registry.lua's sample_start; nil: the vocabulary is another).
function M.sample_start(cfg)
  if cfg.vocab == M.VOCAB then return M.END_OF_TEXT end
end

----------------------------------------------------------- Hugging Face

-- Published GPT-2 files name GPT2Model's tensors (h.0.attn.c_attn.weight);
-- GPT2LMHeadModel.save_pretrained writes them under "transformer.". Ours
-- carry the prefix; an export leaves it out, and a file's names are read
-- either way.
local function without_prefix(name) return (name:gsub("^transformer%.", "")) end

-- The config.json (GPT2LMHeadModel) of a config, loadable by transformers.
local function config_json(cfg)
  local no_id = cfg.vocab > M.END_OF_TEXT and M.END_OF_TEXT or cjson.null
  return {
    architectures = { "GPT2LMHeadModel" }, model_type = "gpt2",
    n_layer = cfg.n_layer, n_head = cfg.n_head, n_embd = cfg.n_embd,
    n_positions = cfg.context, n_ctx = cfg.context, vocab_size = cfg.vocab, n_inner = cjson.null,
    activation_function = "gelu_new", layer_norm_epsilon = cfg.eps or 1e-5,
    initializer_range = 0.02,
    resid_pdrop = 0, embd_pdrop = 0, attn_pdrop = 0, tie_word_embeddings = true,
    -- (unset: <|endoftext|> where the vocabulary holds it, else none;
    -- transformers would take 50256, past a smaller vocabulary)
    bos_token_id = cfg.bos_id or no_id, eos_token_id = cfg.eos_id or no_id,
  }
end

-- What Hugging Face calls this family (registry.lua and hf.lua read it; the
-- fields as models/llama.lua's).
M.hf = {
  architectures = { "GPT2LMHeadModel" }, model_type = "gpt2",
  fields = {
    { "n_layer", "n_layer", "int" },
    { "n_head", "n_head", "int" },
    { "n_embd", "n_embd", "int" },
    { "vocab", "vocab_size", "int" },
    { "context", "n_positions", "int", default = function(_, get) return get("n_ctx") end },
    { "eps", "layer_norm_epsilon", "number", default = 1e-5 },
    { "bos_id", "bos_token_id", "ids", optional = true },
    { "eos_id", "eos_token_id", "ids", optional = true },
    { false, "activation_function", "string", default = "gelu_new",
      allowed = { "gelu_new", "gelu_pytorch_tanh" },
      refusal = "luazero's GPT-2 has the tanh GELU (gelu_new)" },
    { false, "n_inner", "int", optional = true, read = function(v, fail, cfg)
        if v ~= 4 * cfg.n_embd then
          fail(("field n_inner is %d; luazero's GPT-2 MLP is 4 x n_embd wide (%d), or null")
               :format(v, 4 * cfg.n_embd))
        end
      end },
    { false, "scale_attn_weights", "bool", default = true, allowed = { true },
      refusal = "luazero's GPT-2 scales attention scores by 1 / sqrt(head size)" },
    { false, "scale_attn_by_inverse_layer_idx", "bool", default = false, allowed = { false },
      refusal = "luazero's GPT-2 does not scale attention scores by layer" },
    { false, "tie_word_embeddings", "bool", default = true, allowed = { true },
      refusal = "luazero's GPT-2 ties the LM head to wte" },
  },
  lr_of = "gpt2",
  config_json = config_json,
  to_hf = without_prefix,
  from_hf = without_prefix,
  -- Conv1D weights, stored [in, out] (ours are [out, in])
  transposed = { "%.c_attn%.weight$", "%.c_proj%.weight$", "%.c_fc%.weight$" },
  vocab_tables = { "wte.weight" },
  -- the causal mask some files hold beside the weights
  ignored = { "%.attn%.bias$", "%.attn%.masked_bias$" },
  head = "lm_head.weight",
  tied = function() return true end,
}

return M
