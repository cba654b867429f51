-- nn/moe_experts.lua — the experts of a sparse MoE block: E SwiGLU MLPs,
-- down(silu(gate(x)) * up(x)), each token row sent to the experts its
-- router picked, each expert's output weighted and summed back per token.
--
-- One module owns every expert's weights, named as the checkpoints on the
-- Hub hold them (Mixtral's experts.N.w1/w3/w2, Qwen-MoE's and OLMoE's
-- experts.N.gate_proj/up_proj/down_proj): the experts are one parameter
-- segment, so under ZeRO-3 they are gathered, and their gradients reduced,
-- as one unit each time the block runs, whatever the tokens did. An expert
-- no token reached computes nothing and its gradient stays zero; the
-- collectives never depend on the routing.
--
-- The routing a forward takes (nn/moe.lua's route): rows = N * k token rows
-- in expert order (expert, then token, then slot); tok[r] the token of row
-- r, wt[r] its weight, count[e] and first[e] each expert's rows.
local ffi = require("ffi")
local lz = require("luazero")
local Module = require("luazero.nn.module")

local ops = lz.ops
local Experts = Module:extend("MoEExperts")

-- names: the three projections' names in the checkpoint, { gate, up, down }.
function Experts.new(n_embd, n_hidden, n_experts, std, names)
  local self = setmetatable({}, Experts):init()
  self.n_embd, self.n_hidden, self.n_experts = n_embd, n_hidden, n_experts
  self.keys = {}
  local init = { kind = "normal", std = std }
  for e = 0, n_experts - 1 do
    local k = { "gate" .. e, "up" .. e, "down" .. e }
    self.keys[e + 1] = k
    self:param(k[1], { n_hidden, n_embd }, init, true, ("%d.%s.weight"):format(e, names[1]))
    self:param(k[2], { n_hidden, n_embd }, init, true, ("%d.%s.weight"):format(e, names[2]))
    self:param(k[3], { n_embd, n_hidden }, init, true, ("%d.%s.weight"):format(e, names[3]))
  end
  return self
end

-- Host pointers of cpu tensors: the routing's gathers and sums run there.
local function floats(t)
  if t:device_name() ~= "cpu" then
    error(("moe: the MoE block runs on the cpu for now (got a tensor on %s); " ..
           "use --device cpu"):format(t:device_name()), 0)
  end
  return ffi.cast("float *", t.data)
end
Experts.floats = floats

-- x [B, T, C] (the block's input), route: as the header says. Returns
-- y [B, T, C]: each token's sum over its k rows of wt * expert(x).
function Experts:forward(x, route)
  local C, H, R = self.n_embd, self.n_hidden, route.rows
  local xp = self:activation({ 1, R, C })
  local px, pxp = floats(x), floats(xp)
  for r = 0, R - 1 do ffi.copy(pxp + r * C, px + route.tok[r] * C, 4 * C) end
  local gate, up = self:activation({ 1, R, H }), self:activation({ 1, R, H })
  local h, yp = self:activation({ 1, R, H }), self:activation({ 1, R, C })
  for e = 1, self.n_experts do
    local n, at = route.count[e - 1], route.first[e - 1]
    if n > 0 then
      local k = self.keys[e]
      local xe = xp:view(at * C, { 1, n, C })
      local ge, ue = gate:view(at * H, { 1, n, H }), up:view(at * H, { 1, n, H })
      local he = h:view(at * H, { 1, n, H })
      local xw, w1 = self:matmul_operands(xe, self.p[k[1]])
      ops.linear_forward(ge, xw, w1, nil)
      local xw3, w3 = self:matmul_operands(xe, self.p[k[2]])
      ops.linear_forward(ue, xw3, w3, nil)
      ops.swiglu_forward(he, ge, ue)
      local hw, w2 = self:matmul_operands(he, self.p[k[3]])
      ops.linear_forward(yp:view(at * C, { 1, n, C }), hw, w2, nil)
    end
  end
  local y = self:activation(x:sizes())
  y:fill(0)
  local py, pyp = floats(y), floats(yp)
  -- In expert order, as transformers' index_add_ runs.
  for r = 0, R - 1 do
    local dst, src, w = py + route.tok[r] * C, pyp + r * C, route.wt[r]
    for c = 0, C - 1 do dst[c] = dst[c] + w * src[c] end
  end
  self.xp, self.gate, self.up, self.h, self.yp, self.route = xp, gate, up, h, yp, route
  return y
end

-- dy [B, T, C] -> dx [B, T, C]; the experts' weight gradients accumulate;
-- self.dwt[r]: d(loss)/d(wt[r]), for the router's backward.
function Experts:backward(dy)
  local C, H, route = self.n_embd, self.n_hidden, self.route
  local R = route.rows
  local dyp = self:scratch({ 1, R, C })
  local pdy, pdyp, pyp = floats(dy), floats(dyp), floats(self.yp)
  local dwt = ffi.new("double[?]", R)
  for r = 0, R - 1 do
    local src, dst, yr, w = pdy + route.tok[r] * C, pdyp + r * C, pyp + r * C, route.wt[r]
    local s = 0
    for c = 0, C - 1 do
      dst[c] = w * src[c]
      s = s + src[c] * yr[c]
    end
    dwt[r] = s
  end
  local dh, dup = self:scratch({ 1, R, H }), self:scratch({ 1, R, H })
  local dxp, dxu = self:scratch({ 1, R, C }), self:scratch({ 1, R, C })
  for e = 1, self.n_experts do
    local n, at = route.count[e - 1], route.first[e - 1]
    if n > 0 then
      local k = self.keys[e]
      local dhe, due = dh:view(at * H, { 1, n, H }), dup:view(at * H, { 1, n, H })
      local dye, w2 = self:matmul_operands(dyp:view(at * C, { 1, n, C }), self.p[k[3]])
      local hw = self:matmul_operands(self.h:view(at * H, { 1, n, H }), w2)
      ops.linear_backward(dhe, self.g[k[3]], nil, dye, hw, w2)
      ops.swiglu_backward(dhe, due, dhe, self.gate:view(at * H, { 1, n, H }),
                          self.up:view(at * H, { 1, n, H }))
      local xe = self.xp:view(at * C, { 1, n, C })
      local dge, w1 = self:matmul_operands(dhe, self.p[k[1]])
      local xw = self:matmul_operands(xe, w1)
      ops.linear_backward(dxp:view(at * C, { 1, n, C }), self.g[k[1]], nil, dge, xw, w1)
      local due_, w3 = self:matmul_operands(due, self.p[k[2]])
      ops.linear_backward(dxu:view(at * C, { 1, n, C }), self.g[k[2]], nil, due_, xw, w3)
    end
  end
  local dx = self:scratch(dy:sizes())
  dx:fill(0)
  local pdx, pa, pb = floats(dx), floats(dxp), floats(dxu)
  for r = 0, R - 1 do
    local dst, a, b = pdx + route.tok[r] * C, pa + r * C, pb + r * C
    for c = 0, C - 1 do dst[c] = dst[c] + (a[c] + b[c]) end
  end
  self.dwt = dwt
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
    scratch = 3 * lz.arena_bytes(R * C) + 2 * lz.arena_bytes(R * H) + lz.arena_bytes(N * C),
    casts = 3 * self.n_experts * (Module.matmul_cast_bytes(R * C, w, dtype)
                                  + Module.matmul_cast_bytes(R * H, w, dtype)),
  }
end

return Experts
