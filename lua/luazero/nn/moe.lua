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
--                     jitter = 0, seed = 0 })
--
-- The router's load-balancing loss (transformers' load_balancing_loss_func)
-- pools the blocks of a model: MoE.aux_loss(blocks) after the forward, and
-- ctx.router_aux = { grad =, scale = } for the blocks' backward.
local ffi = require("ffi")
local lz = require("luazero")
local Module = require("luazero.nn.module")
local Linear = require("luazero.nn.linear")
local SwiGLUMLP = require("luazero.nn.swiglu_mlp")
local Experts = require("luazero.nn.moe_experts")
local rng = require("luazero.rng")

local ops = lz.ops
local floats = Experts.floats
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
  self.jitter, self.seed = opts.jitter or 0, opts.seed or 0
  self.is_router_block = true
  self:add("gate", Linear.new(n_embd, E, { bias = false, std = opts.std }))
  self:add("experts", Experts.new(n_embd, opts.n_hidden, E, opts.std,
                                  opts.expert_names or { "gate_proj", "up_proj", "down_proj" }))
  self.experts.top_k = k
  if opts.shared then
    self:add("shared_expert", SwiGLUMLP.new(n_embd, opts.shared.n_hidden, opts.std))
    self:add("shared_expert_gate", Linear.new(n_embd, 1, { bias = false, std = opts.std }))
  end
  return self
end

-- Each token's choice from its router logits (N x E host floats): probs
-- [N, E] (kept for backward, and summed per expert for the load-balancing
-- loss), its k experts (sel [N, k]) and their weights (w [N, k]).
function MoE:choose(pl, N)
  local E, k = self.n_experts, self.top_k
  local probs = ffi.new("float[?]", N * E)
  local sel, w = ffi.new("int32_t[?]", N * k), ffi.new("float[?]", N * k)
  local probsum = ffi.new("double[?]", E)
  local taken = {}
  for n = 0, N - 1 do
    local row, p = pl + n * E, probs + n * E
    local m = -math.huge
    for e = 0, E - 1 do if row[e] > m then m = row[e] end end
    local s = 0
    for e = 0, E - 1 do
      p[e] = math.exp(row[e] - m)
      s = s + p[e]
    end
    for e = 0, E - 1 do
      p[e] = p[e] / s
      probsum[e] = probsum[e] + p[e]
      taken[e] = false
    end
    for j = 0, k - 1 do
      local best = -1
      for e = 0, E - 1 do
        if not taken[e] and (best < 0 or p[e] > p[best]) then best = e end
      end
      taken[best] = true
      sel[n * k + j], w[n * k + j] = best, p[best]
    end
    self:weigh(w + n * k)
  end
  return { n = N, probs = probs, probsum = probsum, sel = sel, w = w }
end

-- A token's k weights (its experts' probabilities) renormalised in place
-- where norm_topk_prob says so.
function MoE:weigh(w)
  if not self.norm_topk_prob then return end
  local total = 0
  for j = 0, self.top_k - 1 do total = total + w[j] end
  for j = 0, self.top_k - 1 do w[j] = w[j] / total end
end

-- The rows of a choice in expert order (nn/moe_experts.lua's route): each
-- expert's count and first row, each row's token and weight, and the row of
-- each (token, slot).
function MoE:rows(c)
  local E, k, N = self.n_experts, self.top_k, c.n
  local R = N * k
  local count, first = ffi.new("int32_t[?]", E), ffi.new("int32_t[?]", E)
  for i = 0, R - 1 do count[c.sel[i]] = count[c.sel[i]] + 1 end
  local at = 0
  for e = 0, E - 1 do first[e], at = at, at + count[e] end
  local tok, wt, row_of = ffi.new("int32_t[?]", R), ffi.new("float[?]", R),
                          ffi.new("int32_t[?]", R)
  local next_ = ffi.new("int32_t[?]", E)
  ffi.copy(next_, first, 4 * E)
  for n = 0, N - 1 do
    for j = 0, k - 1 do
      local e = c.sel[n * k + j]
      local r = next_[e]
      next_[e] = r + 1
      tok[r], wt[r], row_of[n * k + j] = n, c.w[n * k + j], r
    end
  end
  c.rows, c.count, c.first, c.tok, c.wt, c.row_of = R, count, first, tok, wt, row_of
  return c
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
    self.jitter_rng = self.jitter_rng or rng.new(self.seed, 11)
    local noise = ffi.new("float[?]", n)
    local j = self.jitter
    for i = 0, n - 1 do noise[i] = 1 - j + 2 * j * self.jitter_rng:uniform() end
    self.noise = noise
  end
  local y = self:activation(x:sizes())
  local px, py, noise = floats(x), floats(y), self.noise
  for i = 0, n - 1 do py[i] = px[i] * noise[i] end
  return y
end

function MoE:forward(x)
  local B, T, C = x:dim(1), x:dim(2), x:dim(3)
  local N = B * T
  x = self:jittered(x)
  local logits = self:run_forward(self.gate, x)
  local route = self:rows(self:choose(floats(logits), N))
  self.routing = route
  local y = self:run_forward(self.experts, x, route)
  if self.shared_expert then
    local s = self:run_forward(self.shared_expert, x)
    local g = self:run_forward(self.shared_expert_gate, x)
    local ps, pg, py = floats(s), floats(g), floats(y)
    local sig = ffi.new("float[?]", N)
    for n = 0, N - 1 do
      sig[n] = 1 / (1 + math.exp(-pg[n]))
      local a, b = py + n * C, ps + n * C
      for c = 0, C - 1 do a[c] = a[c] + sig[n] * b[c] end
    end
    self.sig, self.shared_out = sig, s
  end
  if not self.ctx.recomputing and self.training then
    local tally = self.tally or ffi.new("double[?]", self.n_experts)
    for e = 0, self.n_experts - 1 do tally[e] = tally[e] + route.count[e] end
    self.tally = tally
  end
  return y
end

-- dlogits [B, T, E] from the experts' weight gradients (through the
-- renormalisation and the softmax) and the load-balancing loss's.
function MoE:router_grad(dlogits)
  local r, dwt = self.routing, self.experts.dwt
  local E, k, N = self.n_experts, self.top_k, r.n
  local aux = self.ctx.router_aux
  local pd = floats(dlogits)
  local dp = ffi.new("double[?]", E)
  for n = 0, N - 1 do
    local p = r.probs + n * E
    for e = 0, E - 1 do dp[e] = aux and aux.scale * aux.grad[e] or 0 end
    local base = n * k
    if self.norm_topk_prob then
      local total, dot = 0, 0
      for j = 0, k - 1 do total = total + p[r.sel[base + j]] end
      for j = 0, k - 1 do dot = dot + dwt[r.row_of[base + j]] * r.w[base + j] end
      for j = 0, k - 1 do
        local e = r.sel[base + j]
        dp[e] = dp[e] + (dwt[r.row_of[base + j]] - dot) / total
      end
    else
      for j = 0, k - 1 do
        local e = r.sel[base + j]
        dp[e] = dp[e] + dwt[r.row_of[base + j]]
      end
    end
    local dot = 0
    for e = 0, E - 1 do dot = dot + p[e] * dp[e] end
    for e = 0, E - 1 do pd[n * E + e] = p[e] * (dp[e] - dot) end
  end
end

function MoE:backward(dy)
  local C = self.n_embd
  local dx = self:run_backward(self.experts, dy)
  local dlogits = self:scratch({ dy:dim(1), dy:dim(2), self.n_experts })
  self:router_grad(dlogits)
  ops.add(dx, dx, self:run_backward(self.gate, dlogits))
  if self.shared_expert then
    local N = self.routing.n
    local ds = self:scratch(dy:sizes())
    local dg = self:scratch({ dy:dim(1), dy:dim(2), 1 })
    local pdy, pds, pdg, ps = floats(dy), floats(ds), floats(dg), floats(self.shared_out)
    local sig = self.sig
    for n = 0, N - 1 do
      local a, b, d = pdy + n * C, ps + n * C, pds + n * C
      local dot = 0
      for c = 0, C - 1 do
        d[c] = sig[n] * a[c]
        dot = dot + a[c] * b[c]
      end
      pdg[n] = sig[n] * (1 - sig[n]) * dot
    end
    ops.add(dx, dx, self:run_backward(self.shared_expert, ds))
    ops.add(dx, dx, self:run_backward(self.shared_expert_gate, dg))
  end
  if self.noise then
    local pdx, noise = floats(dx), self.noise
    for i = 0, dx:numel() - 1 do pdx[i] = pdx[i] * noise[i] end
  end
  return dx
end

-- The jittered input; the router's and the shared expert's gradients.
function MoE:own_memory(B, T)
  local N, C = B * T, self.n_embd
  return {
    activations = self.jitter > 0 and lz.arena_bytes(N * C) or 0,
    scratch = lz.arena_bytes(N * self.n_experts) +
              (self.shared_expert and lz.arena_bytes(N * C) + lz.arena_bytes(N) or 0),
  }
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

-- transformers' load_balancing_loss_func over the blocks' last forwards
-- (no attention mask): the top-k assignment counts and the router
-- probabilities summed over every block's tokens, each over the rows of all
-- blocks, their products summed, times E. Returns the loss and its
-- gradient with respect to each router probability (the same for every
-- token and block: E * count_e / rows^2).
function MoE.aux_loss(blocks)
  local E = blocks[1].n_experts
  local count, psum, rows = {}, {}, 0
  for e = 0, E - 1 do count[e], psum[e] = 0, 0 end
  for _, b in ipairs(blocks) do
    local r = b.routing
    for e = 0, E - 1 do
      count[e] = count[e] + r.count[e]
      psum[e] = psum[e] + r.probsum[e]
    end
    rows = rows + r.n
  end
  local loss, grad = 0, {}
  for e = 0, E - 1 do
    loss = loss + (count[e] / rows) * (psum[e] / rows)
    grad[e] = E * count[e] / (rows * rows)
  end
  return loss * E, grad
end

return MoE
