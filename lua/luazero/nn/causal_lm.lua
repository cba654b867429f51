-- nn/causal_lm.lua — a causal language model: token (and position)
-- embedding, pre-norm blocks, a final norm, an LM head (tied to the token
-- table or a Linear of its own), the cross-entropy loss over the real
-- vocabulary, and sampling. A family (models/gpt2.lua, models/llama.lua)
-- fills it in with a description:
--
--   names       Hugging Face's module names: body (the module holding the
--               embedding, blocks and norm), embedding (false: its tables
--               sit in the body's namespace), blocks, norm, head, and
--               block = { attn_norm, attn, mlp_norm, mlp } (nn/block.lua), and
--               attn_post_norm, mlp_post_norm where a block norms its branches'
--               outputs too (each a desc.norm)
--   shared(cfg)         what every block shares (each with a free method), or nil
--   embedding(cfg)      the embedding; its token_key names the token table
--   norm(cfg)           the norm before each branch and after the blocks
--   attention(cfg, shared, i), mlp(cfg, i)   the branches of block i (1-based):
--               a family whose layers differ (a window on some) reads i
--   head(cfg)           an untied LM head (a Linear), or nil: tied to the token table
--   final_softcap(cfg)  the cap c of soft-capped logits, c tanh(logits / c), in
--               the loss and in generation, or nil: none (optional)
--   lora_targets        where LoRA adapters may go (models/lora.lua)
--   cache_refill_at(cfg)  a length at which generation recomputes a row's
--               cached keys and values in full (lua/luazero/generate.lua), or nil
--   router_aux(cfg)  the coefficient of the MoE routers' load-balancing loss
--               (nn/moe.lua) added to the loss, or nil: none (optional)
--
-- cfg: the family's checked config (n_layer, n_embd, context, vocab,
-- padded_vocab: the token rows, up to a multiple of 64; the real ones first).
local ffi = require("ffi")
local lz = require("luazero")
local Module = require("luazero.nn.module")
local Model = require("luazero.nn.model")
local Block = require("luazero.nn.block")
local Sequential = require("luazero.nn.sequential")
local TiedHead = require("luazero.nn.tied_head")
local LoRA = require("luazero.nn.lora")
local MoE = require("luazero.nn.moe")
local rng = require("luazero.rng")

local ops = lz.ops
local CausalLM = Model:extend("CausalLM")
-- Its backward starts from the loss: a forward without targets (the logits
-- only) has none (engine:backward refuses it first).
CausalLM.backward_needs_targets = true

-- The full name of a module's parameter `key`, the module at `path`.
local function param_name(m, key, path)
  for _, spec in ipairs(m.params) do
    if spec.key == key then return path == "" and spec.name or (path .. "." .. spec.name) end
  end
  error("causal_lm: the embedding has no parameter " .. tostring(key), 0)
end

-- A model of class `cls` (a CausalLM:extend of the family's) from `desc`.
function CausalLM.new(cls, desc, cfg)
  local self = setmetatable({}, cls):init()
  self.cfg, self.lora_targets = cfg, desc.lora_targets
  self.final_softcap = desc.final_softcap and desc.final_softcap(cfg)
  self.cache_refill_at = desc.cache_refill_at and desc.cache_refill_at(cfg)
  local names = desc.names
  self.shared = desc.shared and desc.shared(cfg) or {}
  local body = self:add(names.body, setmetatable({}, Module):init())
  local embedding = body:add(names.embedding, desc.embedding(cfg))
  body.embedding, self.embedding = embedding, embedding
  local blocks, bn = {}, names.block
  for i = 1, cfg.n_layer do
    blocks[i] = Block.new({ attn_norm = { bn.attn_norm, desc.norm(cfg) },
                            attn = { bn.attn, desc.attention(cfg, self.shared, i) },
                            attn_post_norm = bn.attn_post_norm and
                                             { bn.attn_post_norm, desc.norm(cfg) },
                            mlp_norm = { bn.mlp_norm, desc.norm(cfg) },
                            mlp = { bn.mlp, desc.mlp(cfg, i) },
                            mlp_post_norm = bn.mlp_post_norm and
                                            { bn.mlp_post_norm, desc.norm(cfg) } })
  end
  body:add(names.blocks, Sequential.new(blocks))
  local norm = body:add(names.norm, desc.norm(cfg))
  local head = desc.head and desc.head(cfg)
  self.untied_head = head
  if not head then
    local key = embedding.token_key
    local path = names.embedding and (names.body .. "." .. names.embedding) or names.body
    head = TiedHead.new(embedding, key, param_name(embedding, key, path), cfg.padded_vocab)
  end
  self:add(names.head, head)
  norm.feeds = head -- the final norm's output goes to the head only
  self.layers = { stem = { embedding }, blocks = blocks, top = { norm }, output = head }
  self.param_table, self.n_params = self:parameter_table()
  self:set_context({})
  -- The MoE blocks, whose routers' load-balancing loss pools over all of them.
  self.routers = {}
  self:walk(function(m) if m.is_router_block then self.routers[#self.routers + 1] = m end end)
  self.router_aux_coef = #self.routers > 0 and desc.router_aux and desc.router_aux(cfg) or nil
  return self
end

-- Real parameters (the padded token rows excluded), as papers and Hugging
-- Face count them.
function CausalLM:count_params()
  local cfg = self.cfg
  local pad = (cfg.padded_vocab - cfg.vocab) * cfg.n_embd
  return self.n_params - pad * (self.untied_head and 2 or 1)
end

-- The parameters a token runs through (count_params but, in each MoE block,
-- only top_k of its experts): what the FLOPs of a step count.
function CausalLM:count_active_params()
  local n = self:count_params()
  for _, b in ipairs(self.routers) do n = n - b:idle_params() end
  return n
end

-- Deterministic for a seed: one generator walks the table in canonical
-- order, each parameter as its init spec says (the family's: GPT-2's
-- N(0, 0.02) with residual projections scaled, Llama's N(0,
-- initializer_range), norms 1). Padding rows of the token table (and of an
-- untied head) are never looked up nor scored: zero keeps them inert
-- (weight decay leaves zeros at zero).
function CausalLM:init_weights(seed)
  self:draw_params(seed)
  local cfg = self.cfg
  local pad = cfg.padded_vocab - cfg.vocab
  if pad > 0 then
    local n = pad * cfg.n_embd
    self.embedding.p[self.embedding.token_key]:view(cfg.vocab * cfg.n_embd, { n }):fill(0)
    if self.untied_head then
      self.untied_head.p.weight:view(cfg.vocab * cfg.n_embd, { n }):fill(0)
    end
  end
  return self
end

-- The padding rows draw_stream zeroes (the same as init_weights): past the
-- real vocabulary in the token table and an untied head.
function CausalLM:zero_from(e)
  local cfg = self.cfg
  if cfg.padded_vocab == cfg.vocab then return nil end
  if (e.module == self.embedding and e.key == self.embedding.token_key) or
     (self.untied_head and e.module == self.untied_head and e.key == "weight") then
    return cfg.vocab * cfg.n_embd
  end
end

function CausalLM:free()
  Model.free(self)
  if self.kept_logits then self.kept_logits:free(); self.kept_logits = nil end
  LoRA.free_workspaces(self)
  for _, s in pairs(self.shared) do s:free() end
end

------------------------------------------------------------ activations

-- The per-position losses of forward.
function CausalLM:own_memory(B, T)
  return { activations = lz.arena_bytes(B * T) }
end

function CausalLM:prepare(B, T)
  if T > self.cfg.context then
    error(("sequence length %d is longer than the model's context %d"):format(T, self.cfg.context),
          0)
  end
  return Model.prepare(self, B, T)
end

------------------------------------------------------- forward, backward

-- The positions that count in the loss: targets >= 0 (a negative target,
-- Hugging Face's -100, marks a position to skip: a prompt, padding).
local function count_targets(targets)
  local host = targets:device_name() ~= "cpu" and targets:to("cpu")
  local t = host or targets
  local p, n = ffi.cast("const int32_t *", t.data), 0
  for i = 0, t:numel() - 1 do
    if p[i] >= 0 then n = n + 1 end
  end
  if host then host:free() end
  return n
end

-- tokens, targets: i32 [B, T] (targets may be nil: logits only). Returns the
-- mean loss over the positions whose target is >= 0 (Hugging Face's
-- CrossEntropyLoss(ignore_index=-100); 0 when there is none), or nil, and the
-- logits [B, T, Vp]. extra (nil for plain streams): packed documents, pos and
-- seg i32 [B, T]: the position of each token within its document (learned
-- positions and rotary embeddings read it) and its document id (attention
-- stays within a document). Resets the activation arena: one forward per
-- micro-step.
function CausalLM:forward(tokens, targets, extra)
  local B, T = tokens:dim(1), tokens:dim(2)
  self:begin_forward(B, T)
  local count = targets and count_targets(targets)
  tokens, targets, extra = self:place_inputs(tokens, targets, extra)
  -- What the embedding and attention layers read, in forward and in the
  -- replays of activation checkpointing; valid until the next forward.
  self.ctx.extra = extra
  local logits = self:capped(self:forward_layers(tokens))
  self.logits, self.targets, self.target_count = logits, targets, count
  if not targets then return nil, logits end
  local losses = self.ctx.arena:tensor({ B, T })
  ops.cross_entropy_forward(losses, logits, targets, self.cfg.vocab)
  local loss = count == 0 and 0 or self:host_sum(losses) / count
  return loss + self:router_loss(), logits
end

-- The routers' load-balancing loss times its coefficient (0 without), as
-- transformers adds it to the language-model loss; kept for backward and
-- for the metrics.
function CausalLM:router_loss()
  local coef = self.router_aux_coef
  if not coef then return 0 end
  local aux, grad = MoE.aux_loss(self.routers)
  self.aux = { loss = aux, grad = grad }
  if self.training then
    self.aux_sum, self.aux_n = (self.aux_sum or 0) + aux, (self.aux_n or 0) + 1
  end
  return coef * aux
end

-- What the MoE blocks did since the last call, for the metrics log:
-- aux_loss (the mean load-balancing loss of the training forwards, without
-- its coefficient) and expert_tokens (per MoE block, the token rows each
-- expert got); nil for a model without MoE blocks.
function CausalLM:router_metrics()
  if #self.routers == 0 then return nil end
  local out = { expert_tokens = MoE.take_tallies(self.routers) }
  if self.aux_n and self.aux_n > 0 then out.aux_loss = self.aux_sum / self.aux_n end
  self.aux_sum, self.aux_n = nil, nil
  return out
end

-- The generators the MoE blocks draw from in training (Mixtral's router
-- jitter), by block path, where they stand: a checkpoint keeps them so a
-- resumed run draws what the uninterrupted run would. nil when none draws.
function CausalLM:generator_states()
  local out
  for _, b in ipairs(self.routers) do
    local s = b:generator_state()
    if s then
      out = out or {}
      out[b.path] = s
    end
  end
  return out
end

-- Back from generator_states(): each block's generator where the saved run
-- left it; a block the checkpoint names no state for starts from its seed.
function CausalLM:set_generator_states(states)
  for _, b in ipairs(self.routers) do
    if states[b.path] then b:set_generator_state(states[b.path]) end
  end
end

-- The head's logits soft-capped in place where the family caps them:
-- backward's cross-entropy carries its gradient through the cap.
function CausalLM:capped(logits)
  if self.final_softcap then ops.softcap_forward(logits, logits, self.final_softcap) end
  return logits
end

-- Accumulates d(scale * mean loss)/d(params) into the flat gradient buffer.
-- With gradient accumulation over n micro-steps, scale is 1/n. The mean is
-- over the micro-batch's counted targets: a micro-batch with none adds 0.
-- extra_term(dlogits, logits, dloss), when given, adds a script's own loss
-- term's gradient (times dloss, the cross-entropy's per-position factor);
-- it sees a copy of the logits, since their gradient overwrites them.
function CausalLM:backward(scale, extra_term)
  local logits, targets = self.logits, self.targets
  if not targets then
    error("model: backward needs a forward with targets: model:forward(x) without them " ..
          "computes the logits only; call model:forward(x, y) first", 2)
  end
  local count = self.target_count
  local dloss = count > 0 and (scale or 1) / count or 0
  -- Under bf16 working parameters the head's backward GEMM reads its
  -- gradient in bf16 (the cast matmul_operands makes): cross-entropy writes
  -- it so directly, the same bits, rather than in f32 to be converted.
  local ctx, dlogits = self.ctx, logits
  if ctx.cast_dtype == "bf16" and ctx.cast_arena then
    dlogits = ctx.cast_arena:tensor(logits:sizes(), "bf16")
  end
  local kept
  if extra_term then
    if self.final_softcap then
      error("backward: a loss term of the script's own on a model whose logits are " ..
            "soft-capped (final_logit_softcapping) is not supported; drop the term or the cap", 0)
    end
    if self.kept_logits and self.kept_logits:numel() < logits:numel() then
      self.kept_logits:free(); self.kept_logits = nil
    end
    self.kept_logits = self.kept_logits or lz.tensor(logits:sizes(), "f32", "workspace",
                                                     logits:device_name())
    kept = self.kept_logits:view(0, logits:sizes()):copy(logits)
  end
  if self.final_softcap then
    ops.cross_entropy_softcap_backward(dlogits, logits, targets, self.cfg.vocab, dloss,
                                       self.final_softcap)
  else
    ops.cross_entropy_backward(dlogits, logits, targets, self.cfg.vocab, dloss)
  end
  if kept then extra_term(dlogits, kept, dloss) end
  ctx.router_aux = self.router_aux_coef and
                   { grad = self.aux.grad, scale = (scale or 1) * self.router_aux_coef } or nil
  self:backward_layers(dlogits)
end

--------------------------------------------------------- cached decoding

-- The embedding of T new positions of each row of `cache`: a learned
-- position table (GPT-2's wpe) is read from row b's first new position on.
function CausalLM:embed_cached(tokens, cache)
  local emb = self.embedding
  if not emb.p.wpe then return self:run_forward(emb, tokens) end
  local B, T, C = tokens:dim(1), tokens:dim(2), emb.n_embd
  local y = self.ctx.arena:tensor({ B, T, C })
  local wte, wpe = emb:table_operand(emb.p.wte), emb:table_operand(emb.p.wpe)
  for b = 1, B do
    local at = cache.at[b]
    ops.embedding_forward(y:view((b - 1) * T * C, { 1, T, C }),
                          tokens:view((b - 1) * T, { 1, T }), wte,
                          wpe:view(at * C, { emb.positions - at, C }))
  end
  return y
end

-- Generation: tokens i32 [B, T] (host) are the next T positions of each of
-- the B rows of `cache` (luazero.generate's Cache, whose row b already holds
-- cache.at[b] positions); their keys and values join it, and the cache
-- moves on by T. Returns the logits [B, T, Vp], or with `last` those of each
-- row's last position only, [B, 1, Vp] (a prompt's: the final norm and the
-- head run on one position instead of T), valid until the next forward.
-- The model's own modules: norms, MLPs and the head are the same calls as
-- forward; only attention reads the cache. Nothing runs backward, so no
-- block's activations outlive the next block: each block's output is copied
-- to one of two buffers and the arenas are rewound, so a prompt of T tokens
-- touches one block's activations, not every block's.
function CausalLM:forward_cached(tokens, cache, last)
  local B, T = tokens:dim(1), tokens:dim(2)
  for b = 1, B do
    if cache.at[b] + T > self.cfg.context then
      error(("generate: row %d would reach position %d, past the model's context %d; " ..
             "shorten the prompt or --max-new-tokens")
            :format(b, cache.at[b] + T, self.cfg.context), 0)
    end
  end
  self:begin_forward(B, T)
  local ctx = self.ctx
  local x = self:embed_cached(tokens, cache)
  local turns = { ctx.arena:tensor(x:sizes()), ctx.arena:tensor(x:sizes()) }
  local mark, cast_mark = ctx.arena:used(), ctx.cast_arena and ctx.cast_arena:used()
  for i, blk in ipairs(self.layers.blocks) do
    local y = blk:forward_cached(x, cache.layers[i])
    x = turns[i % 2 + 1]:copy(y)
    ctx.arena:rewind(mark)
    if cast_mark then ctx.cast_arena:rewind(cast_mark) end
  end
  if last and T > 1 then
    local C = x:dim(3)
    local ends = ctx.arena:tensor({ B, 1, C })
    for b = 1, B do
      ends:view((b - 1) * C, { 1, 1, C }):copy(x:view(((b - 1) * T + T - 1) * C, { 1, 1, C }))
    end
    x = ends
  end
  for _, m in ipairs(self.layers.top) do x = self:run_forward(m, x) end
  local logits = self:capped(self:run_forward(self.layers.output, x))
  cache:advance(T)
  return logits
end

--------------------------------------------------------------- sampling

-- Continues `prompt` (a list of token ids) by n tokens, sampling from the
-- softmax of the logits at temperature `temperature` (default 1) over the
-- real vocabulary. The window slides once the context is full.
function CausalLM:generate(prompt, n, seed, temperature)
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

return CausalLM
