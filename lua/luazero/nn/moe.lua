-- nn/moe.lua — a sparse mixture-of-experts block as Hugging Face defines
-- it (MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock, Qwen3MoeSparseMoeBlock,
-- OlmoeSparseMoeBlock): a router Linear (gate, E logits a token), softmax in
-- fp32, the top k experts of each token (ties to the lower index), their
-- probabilities renormalised to sum 1 where norm_topk_prob says so, the
-- experts (nn/moe_experts.lua) weighted by them and summed; Qwen2-MoE adds
-- a shared expert every token goes through, scaled by sigmoid of its own
-- one-output gate. Mixtral's router_jitter_noise multiplies the input by
-- uniform(1 - j, 1 + j) noise in training, before router and experts.
--
--   MoE.new(n_embd, { n_experts =, top_k =, n_hidden =, std =, norm_topk_prob =,
--                     expert_names = { "w1", "w3", "w2" }, shared = { n_hidden = } or nil,
--                     jitter = 0, layer = 1, gather = "block" })
-- layer: the block's layer index; with the run's seed (ctx.seed, which the
-- engine sets) it keys the jitter's generator.
-- gather: how ZeRO-3 gathers the experts, "block" (one unit) or "expert"
-- (one at a time, every one each pass; nn/moe_experts.lua).
--
-- The router's load-balancing loss (transformers' load_balancing_loss_func)
-- pools the blocks of a model: MoE.aux_loss(blocks) after the forward, and
-- ctx.router_aux = { grad =, scale = } for the blocks' backward.
local ffi = require("ffi")
local bit = require("bit")
local lz = require("luazero")
local Module = require("luazero.nn.module")
local Linear = require("luazero.nn.linear")
local SwiGLUMLP = require("luazero.nn.swiglu_mlp")
local Experts = require("luazero.nn.moe_experts")
local rng = require("luazero.rng")
local stream = require("luazero.data.stream")

local ops = lz.ops

local MoE = Module:extend("SparseMoE")

function MoE.new(n_embd, opts)
  local self = setmetatable({}, MoE):init()
  local E, k = opts.n_experts, opts.top_k
  if not (E >= 1 and k >= 1 and k <= E) then
    error(("moe: num_experts_per_tok %s must be between 1 and the number of experts %s")
          :format(tostring(k), tostring(E)), 0)
  end
  self.n_embd, self.n_experts, self.top_k = n_embd, E, k
  self.norm_topk_prob = opts.norm_topk_prob == true
  self.jitter, self.layer = opts.jitter or 0, opts.layer or 1
  self.is_router_block = true
  self:add("gate", Linear.new(n_embd, E, { bias = false, std = opts.std }))
  self:add("experts", Experts.new(n_embd, opts.n_hidden, E, opts.std,
                                  opts.expert_names or { "gate_proj", "up_proj", "down_proj" },
                                  opts.gather))
  self.gather = self.experts.gather
  self.experts.top_k = k
  if opts.shared then
    self:add("shared_expert", SwiGLUMLP.new(n_embd, opts.shared.n_hidden, opts.std))
    self:add("shared_expert_gate", Linear.new(n_embd, 1, { bias = false, std = opts.std }))
  end
  return self
end

-- A small tensor's elements where the host reads them: a pointer of
-- ctype, and the host copy to free after (nil on the cpu).
local function on_host(t, ctype)
  if t:device_name() == "cpu" then return ffi.cast(ctype, t.data), nil end
  local h = t:to("cpu")
  return ffi.cast(ctype, h.data), h
end

-- Each token's choice from its router logits [N, E] (the moe_route_forward
-- op: softmax in fp32, the top k, ties to the lower expert, renormalised
-- where norm_topk_prob says): probs [N, E], idx [N, k], weights [N, k].
function MoE:choose(logits, N)
  local E, k = self.n_experts, self.top_k
  local c = { n = N, weights = self:activation({ N, k }), idx = self:activation({ N, k }, "i32"),
              probs = self:activation({ N, E }) }
  ops.moe_route_forward(c.weights, c.idx, c.probs, logits, self.norm_topk_prob and 1 or 0)
  return c
end

-- What the load-balancing loss counts of a choice: every token's, or, where
-- the batch has a mask (ctx.extra.mask, 0 on padding), the unmasked tokens'
-- (transformers' attention_mask): their top-k assignments per expert
-- (c.aux_count), their probabilities summed per expert (c.probsum), their
-- number (c.aux_n) and, with a mask, which tokens count (c.counted).
function MoE:balance(c, p)
  local E, k, N = self.n_experts, self.top_k, c.n
  local extra = self.ctx.extra
  local mask = extra and extra.mask and ffi.cast("int32_t *", extra.mask.data)
  c.probsum, c.aux_n, c.aux_count = ffi.new("double[?]", E), 0, c.count
  local idx, held
  if mask then -- (the counts of the unmasked tokens' choices alone)
    idx, held = on_host(c.idx, "int32_t *")
    c.aux_count, c.counted = ffi.new("int32_t[?]", E), mask
  end
  for n = 0, N - 1 do
    if not mask or mask[n] ~= 0 then
      for e = 0, E - 1 do c.probsum[e] = c.probsum[e] + p[n * E + e] end
      if mask then
        for j = 0, k - 1 do c.aux_count[idx[n * k + j]] = c.aux_count[idx[n * k + j]] + 1 end
      end
      c.aux_n = c.aux_n + 1
    end
  end
  if held then held:free() end
end

-- The rows of a choice in expert order (the moe_sort op; nn/moe_experts.lua's
-- route), each expert's row count and first row on the host, and what the
-- load-balancing loss counts (MoE:balance).
function MoE:rows(c)
  local E, k, N = self.n_experts, self.top_k, c.n
  local R = N * k
  c.rows = R
  c.row_of_slot, c.slot_of_row = self:activation({ N, k }, "i32"), self:activation({ R }, "i32")
  c.offsets = self:activation({ E + 1 }, "i32")
  ops.moe_sort(c.row_of_slot, c.slot_of_row, c.offsets, c.idx)
  local off, held = on_host(c.offsets, "int32_t *")
  c.count, c.first = ffi.new("int32_t[?]", E), ffi.new("int32_t[?]", E)
  for e = 0, E - 1 do c.first[e], c.count[e] = off[e], off[e + 1] - off[e] end
  if held then held:free() end
  local p, held_p = on_host(c.probs, "float *")
  self:balance(c, p)
  if held_p then held_p:free() end
  return c
end

-- The jitter's generator: one per block, keyed by the run's seed and the
-- block's layer, so runs of different seeds draw different noise and a
-- run's blocks draw apart. Made at the first draw (or restore), after the
-- engine has set ctx.seed; a model run without an engine draws from seed 0.
function MoE:jitter_generator()
  self.jitter_rng = self.jitter_rng or rng.new(rng.keyed(self.ctx.seed or 0, self.layer), 11)
  return self.jitter_rng
end

-- Where the jitter's generator stands, as 16 hex digits (a checkpoint keeps
-- it, so a resumed run draws the noise the uninterrupted one would); nil
-- without jitter.
function MoE:generator_state()
  if self.jitter > 0 then return bit.tohex(self:jitter_generator().state[0], 16) end
end

function MoE:set_generator_state(hex)
  if self.jitter > 0 then self:jitter_generator().state[0] = stream.u64_hex(hex) end
end

-- t's elements written by the host: write(p) gets a pointer to them (t's
-- own memory on the cpu, else a host copy that then goes to t). Returns t.
local function from_host(t, write)
  local h = t:device_name() ~= "cpu" and lz.tensor(t:sizes(), t:dtype_name(), "workspace")
  write((h or t).data)
  if h then
    t:copy(h)
    h:free()
  end
  return t
end

-- t holding the host's array p (floats or i32s, t's bytes of them).
local function fill(t, p)
  return from_host(t, function(d) ffi.copy(d, p, t:bytes()) end)
end

-- dst = src * noise, element by element on the host (src and dst f32, on
-- any device: one copy each way off the cpu).
local function times_noise(dst, src, noise)
  local ps, held = on_host(src, "float *")
  from_host(dst, function(d)
    local pd = ffi.cast("float *", d)
    for i = 0, dst:numel() - 1 do pd[i] = ps[i] * noise[i] end
  end)
  if held then held:free() end
end

-- Mixtral's jitter: x times uniform(1 - j, 1 + j) noise, drawn in training
-- (a replay of activation checkpointing reuses the forward's draw).
function MoE:jittered(x)
  if not (self.jitter > 0 and self.training) then
    self.noise = nil
    return x
  end
  local n = x:numel()
  if not self.ctx.recomputing then
    local g = self:jitter_generator()
    local noise = ffi.new("float[?]", n)
    local j = self.jitter
    for i = 0, n - 1 do noise[i] = 1 - j + 2 * j * g:uniform() end
    self.noise = noise
  end
  local y = self:activation(x:sizes())
  times_noise(y, x, self.noise)
  return y
end

function MoE:forward(x)
  local B, T, C = x:dim(1), x:dim(2), x:dim(3)
  local N = B * T
  x = self:jittered(x)
  local logits = self:run_forward(self.gate, x)
  local route = self:rows(self:choose(logits:view(0, { N, self.n_experts }), N))
  self.routing = route
  local y = self:run_forward(self.experts, x, route)
  if self.shared_expert then self:add_shared(y, x, N, C) end
  if not self.ctx.recomputing and self.training then
    local tally = self.tally or ffi.new("double[?]", self.n_experts)
    for e = 0, self.n_experts - 1 do tally[e] = tally[e] + route.count[e] end
    self.tally = tally
  end
  return y
end

-- Qwen2-MoE's shared expert, added into y: its output scaled per token by
-- sigmoid of the shared gate's logit, that one number a token on the host,
-- the scaling and its backward the moe_combine ops' (one slot a token), so
-- every device computes the same bits.
function MoE:add_shared(y, x, N, C)
  local s = self:run_forward(self.shared_expert, x)
  local g = self:run_forward(self.shared_expert_gate, x)
  local pg, held = on_host(g, "float *")
  local sig, slot = ffi.new("float[?]", N), ffi.new("int32_t[?]", N)
  for n = 0, N - 1 do sig[n], slot[n] = 1 / (1 + math.exp(-pg[n])), n end
  if held then held:free() end
  self.sig = sig
  self.sig_t = fill(self:activation({ N, 1 }), sig)
  self.slot_t = fill(self:activation({ N, 1 }, "i32"), slot)
  local scaled = self:activation({ N, C })
  ops.moe_combine_forward(scaled, s:view(0, { N, C }), self.sig_t, self.slot_t)
  ops.add(y, y, scaled:view(0, y:sizes()))
  self.shared_out = s
end

-- dlogits [B, T, E] from the experts' weight gradients (through the
-- renormalisation and the softmax: the moe_route_backward op) and the
-- load-balancing loss's, the same for every token it counts (MoE:balance):
-- scale * grad[e]; 0 for a masked one.
function MoE:router_grad(dlogits)
  local r, E, N = self.routing, self.n_experts, self.routing.n
  local aux = self.ctx.router_aux
  local dprobs
  if aux then
    local counted = r.counted
    dprobs = from_host(self:scratch({ N, E }), function(d)
      local p = ffi.cast("float *", d)
      for n = 0, N - 1 do
        local on = not counted or counted[n] ~= 0
        for e = 0, E - 1 do p[n * E + e] = on and aux.scale * aux.grad[e] or 0 end
      end
    end)
  end
  ops.moe_route_backward(dlogits:view(0, { N, E }), self.experts.dweights, dprobs, r.probs, r.idx,
                         self.norm_topk_prob and 1 or 0)
end

function MoE:backward(dy)
  local C = self.n_embd
  local dx = self:run_backward(self.experts, dy)
  local dlogits = self:scratch({ dy:dim(1), dy:dim(2), self.n_experts })
  self:router_grad(dlogits)
  ops.add(dx, dx, self:run_backward(self.gate, dlogits))
  if self.shared_expert then
    local N, sig = self.routing.n, self.sig
    local ds, dsig = self:scratch(dy:sizes()), self:scratch({ N, 1 })
    ops.moe_combine_backward(ds:view(0, { N, C }), dsig, dy:view(0, { N, C }),
                             self.shared_out:view(0, { N, C }), self.sig_t, self.slot_t)
    local pd, held = on_host(dsig, "float *")
    local dg_host = ffi.new("float[?]", N)
    for n = 0, N - 1 do dg_host[n] = sig[n] * (1 - sig[n]) * pd[n] end
    if held then held:free() end
    local dg = fill(self:scratch({ dy:dim(1), dy:dim(2), 1 }), dg_host)
    ops.add(dx, dx, self:run_backward(self.shared_expert, ds))
    ops.add(dx, dx, self:run_backward(self.shared_expert_gate, dg))
  end
  if self.noise then times_noise(dx, dx, self.noise) end
  return dx
end

-- The jittered input, the routing, the shared expert's scaled output and its
-- per-token gate and slot; the router's and the shared expert's gradients.
function MoE:own_memory(B, T)
  local N, C = B * T, self.n_embd
  return {
    activations = (self.jitter > 0 and lz.arena_bytes(N * C) or 0) +
                  2 * lz.arena_bytes(N * self.top_k) + 2 * lz.arena_bytes(N * self.top_k, "i32") +
                  lz.arena_bytes(N * self.n_experts) + lz.arena_bytes(self.n_experts + 1, "i32") +
                  (self.shared_expert and lz.arena_bytes(N * C) + lz.arena_bytes(N) +
                   lz.arena_bytes(N, "i32") or 0),
    scratch = 2 * lz.arena_bytes(N * self.n_experts) +
              (self.shared_expert and lz.arena_bytes(N * C) + 2 * lz.arena_bytes(N) or 0),
  }
end

-- The expert parameters a token does not run through: E - top_k experts'.
function MoE:idle_params()
  local per = 3 * self.n_embd * self.experts.n_hidden
  return per * (self.n_experts - self.top_k)
end

-- Tokens per expert that the blocks' forwards counted since the last call
-- (a list per block, training forwards only); the tallies start again.
function MoE.take_tallies(blocks)
  local out = {}
  for i, b in ipairs(blocks) do
    local t = {}
    for e = 0, b.n_experts - 1 do t[e + 1] = b.tally and b.tally[e] or 0 end
    out[i] = t
    b.tally = nil
  end
  return out
end

-- transformers' load_balancing_loss_func over the blocks' last forwards:
-- the top-k assignment counts and the router probabilities summed over
-- every block's counted tokens (all, or the unmasked ones: MoE:balance),
-- each over the counted rows of all blocks, their products summed, times E.
-- Returns the loss and its gradient with respect to each counted token's
-- router probability (the same for every such token and block: E * count_e
-- / rows^2). A batch of padding only counts nothing: 0, where transformers
-- divides by 0.
function MoE.aux_loss(blocks)
  local E = blocks[1].n_experts
  local count, psum, rows = {}, {}, 0
  for e = 0, E - 1 do count[e], psum[e] = 0, 0 end
  for _, b in ipairs(blocks) do
    local r = b.routing
    for e = 0, E - 1 do
      count[e] = count[e] + r.aux_count[e]
      psum[e] = psum[e] + r.probsum[e]
    end
    rows = rows + r.aux_n
  end
  local loss, grad = 0, {}
  if rows == 0 then
    for e = 0, E - 1 do grad[e] = 0 end
    return 0, grad
  end
  for e = 0, E - 1 do
    loss = loss + (count[e] / rows) * (psum[e] / rows)
    grad[e] = E * count[e] / (rows * rows)
  end
  return loss * E, grad
end

return MoE
