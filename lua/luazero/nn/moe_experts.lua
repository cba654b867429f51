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
-- computes nothing and its gradient stays zero, yet takes part.
--
-- Gathered whole, the experts' GEMMs run as three grouped GEMMs (the
-- moe_gemm_part ops: every expert's rows at once, over the weights where the
-- block's parameters hold them), not one GEMM per expert and projection
-- (the same bits at the shapes tools/checksums trains; docs/moe.md, "Speed",
-- says where fp32 differs).
--
-- The routing a forward takes (nn/moe.lua's routing): R = N * k rows in
-- expert order (expert, then token, then slot; the moe_sort op):
-- weights [N, k], slot_of_row [R], row_of_slot [N, k] (i32 tensors beside
-- the activations), and on the host count[e] and first[e], each expert's rows.
local ffi = require("ffi")
local lz = require("luazero")
local Module = require("luazero.nn.module")

local ops = lz.ops
local capi = lz.C
local Experts = Module:extend("MoEExperts")

-- One expert's weights, gathered on its own (gather "expert"): its forward
-- and backward run the work the Experts module hands them.
local Expert = Module:extend("MoEExpert")

function Expert.new(n_embd, n_hidden, std, names)
  local self = setmetatable({}, Expert):init()
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

-- A tensor of `shape` over memory from t's first element on: the caller
-- has checked that the parameters it spans tile it exactly.
local function span(t, shape)
  local out = ffi.new("lz_tensor *[1]")
  lz.check(capi.lz_tensor_wrap(out, t.data, t.dtype, #shape, ffi.new("int64_t[?]", #shape, shape)))
  out[0].device = t.device
  return ffi.gc(out[0], capi.lz_tensor_free)
end

-- Whether the tensors of `map` (p or g) keyed by keys(e, part) lie as one
-- [E, 3, H * C] array in that order; the first of them if so.
local function tiled(map, keys, E, per)
  local first = map[keys(0, 1)]
  if first == nil then return nil end
  local base, es = ffi.cast("intptr_t", first.data), first:bytes() / first:numel()
  for e = 0, E - 1 do
    for part = 1, 3 do
      local t = map[keys(e, part)]
      if t == nil or t.dtype ~= first.dtype or t.device ~= first.device or
         ffi.cast("intptr_t", t.data) ~= base + ((e * 3 + part - 1) * per) * es then
        return nil
      end
    end
  end
  return first
end

-- The block's weights (and gradients) as the grouped GEMM reads them: w_in
-- [E, 3, H, C] for the gate and up parts, w_out [E, 3, C, H] for the down
-- part, over the parameters where they lie (each expert's gate, up, down
-- side by side, as gather "block" binds them; g the same or absent, as
-- frozen). nil where they do not lie so, or where a matmul would cast the
-- weight (f16): the experts then run one GEMM each.
function Experts:stacked()
  if self.gather ~= "block" then return nil end
  local E, C, H = self.n_experts, self.n_embd, self.n_hidden
  local keys = function(e, part) return self.units[e + 1].keys[part] end
  local w = tiled(self.p, keys, E, H * C)
  if w == nil or not (w:dtype_name() == "f32" or w:dtype_name() == "bf16") then return nil end
  local g = tiled(self.g, keys, E, H * C)
  if g == nil and next(self.g) ~= nil then return nil end
  return {
    w_in = span(w, { E, 3, H, C }), w_out = span(w, { E, 3, C, H }),
    g_in = g and span(g, { E, 3, H, C }), g_out = g and span(g, { E, 3, C, H }),
  }
end

local function free_stacked(st)
  for _, k in ipairs({ "w_in", "w_out", "g_in", "g_out" }) do
    if st[k] then st[k]:free() end
  end
end

-- x [B, T, C] (the block's input), route: as the header says. Returns
-- y [B, T, C]: each token's sum over its k rows of weight * expert(x), in
-- expert order as transformers' index_add_ loop sums them. The GEMMs run
-- through the grouped GEMM where the weights allow it, else one per expert.
function Experts:forward(x, route)
  local C, H, R = self.n_embd, self.n_hidden, route.rows
  local N = x:numel() / C
  local xp = self:activation({ 1, R, C })
  ops.moe_permute_forward(xp:view(0, { R, C }), x:view(0, { N, C }), route.slot_of_row)
  local gate, up = self:activation({ 1, R, H }), self:activation({ 1, R, H })
  local h, yp = self:activation({ 1, R, H }), self:activation({ 1, R, C })
  local st = self:stacked()
  if st then
    local xw = self:matmul_operands(xp, st.w_in)
    ops.moe_gemm_part_forward(gate:view(0, { R, H }), xw:view(0, { R, C }), st.w_in,
                              route.offsets, 0)
    ops.moe_gemm_part_forward(up:view(0, { R, H }), xw:view(0, { R, C }), st.w_in,
                              route.offsets, 1)
    ops.swiglu_forward(h, gate, up)
    local hw = self:matmul_operands(h, st.w_out)
    ops.moe_gemm_part_forward(yp:view(0, { R, C }), hw:view(0, { R, H }), st.w_out,
                              route.offsets, 2)
    free_stacked(st)
  end
  for e = 1, st and 0 or self.n_experts do
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
  local st = self:stacked()
  if st then
    local off = route.offsets
    local dyw = self:matmul_operands(dyp, st.w_out)
    local hw = self:matmul_operands(self.h, st.w_out)
    ops.moe_gemm_part_backward(dh:view(0, { R, H }), st.g_out, dyw:view(0, { R, C }),
                               hw:view(0, { R, H }), st.w_out, off, 2)
    ops.swiglu_backward(dh, dup, dh, self.gate, self.up)
    local dhw = self:matmul_operands(dh, st.w_in)
    local xw = self:matmul_operands(self.xp, st.w_in)
    ops.moe_gemm_part_backward(dxp:view(0, { R, C }), st.g_in, dhw:view(0, { R, H }),
                               xw:view(0, { R, C }), st.w_in, off, 0)
    local duw = self:matmul_operands(dup, st.w_in)
    ops.moe_gemm_part_backward(dxu:view(0, { R, C }), st.g_in, duw:view(0, { R, H }),
                               xw:view(0, { R, C }), st.w_in, off, 1)
    ops.add(dxp, dxp, dxu)
    free_stacked(st)
  end
  for e = 1, st and 0 or self.n_experts do
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
