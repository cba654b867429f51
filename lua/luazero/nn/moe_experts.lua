-- nn/moe_experts.lua — the experts of a sparse MoE block: E SwiGLU MLPs,
-- down(silu(gate(x)) * up(x)), each token row sent to the experts its
-- router picked, each expert's output weighted and summed back per token.
-- Their weights are named as the checkpoints on the Hub hold them
-- (Mixtral's experts.N.w1/w3/w2, Qwen-MoE's and OLMoE's
-- experts.N.gate_proj/up_proj/down_proj).
--
-- How ZeRO-3 gathers them (gather): "block" (the default), one module owns
-- every expert's weights, so they are one parameter segment, gathered and
-- reduced as one unit each time the block runs; "expert", each expert is a
-- module of its own (one segment each), and every expert runs through the
-- hooks in order each time the block runs, its rows or none. Either way
-- the collectives never depend on the routing: an expert no token reached
-- computes nothing and its gradient stays zero, yet takes part. Where the
-- engine asks (ctx.agree_routed: the plan's moe.routed_only), each forward
-- first agrees with the other ranks on the experts any of them routed to
-- and marks the others unrouted, which the engine's hooks then skip.
--
-- The routing a forward takes (nn/moe.lua's routing): R = N * k rows in
-- expert order (expert, then token, then slot; the moe_sort op):
-- weights [N, k], slot_of_row [R], row_of_slot [N, k] (i32 tensors beside
-- the activations), and on the host count[e] and first[e], each expert's rows.
local lz = require("luazero")
local Module = require("luazero.nn.module")

local ops = lz.ops
local Experts = Module:extend("MoEExperts")

-- One expert's weights, gathered on its own (gather "expert"): its forward
-- and backward run the work the Experts module hands them.
local Expert = Module:extend("MoEExpert")

function Expert.new(n_embd, n_hidden, std, names)
  local self = setmetatable({}, Expert):init()
  self.is_expert_unit = true
  local init = { kind = "normal", std = std }
  self:param("gate", { n_hidden, n_embd }, init, true, names[1] .. ".weight")
  self:param("up", { n_hidden, n_embd }, init, true, names[2] .. ".weight")
  self:param("down", { n_embd, n_hidden }, init, true, names[3] .. ".weight")
  return self
end

function Expert:forward(work) return work() end
function Expert:backward(_, work) return work() end

-- names: the three projections' names in the checkpoint, { gate, up, down };
-- gather: "block" or "expert" (the header).
function Experts.new(n_embd, n_hidden, n_experts, std, names, gather)
  local self = setmetatable({}, Experts):init()
  self.n_embd, self.n_hidden, self.n_experts = n_embd, n_hidden, n_experts
  self.gather = gather or "block"
  if self.gather ~= "block" and self.gather ~= "expert" then
    error(("moe: gather must be \"block\" or \"expert\" (got %s)"):format(tostring(gather)), 0)
  end
  -- (the module holding expert weights: the engine counts their gathers)
  self.is_expert_unit = self.gather == "block"
  -- units[e]: the module holding expert e's weights, and their keys there
  self.units = {}
  local init = { kind = "normal", std = std }
  for e = 0, n_experts - 1 do
    if self.gather == "expert" then
      local m = self:add(tostring(e), Expert.new(n_embd, n_hidden, std, names))
      self.units[e + 1] = { module = m, keys = { "gate", "up", "down" } }
    else
      local k = { "gate" .. e, "up" .. e, "down" .. e }
      self.units[e + 1] = { module = self, keys = k }
      self:param(k[1], { n_hidden, n_embd }, init, true, ("%d.%s.weight"):format(e, names[1]))
      self:param(k[2], { n_hidden, n_embd }, init, true, ("%d.%s.weight"):format(e, names[2]))
      self:param(k[3], { n_embd, n_hidden }, init, true, ("%d.%s.weight"):format(e, names[3]))
    end
  end
  return self
end

-- Runs work() for expert e: inside its own hooks where it is a module of
-- its own, else directly (the block's weights are gathered already).
function Experts:run_unit(e, backward, work)
  local m = self.units[e].module
  if m == self then return work() end
  if backward then return self:run_backward(m, nil, work) end
  return self:run_forward(m, work)
end

-- x [B, T, C] (the block's input), route: as the header says. Returns
-- y [B, T, C]: each token's sum over its k rows of weight * expert(x), in
-- expert order as transformers' index_add_ loop sums them.
function Experts:forward(x, route)
  local C, H, R = self.n_embd, self.n_hidden, route.rows
  local N = x:numel() / C
  local agree = self.ctx.agree_routed
  if agree and self.gather == "expert" and not self.ctx.recomputing then
    local routed = agree(route.count, self.n_experts)
    for e = 1, self.n_experts do self.units[e].module.unrouted = routed[e - 1] == 0 end
  end
  local xp = self:activation({ 1, R, C })
  ops.moe_permute_forward(xp:view(0, { R, C }), x:view(0, { N, C }), route.slot_of_row)
  local gate, up = self:activation({ 1, R, H }), self:activation({ 1, R, H })
  local h, yp = self:activation({ 1, R, H }), self:activation({ 1, R, C })
  for e = 1, self.n_experts do
    local n, at = route.count[e - 1], route.first[e - 1]
    self:run_unit(e, false, function()
      if n == 0 then return end
      local u = self.units[e]
      local k, p = u.keys, u.module.p
      local xe = xp:view(at * C, { 1, n, C })
      local ge, ue = gate:view(at * H, { 1, n, H }), up:view(at * H, { 1, n, H })
      local he = h:view(at * H, { 1, n, H })
      local xw, w1 = self:matmul_operands(xe, p[k[1]])
      ops.linear_forward(ge, xw, w1, nil)
      local xw3, w3 = self:matmul_operands(xe, p[k[2]])
      ops.linear_forward(ue, xw3, w3, nil)
      ops.swiglu_forward(he, ge, ue)
      local hw, w2 = self:matmul_operands(he, p[k[3]])
      ops.linear_forward(yp:view(at * C, { 1, n, C }), hw, w2, nil)
    end)
  end
  local y = self:activation(x:sizes())
  ops.moe_combine_forward(y:view(0, { N, C }), yp:view(0, { R, C }), route.weights,
                          route.row_of_slot)
  self.xp, self.gate, self.up, self.h, self.yp, self.route = xp, gate, up, h, yp, route
  return y
end

-- dy [B, T, C] -> dx [B, T, C]; the experts' weight gradients accumulate;
-- self.dweights [N, k]: d(loss)/d(weights), for the router's backward.
function Experts:backward(dy)
  local C, H, route = self.n_embd, self.n_hidden, self.route
  local R = route.rows
  local N = dy:numel() / C
  local dyp = self:scratch({ 1, R, C })
  local dweights = self:scratch(route.weights:sizes())
  ops.moe_combine_backward(dyp:view(0, { R, C }), dweights, dy:view(0, { N, C }),
                           self.yp:view(0, { R, C }), route.weights, route.row_of_slot)
  local dh, dup = self:scratch({ 1, R, H }), self:scratch({ 1, R, H })
  local dxp, dxu = self:scratch({ 1, R, C }), self:scratch({ 1, R, C })
  for e = 1, self.n_experts do
    local n, at = route.count[e - 1], route.first[e - 1]
    self:run_unit(e, true, function()
      if n == 0 then return end
      local u = self.units[e]
      local k, p, g = u.keys, u.module.p, u.module.g
      local dhe, due = dh:view(at * H, { 1, n, H }), dup:view(at * H, { 1, n, H })
      local dye, w2 = self:matmul_operands(dyp:view(at * C, { 1, n, C }), p[k[3]])
      local hw = self:matmul_operands(self.h:view(at * H, { 1, n, H }), w2)
      ops.linear_backward(dhe, g[k[3]], nil, dye, hw, w2)
      ops.swiglu_backward(dhe, due, dhe, self.gate:view(at * H, { 1, n, H }),
                          self.up:view(at * H, { 1, n, H }))
      local xe = self.xp:view(at * C, { 1, n, C })
      local dge, w1 = self:matmul_operands(dhe, p[k[1]])
      local xw = self:matmul_operands(xe, w1)
      ops.linear_backward(dxp:view(at * C, { 1, n, C }), g[k[1]], nil, dge, xw, w1)
      local due_, w3 = self:matmul_operands(due, p[k[2]])
      ops.linear_backward(dxu:view(at * C, { 1, n, C }), g[k[2]], nil, due_, xw, w3)
      ops.add(dxp:view(at * C, { 1, n, C }), dxp:view(at * C, { 1, n, C }),
              dxu:view(at * C, { 1, n, C }))
    end)
  end
  local dx = self:scratch(dy:sizes())
  ops.moe_permute_backward(dx:view(0, { N, C }), dxp:view(0, { R, C }), route.row_of_slot)
  self.dweights = dweights
  return dx
end

-- For B x T tokens at most every row goes to an expert k times: the
-- block passes k as self.top_k before the model sizes its arenas.
function Experts:own_memory(B, T, dtype)
  local N, C, H = B * T, self.n_embd, self.n_hidden
  local R = N * (self.top_k or 1)
  local w = C * H
  return {
    input = lz.arena_bytes(N * C),
    activations = 2 * lz.arena_bytes(R * C) + 3 * lz.arena_bytes(R * H) + lz.arena_bytes(N * C),
    scratch = 3 * lz.arena_bytes(R * C) + 2 * lz.arena_bytes(R * H) + lz.arena_bytes(N * C) +
              lz.arena_bytes(R),
    casts = 3 * self.n_experts * (Module.matmul_cast_bytes(R * C, w, dtype)
                                  + Module.matmul_cast_bytes(R * H, w, dtype)),
  }
end

return Experts
