-- generate.lua — text generation with a key/value cache: the cache (one
-- key and one value tensor per attention layer, shared positions per row),
-- the choice of the next token (greedy, or sampled at a temperature within
-- top-k / top-p), and the loop that fills the cache from each prompt and
-- then decodes one position per step for a batch of rows.
--
--   local generate = require("luazero.generate")
--   local outs = generate.run(model, { { 10, 20 }, { 30 } },
--                             { max_new = 50, temperature = 0, eos = { [2] = true } })
--   -- outs[i] = { ids = { new ids }, reason = "eos" | "length" | "stop" | "context" }
-- The model: a CausalLM (nn/causal_lm.lua) whose parameters hold weights
-- (through an engine or model:allocate), on the cpu.
local ffi = require("ffi")
local lz = require("luazero")
local rng = require("luazero.rng")
local clock = require("luazero.clock")

local M = {}

------------------------------------------------------------------ cache

local Cache = {}
Cache.__index = Cache
M.Cache = Cache

-- Room for S positions of B rows, keys and values in `dtype` ("f32", or
-- "bf16" for half the memory; each value rounded once when written). A
-- layer whose attention has a window keeps only that many positions, a
-- ring the kernel writes round (memory O(window), not O(context)).
function Cache.new(model, B, S, dtype)
  local self = setmetatable({ B = B, S = S, at = {}, layers = {}, owned = true }, Cache)
  self.pos = lz.tensor({ B }, "i32", "workspace")
  self.pos_ptr = ffi.cast("int32_t *", self.pos.data)
  for b = 1, B do self.at[b] = 0 end
  for i, blk in ipairs(model.layers.blocks) do
    local a = blk.attn
    local width = a.kv_width or a.n_embd
    local n = (a.window or 0) > 0 and math.min(S, a.window) or S
    self.layers[i] = {
      width = width, S = n, pos = self.pos, at = self.at,
      k = lz.tensor({ B, n, width }, dtype or "f32", "activations"),
      v = lz.tensor({ B, n, width }, dtype or "f32", "activations"),
    }
  end
  return self
end

-- Row b (1-based) alone, as a cache of one row over the same memory: its
-- moves are the row's.
function Cache:row(b)
  local r = setmetatable({ B = 1, S = self.S, at = { self.at[b] }, layers = {}, parent = self,
                           b = b }, Cache)
  r.pos = self.pos:view(b - 1, { 1 })
  r.pos_ptr = ffi.cast("int32_t *", r.pos.data)
  for i, l in ipairs(self.layers) do
    local n = l.S * l.width
    r.layers[i] = { width = l.width, S = l.S, pos = r.pos, at = r.at,
                    k = l.k:view((b - 1) * n, { 1, l.S, l.width }),
                    v = l.v:view((b - 1) * n, { 1, l.S, l.width }) }
  end
  return r
end

-- Every row now holds n more positions.
function Cache:advance(n)
  for b = 1, self.B do
    self.at[b] = self.at[b] + n
    self.pos_ptr[b - 1] = self.at[b]
  end
  if self.parent then self.parent.at[self.b] = self.at[1] end
end

-- Row b now holds its first n positions (the rest is overwritten next).
function Cache:set(b, n)
  self.at[b] = n
  self.pos_ptr[b - 1] = n
end

function Cache:free()
  if not self.owned then return end
  for _, l in ipairs(self.layers) do l.k:free(); l.v:free() end
  self.pos:free()
  self.layers = {}
end

------------------------------------------------------------- sampling

-- The next token from `row` (float * over the real vocabulary, V entries):
-- the first largest logit when temperature is 0; else a draw from the
-- softmax of logits / temperature restricted to the top_k largest (0: all)
-- and then to the smallest set of most likely ones whose probabilities sum
-- to top_p (1: all), as Hugging Face's warpers do, in that order.
function M.pick(row, V, opts, r)
  local temperature = opts.temperature or 0
  if temperature == 0 then
    local best, max = 0, row[0]
    for j = 1, V - 1 do
      if row[j] > max then best, max = j, row[j] end
    end
    return best
  end
  local k, top_p = opts.top_k or 0, opts.top_p or 1
  if (k == 0 or k >= V) and top_p >= 1 then
    -- the whole vocabulary: one pass for the sum, one for the draw, in id order
    local max = row[0]
    for j = 1, V - 1 do if row[j] > max then max = row[j] end end
    local inv, sum = 1 / temperature, 0
    for j = 0, V - 1 do sum = sum + math.exp((row[j] - max) * inv) end
    local u = r:uniform() * sum
    for j = 0, V - 1 do
      u = u - math.exp((row[j] - max) * inv)
      if u <= 0 then return j end
    end
    return V - 1
  end
  local cand = {}
  for j = 0, V - 1 do cand[j + 1] = { id = j, l = row[j] / temperature } end
  table.sort(cand, function(a, b)
    if a.l ~= b.l then return a.l > b.l end
    return a.id < b.id
  end)
  local keep = #cand
  if k > 0 and k < keep then
    -- ties with the k-th value stay, as torch.topk's threshold keeps them
    local kth = cand[k].l
    keep = k
    while keep < #cand and cand[keep + 1].l == kth do keep = keep + 1 end
  end
  local max, sum = cand[1].l, 0
  for i = 1, keep do
    cand[i].p = math.exp(cand[i].l - max)
    sum = sum + cand[i].p
  end
  if top_p < 1 then
    local acc, n = 0, 0
    for i = 1, keep do
      acc = acc + cand[i].p / sum
      n = i
      if acc >= top_p then break end
    end
    keep, sum = n, 0
    for i = 1, keep do sum = sum + cand[i].p end
  end
  local u = r:uniform() * sum
  for i = 1, keep do
    u = u - cand[i].p
    if u <= 0 then return cand[i].id end
  end
  return cand[keep].id
end

------------------------------------------------------------------ loop

-- Host i32 [rows, n] tokens from lists (rows of equal length n).
local function tokens_of(lists, n, first)
  local t = lz.tensor({ #lists, n }, "i32", "workspace")
  local p = ffi.cast("int32_t *", t.data)
  for b, ids in ipairs(lists) do
    for i = 1, n do p[(b - 1) * n + i - 1] = ids[(first or 1) + i - 1] end
  end
  return t
end

-- The logits of position t (0-based) of row b (1-based) of logits [B, T,
-- Vp], on the host.
local function logits_row(logits, b, t)
  local T, Vp = logits:dim(2), logits:dim(3)
  return ffi.cast("float *", logits.data) + ((b - 1) * T + t) * Vp
end

-- A whole sequence `ids` into the empty cache row `row`: the id its last
-- position picks.
local function fill(model, ids, row, opts, r)
  local tokens = tokens_of({ ids }, #ids)
  local logits = model:forward_cached(tokens, row, true)
  tokens:free()
  return M.pick(logits_row(logits, 1, 0), model.cfg.vocab, opts, r)
end

-- Continues each prompt (a list of token ids, at least one) of `prompts`,
-- opts.batch rows at a time (default 8). opts: max_new (default 64),
-- temperature (0: greedy), top_k, top_p, seed (one generator for the whole
-- call, drawn from in row order), eos (a set of ids that end a row; the id
-- is kept), kv_dtype ("f32" or "bf16"), stop(i, ids): true to end row i
-- (its prompt's index) after its new ids so far; stats, a table: filled
-- with prompt_tokens and prompt_s (the prompts' forwards, each giving its
-- first new token), new_tokens and new_s (the decoding steps after them;
-- the tokens their rows kept). Returns one { ids, reason } per prompt:
-- reason "eos", "stop", "length" (max_new reached) or "context" (the
-- model's context is full).
function M.run(model, prompts, opts)
  opts = opts or {}
  local cfg = model.cfg
  local max_new, batch = opts.max_new or 64, opts.batch or 8
  local r = rng.new(opts.seed or 0, 4)
  local eos = opts.eos or {}
  local out = {}
  local stats = opts.stats
  if stats then stats.prompt_tokens, stats.prompt_s, stats.new_tokens, stats.new_s = 0, 0, 0, 0 end
  local was_training = model.training
  model:evaluate()
  for first = 1, #prompts, batch do
    local rows = {}
    for i = first, math.min(#prompts, first + batch - 1) do rows[#rows + 1] = i end
    local B, longest = #rows, 0
    for _, i in ipairs(rows) do
      local n = #prompts[i]
      if n == 0 then error(("generate: prompt %d has no tokens"):format(i), 0) end
      -- (a prompt that fills the context still gives one token: the last
      -- position's logits, as transformers' generate does)
      if n > cfg.context then
        error(("generate: prompt %d has %d tokens; the model's context is %d: shorten it")
              :format(i, n, cfg.context), 0)
      end
      longest = math.max(longest, n)
    end
    local S = math.min(cfg.context, longest + max_new)
    -- A family whose cached keys go stale at a length (model.cache_refill_at:
    -- Phi-3, whose LongRoPE switches frequencies there) has a row that
    -- reaches it forward all its tokens again, as transformers drops its
    -- cache there.
    local refill_at = model.cache_refill_at
    if refill_at and refill_at >= S then refill_at = nil end
    local need = math.max(longest, B, refill_at and refill_at + 1 or 0)
    if need <= cfg.context then model:prepare(1, need) else model:prepare(B, 1) end
    local cache = Cache.new(model, B, S, opts.kv_dtype)
    local next_ids, done = {}, {}
    -- Each prompt fills its row of the cache; its last logits give the first new token.
    for b, i in ipairs(rows) do
      out[i] = { ids = {} }
      local t0 = stats and clock.now()
      next_ids[b] = fill(model, prompts[i], cache:row(b), opts, r)
      if stats then
        stats.prompt_tokens = stats.prompt_tokens + #prompts[i]
        stats.prompt_s = stats.prompt_s + (clock.now() - t0)
      end
    end
    local function take(b, id)
      local i = rows[b]
      local o = out[i]
      o.ids[#o.ids + 1] = id
      if eos[id] then o.reason = "eos"
      elseif opts.stop and opts.stop(i, o.ids) then o.reason = "stop"
      elseif #o.ids >= max_new then o.reason = "length"
      elseif cache.at[b] >= cfg.context then o.reason = "context" end
      done[b] = o.reason ~= nil
    end
    for b = 1, B do take(b, next_ids[b]) end
    while true do
      local live = false
      for b = 1, B do live = live or not done[b] end
      if not live then break end
      -- Finished rows ride along, rewriting their last position each step;
      -- what they compute is dropped.
      local t0 = stats and clock.now()
      local lists, refilled = {}, {}
      for b = 1, B do
        lists[b] = { next_ids[b] }
        if not done[b] and cache.at[b] == refill_at then
          -- the row afresh, up to and with its new id; it rides along
          -- below, rewriting its last position with the token there
          local i, all = rows[b], {}
          for _, id in ipairs(prompts[i]) do all[#all + 1] = id end
          for _, id in ipairs(out[i].ids) do all[#all + 1] = id end
          cache:set(b, 0)
          next_ids[b] = fill(model, all, cache:row(b), opts, r)
          refilled[b], lists[b] = true, { all[#all] }
        end
        if done[b] or refilled[b] then cache:set(b, cache.at[b] - 1) end
      end
      local tokens = tokens_of(lists, 1)
      local logits = model:forward_cached(tokens, cache)
      tokens:free()
      for b = 1, B do
        if refilled[b] then
          take(b, next_ids[b])
        elseif not done[b] then
          next_ids[b] = M.pick(logits_row(logits, b, 0), cfg.vocab, opts, r)
          take(b, next_ids[b])
          if stats then stats.new_tokens = stats.new_tokens + 1 end
        end
      end
      if stats then stats.new_s = stats.new_s + (clock.now() - t0) end
    end
    cache:free()
  end
  if was_training then model:train() end
  return out
end

return M
