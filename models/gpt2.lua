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
--
-- Parameter names are Hugging Face's (transformer.h.0.attn.c_attn.weight,
-- ...) and the parameter table lists them in that canonical order. Linear
-- weights are [out, in] (nn.Linear); Hugging Face's Conv1D stores [in, out].
local ffi = require("ffi")
local lz = require("luazero")
local nn = require("luazero.nn")
local rng = require("luazero.rng")

local ops = lz.ops
local M = {}

------------------------------------------------------------------ configs

-- lr: a learning rate that trains the size well, used when --lr is not given.
M.configs = {
  ["gpt2-nano"] = { n_layer = 4, n_head = 4, n_embd = 128, context = 256, vocab = 256,
                    lr = 3e-3 },
  ["gpt2"] = { n_layer = 12, n_head = 12, n_embd = 768, context = 1024, vocab = 50257,
               lr = 6e-4 },
  ["gpt2-medium"] = { n_layer = 24, n_head = 16, n_embd = 1024, context = 1024,
                      vocab = 50257, lr = 3e-4 },
  ["gpt2-large"] = { n_layer = 36, n_head = 20, n_embd = 1280, context = 1024,
                     vocab = 50257, lr = 2.5e-4 },
  ["gpt2-xl"] = { n_layer = 48, n_head = 25, n_embd = 1600, context = 1024, vocab = 50257,
                  lr = 2e-4 },
}
M.names = { "gpt2-nano", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl" }

-- The embedding table gets rows up to a multiple of 64 (50257 -> 50304) so
-- the LM-head GEMM runs on friendly shapes; the loss uses the real vocab.
local function padded(vocab) return math.ceil(vocab / 64) * 64 end

-- A named size with overrides (n_layer, n_head, n_embd, context, vocab).
-- Errors are plain strings naming the thing and the fix.
function M.config(name, overrides)
  local base = M.configs[name]
  if not base then
    error(("unknown model '%s' (known: %s)"):format(tostring(name),
          table.concat(M.names, ", ")), 0)
  end
  local cfg = { name = name }
  for k, v in pairs(base) do cfg[k] = v end
  for k, v in pairs(overrides or {}) do cfg[k] = v end
  return M.finish(cfg)
end

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
  if cfg.vocab > 65536 then
    error(("vocab %d is above 65536, the most a token file's uint16 ids can name")
          :format(cfg.vocab), 0)
  end
  cfg.family = "gpt2"
  cfg.padded_vocab = padded(cfg.vocab)
  return cfg
end

-------------------------------------------------------------------- model

-- nn.Model runs the layers and sizes the arenas: the embedding, the blocks,
-- ln_f, then the LM head; the model adds the loss.
local GPT = nn.Model:extend("GPT")
M.GPT = GPT

function M.new(cfg)
  local self = setmetatable({}, GPT):init()
  self.cfg = cfg
  local C, L = cfg.n_embd, cfg.n_layer
  -- GPT-2: residual projections start smaller, so the residual stream's
  -- variance does not grow with depth.
  local proj_std = 0.02 / math.sqrt(2 * L)
  local transformer = self:add("transformer", setmetatable({}, nn.Module):init())
  transformer.embedding = transformer:add(false,
                                          nn.Embedding.new(cfg.padded_vocab, cfg.context, C))
  local blocks = {}
  for i = 1, L do blocks[i] = nn.Block.new(C, cfg.n_head, proj_std) end
  transformer:add("h", nn.Sequential.new(blocks))
  transformer:add("ln_f", nn.LayerNorm.new(C))
  self:add("lm_head", nn.TiedHead.new(transformer.embedding, "wte", "transformer.wte.weight",
                                                 cfg.padded_vocab))
  self.layers = { stem = { transformer.embedding }, blocks = blocks, top = { transformer.ln_f },
                  output = self.lm_head }
  self.param_table, self.n_params = self:parameter_table()
  self:set_context({})
  return self
end

-- Real parameters (the padded embedding rows excluded), as papers count them.
function GPT:count_params()
  return self.n_params - (self.cfg.padded_vocab - self.cfg.vocab) * self.cfg.n_embd
end

-- Deterministic for a seed: one generator walks the table in canonical order.
function GPT:init_weights(seed)
  self:draw_params(seed)
  -- Padding rows of the token table are never looked up nor scored: zero
  -- keeps them inert (weight decay leaves zeros at zero).
  local cfg = self.cfg
  local pad = cfg.padded_vocab - cfg.vocab
  if pad > 0 then
    self.transformer.embedding.p.wte:view(cfg.vocab * cfg.n_embd, { pad * cfg.n_embd }):fill(0)
  end
  return self
end

------------------------------------------------------------ activations

-- The per-position losses of forward.
function GPT:own_memory(B, T)
  return { activations = lz.arena_bytes(B * T) }
end

function GPT:prepare(B, T)
  if T > self.cfg.context then
    error(("sequence length %d is longer than the model's context %d"):format(T, self.cfg.context),
          0)
  end
  return nn.Model.prepare(self, B, T)
end

------------------------------------------------------- forward, backward

-- tokens, targets: i32 [B, T] (targets may be nil: logits only). Returns the
-- mean loss over the B x T positions (or nil) and the logits [B, T, Vp].
-- Resets the activation arena: one forward per micro-step.
function GPT:forward(tokens, targets)
  local B, T = tokens:dim(1), tokens:dim(2)
  self:begin_forward(B, T)
  tokens, targets = self:place_inputs(tokens, targets)
  local logits = self:forward_layers(tokens)
  self.logits, self.targets = logits, targets
  if not targets then return nil, logits end
  local losses = self.ctx.arena:tensor({ B, T })
  ops.cross_entropy_forward(losses, logits, targets, self.cfg.vocab)
  return self:host_sum(losses) / (B * T), logits
end

-- Accumulates d(scale * mean loss)/d(params) into the flat gradient buffer.
-- With gradient accumulation over n micro-steps, scale is 1/n.
function GPT:backward(scale)
  local logits, targets = self.logits, self.targets
  assert(targets, "gpt2: backward needs a forward with targets")
  local rows = logits:dim(1) * logits:dim(2)
  ops.cross_entropy_backward(logits, logits, targets, self.cfg.vocab, (scale or 1) / rows)
  self:backward_layers(logits)
end

--------------------------------------------------------------- sampling

-- Continues `prompt` (a list of token ids) by n tokens, sampling from the
-- softmax of the logits at temperature `temperature` (default 1) over the
-- real vocabulary. The window slides once the context is full.
function GPT:generate(prompt, n, seed, temperature)
  local cfg, r = self.cfg, rng.new(seed or 0, 3)
  -- Arena sizes grow with B x T only, so one sequence of up to B x T tokens fits.
  local window = math.min(cfg.context, self.prepared or cfg.context)
  local buf = lz.tensor({ 1, window }, "i32", "workspace")
  local ids = ffi.cast("int32_t *", buf.data)
  local out = {}
  for i = 1, #prompt do out[i] = prompt[i] end
  local inv_t = 1 / (temperature or 1)
  for _ = 1, n do
    local T = math.min(#out, window)
    for i = 0, T - 1 do ids[i] = out[#out - T + 1 + i] end
    local tokens = buf:view(0, { 1, T })
    local _, logits = self:forward(tokens, nil)
    local last = logits:view((T - 1) * cfg.padded_vocab, { cfg.padded_vocab })
    local copy = last:device_name() ~= "cpu" and last:to("cpu")
    local row = ffi.cast("float *", (copy or last).data)
    local max = -math.huge
    for j = 0, cfg.vocab - 1 do if row[j] > max then max = row[j] end end
    local sum = 0
    for j = 0, cfg.vocab - 1 do sum = sum + math.exp((row[j] - max) * inv_t) end
    local u, pick = r:uniform() * sum, cfg.vocab - 1
    for j = 0, cfg.vocab - 1 do
      u = u - math.exp((row[j] - max) * inv_t)
      if u <= 0 then pick = j; break end
    end
    out[#out + 1] = pick
    if copy then copy:free() end
  end
  buf:free()
  return out
end

return M
