-- models/gpt2.lua — the GPT-2 family: pre-LayerNorm blocks, learned position
-- embeddings, GELU (tanh), the token embedding tied to the LM head.
--
--   local gpt2 = require("models.gpt2")
--   local cfg = gpt2.config("gpt2-nano", { n_layer = 2 })
--   local model = gpt2.new(cfg)       -- declares the parameter table
--   model:allocate()                  -- flat fp32 params and grads, views bound
--   model:init_weights(seed)          -- N(0, 0.02), residual projections scaled
--   model:checkpoint_activations(opts) -- optional: keep each block's input only
--   model:prepare(B, T)               -- activation arena sized for B x T
--   local loss = model:forward(tokens, targets); model:backward(scale)
--
-- Parameter names are Hugging Face's (transformer.h.0.attn.c_attn.weight,
-- ...) and the parameter table lists them in that canonical order. Linear
-- weights are [out, in] (nn.Linear); Hugging Face's Conv1D stores [in, out].
local ffi = require("ffi")
local lz = require("luazero")
local nn = require("luazero.nn")
local rng = require("luazero.rng")
local checkpoint = require("luazero.nn.checkpoint")
local clock = require("luazero.clock")

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
  cfg.padded_vocab = padded(cfg.vocab)
  return cfg
end

---------------------------------------------------------- tied LM head

-- logits = x @ wte^T: borrows the embedding's table, declares no parameter of
-- its own (Hugging Face's lm_head.weight is transformer.wte.weight). A ZeRO-3
-- engine reads `tied` to gather that table before this module runs.
local LMHead = nn.Module:extend("LMHead")

function LMHead.new(embedding, padded_vocab)
  local self = setmetatable({}, LMHead):init()
  self.embedding, self.padded_vocab = embedding, padded_vocab
  self.tied = { weight = "transformer.wte.weight" }
  return self
end

function LMHead:forward(x)
  local logits = self:activation({ x:dim(1), x:dim(2), self.padded_vocab })
  local xw, w = self:matmul_operands(x, self.embedding.p.wte)
  ops.linear_forward(logits, xw, w, nil)
  self.input = xw
  return logits
end

function LMHead:backward(dlogits)
  local x = self.input
  local dx = self:scratch({ x:dim(1), x:dim(2), x:dim(3) })
  local dw, w = self:matmul_operands(dlogits, self.embedding.p.wte)
  ops.linear_backward(dx, self.embedding.g.wte, nil, dw, x, w)
  return dx
end

-------------------------------------------------------------------- model

local GPT = nn.Module:extend("GPT")
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
  self:add("lm_head", LMHead.new(transformer.embedding, cfg.padded_vocab))
  self.param_table, self.n_params = self:parameter_table()
  self:set_context({})
  return self
end

-- Real parameters (the padded embedding rows excluded), as papers count them.
function GPT:count_params()
  return self.n_params - (self.cfg.padded_vocab - self.cfg.vocab) * self.cfg.n_embd
end

-- One flat fp32 buffer for the parameters and one for their gradients; every
-- parameter is a view at its offset in the parameter table.
function GPT:allocate()
  self.params_flat = lz.tensor({ self.n_params }, "f32", "params")
  self.grads_flat = lz.tensor({ self.n_params }, "f32", "grads")
  self:bind(self.param_table, self.params_flat, self.grads_flat)
  return self
end

-- Deterministic for a seed: one generator walks the table in canonical order.
function GPT:init_weights(seed)
  local r = rng.new(seed, 1)
  for _, e in ipairs(self.param_table) do
    local t = e.module.p[e.key]
    local kind = e.init.kind
    if kind == "normal" then
      r:fill_normal(ffi.cast("float *", t.data), e.numel, e.init.std)
    elseif kind == "ones" then
      t:fill(1)
    else
      t:fill(0)
    end
  end
  -- Padding rows of the token table are never looked up nor scored: zero
  -- keeps them inert (weight decay leaves zeros at zero).
  local cfg = self.cfg
  local pad = cfg.padded_vocab - cfg.vocab
  if pad > 0 then
    self.transformer.embedding.p.wte:view(cfg.vocab * cfg.n_embd, { pad * cfg.n_embd }):fill(0)
  end
  return self
end

function GPT:zero_grad() self.grads_flat:zero() end

------------------------------------------------------------ activations

local ALIGN = 64

-- Forward keeps every listed tensor until backward; backward needs at most
-- one block's gradients at a time (two scratch arenas take turns).
local function bytes(counts)
  local n = 0
  for _, c in ipairs(counts) do n = n + math.ceil(c * 4 / ALIGN) * ALIGN end
  return n
end

local function arena_sizes(cfg, B, T)
  local C, NH, Vp = cfg.n_embd, cfg.n_head, cfg.padded_vocab
  local BT, BTC = B * T, B * T * C
  local block = bytes({
    BTC, BT, BT,        -- ln_1 out, mean, rstd
    3 * BTC, BTC, B * NH * T, BTC, -- qkv, attention out, lse, c_proj out (+ residual)
    BTC, BT, BT,        -- ln_2
    4 * BTC, 4 * BTC, BTC, -- c_fc out, gelu out, c_proj out (+ residual)
  })
  local forward = bytes({ BTC }) + cfg.n_layer * block +
                  bytes({ BTC, BT, BT, BT * Vp, BT }) -- ln_f, logits, losses
  local scratch = bytes({ 4 * BTC, BTC, BTC, BTC, 3 * BTC, BTC, BTC }) -- one block
  return forward, scratch, block
end
M.arena_sizes = arena_sizes

-- With activation checkpointing: the model's arena keeps the embedding
-- output, the last block's output (ln_f's input), ln_f, the losses and the
-- input gradients of the LM head and ln_f; one shared region holds a
-- block's activations (forward, then its replay) and the two backward
-- scratch arenas, and between the last block's forward and the LM head's
-- backward the logits, which are dead before the first replay.
local function checkpoint_sizes(cfg, B, T)
  local _, scratch, block = arena_sizes(cfg, B, T)
  local C, Vp = cfg.n_embd, cfg.padded_vocab
  local BT, BTC = B * T, B * T * C
  local main = bytes({ BTC, BTC, BTC, BT, BT, BT, BTC, BTC })
  local logits = bytes({ BT * Vp })
  return { main = main, block = block, scratch = scratch, logits = logits,
           shared = math.max(logits, block + 2 * scratch), kept = BTC }
end
M.checkpoint_sizes = checkpoint_sizes

-- Bytes of the cast arena the ZeRO engine gives a bf16/fp16 model for
-- micro-batches of B x T: bf16 copies of every matmul input (kept for
-- backward) and of the gradients flowing into matmuls, f32 copies of
-- LayerNorm parameters, biases and the embedding tables (dtype "f16": of
-- every matmul weight too). One forward and one backward.
-- With activation checkpointing the blocks' casts go to an arena of their own
-- sized for one block (block_cast_size), reset for each block.
local function cast_sizes(cfg, B, T, dtype)
  local C, Vp, BT = cfg.n_embd, cfg.padded_vocab, B * T
  local n, count = 0, 0
  local function add(elems, bytes) n = n + math.ceil(elems * bytes / ALIGN) * ALIGN; count = count + 1 end
  for _, k in ipairs({ 1, 1, 1, 4 }) do add(BT * C * k, 2) end          -- matmul inputs
  for _, k in ipairs({ 3, 1, 4, 1 }) do add(BT * C * k, 2) end          -- matmul dy
  for _, k in ipairs({ 3, 1, 4, 1 }) do add(C * k, 4); add(C * k, 4) end -- biases
  for _ = 1, 6 do add(C, 4) end                                          -- LayerNorms
  if dtype ~= "bf16" then                                                -- f16 weights
    for _, k in ipairs({ 3, 1, 4, 4 }) do add(C * C * k, 4); add(C * C * k, 4) end
  end
  local block = n + count * ALIGN
  n, count = 0, 0
  add(BT * C, 2); add(BT * Vp, 2)                                -- LM head x, dlogits
  add(Vp * C, 4); add(cfg.context * C, 4); add(Vp * C, 4); add(Vp * C, 4) -- tables (f32)
  for _ = 1, 4 do add(C, 4) end                                  -- ln_f
  return block, n + count * ALIGN
end

function GPT:cast_arena_size(B, T, dtype)
  local block, rest = cast_sizes(self.cfg, B, T, dtype)
  if self.checkpointing then return rest end
  return self.cfg.n_layer * block + rest
end

function GPT:block_cast_size(B, T, dtype) return (cast_sizes(self.cfg, B, T, dtype)) end

-- Activation checkpointing: opts is the activation_checkpointing settings
-- (luazero.config's normalised block), true for DeepSpeed's defaults, or
-- false to turn it off. Each block then keeps only its input during forward
-- and replays its forward just before its backward (bitwise the same
-- activations, so bitwise the same gradients). Re-sizes prepared arenas.
function GPT:checkpoint_activations(opts)
  if opts == true then opts = checkpoint.defaults end
  if opts then checkpoint.check(opts, self.cfg.n_layer) end
  self.checkpointing = opts or nil
  local shape = self.prepared_shape
  self:release_arenas()
  if shape then self:prepare(shape[1], shape[2]) end
  return self
end

-- Sizes the arenas for micro-batches of B sequences of T tokens (and anything
-- smaller). Reallocates only when B x T grows.
function GPT:prepare(B, T)
  local cfg = self.cfg
  if T > cfg.context then
    error(("sequence length %d is longer than the model's context %d"):format(T, cfg.context), 0)
  end
  if self.prepared and B * T <= self.prepared then return self end
  self:release_arenas()
  local ctx = self.ctx
  if self.checkpointing then
    self:prepare_checkpointing(B, T)
  else
    local fwd, scr = arena_sizes(cfg, B, T)
    ctx.arena = lz.arena(fwd, "activations")
    ctx.scratches = { lz.arena(scr, "activations"), lz.arena(scr, "activations") }
  end
  self.prepared, self.prepared_shape = B * T, { B, T }
  return self
end

-- The arenas of checkpoint_sizes: the model's arena, the kept inputs
-- (nn/checkpoint.lua), and the shared region carved into the block arena,
-- the two scratch arenas and (over the same bytes) the head's arena.
function GPT:prepare_checkpointing(B, T)
  local cfg, ctx = self.cfg, self.ctx
  local z = checkpoint_sizes(cfg, B, T)
  local L = cfg.n_layer
  local kept_in_main = not (self.checkpointing.cpu_checkpointing or
                            self.checkpointing.contiguous_memory_optimization)
  local main = lz.arena(z.main + (kept_in_main and L * bytes({ z.kept }) or 0), "activations")
  local store = checkpoint.store(self.checkpointing, L, z.kept, main)
  local shared = lz.tensor({ z.shared / 4 }, "f32", "activations")
  local ck = {
    main = main, store = store, shared = shared,
    block = lz.arena_over(shared, 0, z.block),
    head = lz.arena_over(shared, 0, z.logits),
    block_cast_bytes = self:block_cast_size(B, T, ctx.cast_dtype),
  }
  ctx.scratches = { lz.arena_over(shared, z.block, z.scratch),
                    lz.arena_over(shared, z.block + z.scratch, z.scratch) }
  ctx.arena, self.ckpt = main, ck
  ctx.checkpoint_profile = self.checkpointing.profile and
                           { forward = 0, recompute = 0, backward = 0 } or nil
end

function GPT:release_arenas()
  local ctx, ck = self.ctx, self.ckpt
  if ck then
    ctx.arena = ck.main
    if ctx.cast_arena == ck.block_casts then ctx.cast_arena = ck.casts end
    for _, a in ipairs(ctx.scratches) do a:free() end
    ck.block:free(); ck.head:free(); ck.store:free()
    if ck.block_casts then ck.block_casts:free() end
    ck.shared:free()
    ctx.scratches, self.ckpt = nil, nil
  end
  if ctx.arena then ctx.arena:free() end
  for _, a in ipairs(ctx.scratches or {}) do a:free() end
  ctx.arena, ctx.scratches, ctx.scratch, self.prepared = nil, nil, nil, nil
  self.prepared_shape = nil
end

function GPT:free()
  self:release_arenas()
  if self.params_flat then self.params_flat:free() end
  if self.grads_flat then self.grads_flat:free() end
  self.params_flat, self.grads_flat = nil, nil
end

------------------------------------------------------- forward, backward

-- tokens, targets: i32 [B, T] (targets may be nil: logits only). Returns the
-- mean loss over the B x T positions (or nil) and the logits [B, T, Vp].
-- Resets the activation arena: one forward per micro-step.
function GPT:forward(tokens, targets)
  local ctx, t = self.ctx, self.transformer
  if not ctx.arena then error("gpt2: call model:prepare(B, T) before forward", 2) end
  local B, T = tokens:dim(1), tokens:dim(2)
  if B * T > self.prepared then
    error(("gpt2: a batch of %d x %d tokens does not fit the activation arena, sized for " ..
           "%d tokens: call model:prepare(%d, %d) first"):format(B, T, self.prepared, B, T), 2)
  end
  local ck = self.ckpt
  if ck then self:restore_arenas() end
  ctx.arena:reset()
  if ctx.cast_arena then ctx.cast_arena:reset() end
  local x = self:run_forward(t.embedding, tokens)
  local logits
  if ck then
    ck.store:reset()
    for i, c in ipairs(t.h.children) do x = self:checkpointed_forward(i, c.module, x) end
    x = ctx.arena:tensor(x:sizes()):copy(x) -- ln_f keeps its input
    x = self:run_forward(t.ln_f, x)
    ck.head:reset()
    ctx.arena = ck.head
    logits = self:run_forward(self.lm_head, x)
    ctx.arena = ck.main
  else
    for _, c in ipairs(t.h.children) do x = self:run_forward(c.module, x) end
    x = self:run_forward(t.ln_f, x)
    logits = self:run_forward(self.lm_head, x)
  end
  self.logits, self.targets = logits, targets
  if not targets then return nil, logits end
  local losses = ctx.arena:tensor({ B, T })
  ops.cross_entropy_forward(losses, logits, targets, self.cfg.vocab)
  local p, sum = ffi.cast("float *", losses.data), 0
  for i = 0, B * T - 1 do sum = sum + p[i] end
  return sum / (B * T), logits
end

-------------------------------------------------- activation checkpointing

-- Where a block's activations and casts go while it runs (forward or
-- replay): the block arena and, when the engine casts (bf16/fp16), the
-- block cast arena, both reset for each block.
function GPT:enter_block()
  local ctx, ck = self.ctx, self.ckpt
  ck.block:reset()
  ctx.arena = ck.block
  if ctx.cast_arena then
    if not ck.block_casts then ck.block_casts = lz.arena(ck.block_cast_bytes, "activations") end
    ck.casts = ctx.cast_arena
    ck.block_casts:reset()
    ctx.cast_arena = ck.block_casts
  end
end

function GPT:restore_arenas()
  local ctx, ck = self.ctx, self.ckpt
  ctx.arena = ck.main
  if ck.casts and ctx.cast_arena == ck.block_casts then ctx.cast_arena = ck.casts end
end

-- Block i's forward from a kept copy of its input; its activations are
-- dropped when the next block starts. Returns the output (valid until then).
function GPT:checkpointed_forward(i, block, x)
  local kept = self.ckpt.store:keep(i, x)
  self:enter_block()
  local prof = self.ctx.checkpoint_profile
  local t0 = prof and clock.now()
  local y = self:run_forward(block, kept)
  if prof then prof.forward = prof.forward + (clock.now() - t0) end
  self:restore_arenas()
  return y
end

-- activation_checkpointing.profile: milliseconds spent since the last reset
-- in checkpointed blocks' forwards, their replays and their backwards
-- ({forward, recompute, backward}); nil when profiling is off.
function GPT:checkpoint_profile(reset)
  local prof = self.ctx.checkpoint_profile
  if not prof then return nil end
  local ms = { forward = prof.forward * 1e3, recompute = prof.recompute * 1e3,
               backward = prof.backward * 1e3 }
  if reset then prof.forward, prof.recompute, prof.backward = 0, 0, 0 end
  return ms
end

-- Accumulates d(scale * mean loss)/d(params) into the flat gradient buffer.
-- With gradient accumulation over n micro-steps, scale is 1/n.
function GPT:backward(scale)
  local ctx, t = self.ctx, self.transformer
  local logits, targets = self.logits, self.targets
  assert(targets, "gpt2: backward needs a forward with targets")
  local rows = logits:dim(1) * logits:dim(2)
  ops.cross_entropy_backward(logits, logits, targets, self.cfg.vocab, (scale or 1) / rows)
  local turn = 0
  local function next_scratch()
    turn = turn % 2 + 1
    ctx.scratch = ctx.scratches[turn]
    ctx.scratch:reset()
  end
  local ck = self.ckpt
  local blocks = t.h.children
  if ck then
    -- The logits live in the shared region until the LM head's backward:
    -- its and ln_f's input gradients come from the model's arena.
    ctx.scratch = ck.main
    local d = self:run_backward(self.lm_head, logits)
    d = self:run_backward(t.ln_f, d)
    for i = #blocks, 1, -1 do
      self:enter_block()
      next_scratch()
      d = self:run_checkpointed_backward(blocks[i].module, ck.store:kept(i), d)
      self:restore_arenas()
    end
    self:run_backward(t.embedding, d)
    ctx.scratch = nil
    return
  end
  next_scratch()
  local d = self:run_backward(self.lm_head, logits)
  next_scratch()
  d = self:run_backward(t.ln_f, d)
  for i = #blocks, 1, -1 do
    next_scratch()
    d = self:run_backward(blocks[i].module, d)
  end
  self:run_backward(t.embedding, d)
  ctx.scratch = nil
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
    local row = ffi.cast("float *", logits.data) + (T - 1) * cfg.padded_vocab
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
  end
  buf:free()
  return out
end

return M
