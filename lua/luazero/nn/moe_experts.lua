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
-- Gathered whole, the experts' GEMMs run as three grouped GEMMs (the
-- moe_gemm_part ops: every expert's rows at once, over the weights where the
-- block's parameters hold them); otherwise one per expert and projection,
-- through the same op on that expert alone (expert_forward/backward), so
-- every mode gives an expert's rows the same bits.
--
-- The routing a forward takes (nn/moe.lua's routing): R = N * k rows in
-- expert order (expert, then token, then slot; the moe_sort op):
-- weights [N, k], slot_of_row [R], row_of_slot [N, k] (i32 tensors beside
-- the activations), and on the host count[e] and first[e], each expert's rows.
local ffi = require("ffi")
local lz = require("luazero")
local Module = require("luazero.nn.module")
-- LoRA on the experts (u.lora where models/lora.lua put adapters)
local LoraExperts = require("luazero.nn.lora_experts")

local ops = lz.ops
local capi = lz.C
local Experts = Module:extend("MoEExperts")
Experts.is_moe_experts = true

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
  -- units[e]: the module holding expert e's weights, and their keys there;
  -- expert_of[key] on that module: the expert (0-based) a parameter is,
  -- for the engine's expert placement (zero/layout.lua's expert_owner)
  self.units = {}
  self.expert_of = {}
  local init = { kind = "normal", std = std }
  for e = 0, n_experts - 1 do
    if self.gather == "expert" then
      local m = self:add(tostring(e), Expert.new(n_embd, n_hidden, std, names))
      self.units[e + 1] = { module = m, keys = { "gate", "up", "down" } }
      m.n_experts, m.expert_of = n_experts, { gate = e, up = e, down = e }
    else
      local k = { "gate" .. e, "up" .. e, "down" .. e }
      self.units[e + 1] = { module = self, keys = k }
      for _, key in ipairs(k) do self.expert_of[key] = e end
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

-- Expert parallelism (ctx.ep_group, the engine's expert-parallel group of
-- P ranks; DeepSpeed-MoE's scheme): the E experts are placed on the group's
-- ranks, E / P each, contiguous (group rank q computes experts q*E/P ..
-- (q+1)*E/P - 1). Each rank routes and sorts its own tokens, sends each
-- rank the rows of that rank's experts (all-to-all-v, the counts first),
-- computes its experts over the rows it received, by source rank, then
-- expert, then token (a fixed order: the same bits every run), and sends
-- the outputs back by the reverse exchange; backward is the mirror image.
-- Every rank takes part in every exchange, with zero rows where its tokens
-- went elsewhere, so nothing waits on the routing. Returns nil without a
-- group, else { group, send, recv (rows to and from each group rank,
-- 1-based lists), rows (received), runs (runs[e]: expert e's {at, n} in
-- the received rows, one a source rank; none for another rank's experts) }.
-- The received rows are in source-rank order, so an expert's rows are up to
-- P runs, not one span: route.offsets does not describe them, and the
-- experts' GEMMs run per run (the GEMMs each source rank would run itself
-- without expert parallelism).
function Experts:exchange(route, device)
  local g = self.ctx.ep_group
  if not g then return nil end
  local P, p, E = self:ep_size(), g:rank(), self.n_experts
  local L = E / P
  -- (the counts travel where the rows do: a device's communicator reads
  -- device memory)
  local sent, got = lz.tensor({ E }, "i32", "workspace"), nil
  local ps = ffi.cast("int32_t *", sent.data)
  for e = 0, E - 1 do ps[e] = route.count[e] end
  if device == "cpu" then
    got = lz.tensor({ E }, "i32", "workspace")
    g:all_to_all(sent, got)
  else
    local ds = lz.tensor({ E }, "i32", "workspace", device)
    local dg = lz.tensor({ E }, "i32", "workspace", device)
    ds:copy(sent)
    g:all_to_all(ds, dg)
    got = dg:to("cpu")
    ds:free()
    dg:free()
  end
  local pg = ffi.cast("int32_t *", got.data)
  local ex = { group = g, send = {}, recv = {}, rows = 0, runs = {} }
  for e = 1, E do ex.runs[e] = {} end
  for q = 0, P - 1 do
    local out, inn = 0, 0
    for j = 0, L - 1 do
      out = out + ps[q * L + j]
      local n = pg[q * L + j]
      local runs = ex.runs[p * L + j + 1]
      runs[#runs + 1] = { at = ex.rows + inn, n = n }
      inn = inn + n
    end
    ex.send[q + 1], ex.recv[q + 1] = out, inn
    ex.rows = ex.rows + inn
  end
  sent:free()
  got:free()
  return ex
end

-- The ranks the experts are placed on (1 without expert parallelism),
-- which must divide the experts evenly: the engine's group, else the
-- context's ep_size (a model sized for a group it is not in: the
-- estimate's arenas).
function Experts:ep_size()
  local ctx = self.ctx or {}
  local g = ctx.ep_group
  local P, E = g and g:size() or ctx.ep_size or 1, self.n_experts
  if E % P ~= 0 then
    error(("moe: expert parallelism places the %d experts on the %d ranks of an expert-parallel " ..
           "group, as many each: set moe.ep_size to a divisor of %d"):format(E, P, E), 0)
  end
  return P
end

-- Rows of `width` elements from src to dst through the exchange: to the
-- experts' ranks, or (back) from them to the tokens' ranks.
local function exchanged(ex, src, dst, width, back)
  local to, from = {}, {}
  for q = 1, #ex.send do to[q], from[q] = ex.send[q] * width, ex.recv[q] * width end
  if back then to, from = from, to end
  ex.group:all_to_all_v(src, to, dst, from)
end

-- One expert's GEMMs outside the grouped ones (gathered per expert, under
-- expert parallelism, with adapters on the experts) run the grouped GEMM's
-- op on that expert alone: its tasks, each on one thread, so an
-- expert's rows get the bits the grouped GEMM gives them at any thread
-- count (one threaded GEMM over the expert need not: oneDNN's sgemm splits
-- some sums by the thread count, on AVX2 parts at two threads already).
-- off: an i32 tensor { 0, n } on the rows' device, for n rows.
local function expert_rows(n, device)
  local off = lz.tensor({ 2 }, "i32", "workspace")
  local p = ffi.cast("int32_t *", off.data)
  p[0], p[1] = 0, n
  if device == "cpu" then return off end
  local d = lz.tensor({ 2 }, "i32", "workspace", device)
  d:copy(off)
  off:free()
  return d
end

-- y [1, n, D] = x [1, n, C] @ w^T (w [D, C]), as linear_forward without a bias.
local function expert_forward(y, x, w, off)
  local s = w:sizes()
  local n = x:numel() / s[2]
  ops.moe_gemm_forward(y:view(0, { n, s[1] }), x:view(0, { n, s[2] }),
                       w:view(0, { 1, s[1], s[2] }), off)
end

-- dx = dy @ w (written), dw += dy^T @ x (dw may be nil), as linear_backward
-- without a bias.
local function expert_backward(dx, dw, dy, x, w, off)
  local s = w:sizes()
  local n = x:numel() / s[2]
  ops.moe_gemm_backward(dx:view(0, { n, s[2] }), dw and dw:view(0, { 1, s[1], s[2] }),
                        dy:view(0, { n, s[1] }), x:view(0, { n, s[2] }),
                        w:view(0, { 1, s[1], s[2] }), off)
end

-- Expert e's runs of rows: its rows of this rank's tokens, or what the
-- exchange brought it.
local function runs_of(ex, route, e)
  if ex then return ex.runs[e] end
  return { { at = route.first[e - 1], n = route.count[e - 1] } }
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

-- The dtype the rows the grouped GEMMs read are written in: bf16 where
-- the weights are (the permuted input, the activation, the output's and
-- the gate's and up's gradients each written bf16 once, no cast pass; they
-- feed nothing else), else nil (f32).
local function bf16_rows(st)
  if st and st.w_in:dtype_name() == "bf16" then return "bf16" end
end

-- x [B, T, C] (the block's input), route: as the header says. Returns
-- y [B, T, C]: each token's sum over its k rows of weight * expert(x), in
-- expert order as transformers' index_add_ loop sums them. The GEMMs run
-- through the grouped GEMM where the weights allow it, else one per expert.
function Experts:forward(x, route)
  local C, H, R = self.n_embd, self.n_hidden, route.rows
  local N = x:numel() / C
  local agree = self.ctx.agree_routed
  if agree and self.gather == "expert" and not self.ctx.recomputing then
    local routed = agree(route.count, self.n_experts)
    for e = 1, self.n_experts do self.units[e].module.unrouted = routed[e - 1] == 0 end
  end
  -- (xo, yo: this rank's rows; xp, yp: the rows its experts compute, the
  -- same tensors without expert parallelism)
  local ex = self:exchange(route, x:device_name())
  -- (gathered whole, without expert parallelism or adapters on the
  -- experts: three grouped GEMMs over every expert's rows)
  local st = not ex and not self.units[1].lora and self:stacked()
  local half = bf16_rows(st)
  local xo = self:activation({ 1, R, C }, half)
  ops.moe_permute_forward(xo:view(0, { R, C }), x:view(0, { N, C }), route.slot_of_row)
  local rows, xp = R, xo
  if ex then
    rows = math.max(ex.rows, 1)
    xp = self:activation({ 1, rows, C })
    exchanged(ex, xo, xp, C, false)
  end
  local gate, up = self:activation({ 1, rows, H }), self:activation({ 1, rows, H })
  local h, yp = self:activation({ 1, rows, H }, half), self:activation({ 1, rows, C })
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
    local runs = runs_of(ex, route, e)
    self:run_unit(e, false, function()
      for _, run in ipairs(runs) do
        local n, at = run.n, run.at
        if n > 0 then
          local u = self.units[e]
          local k, p = u.keys, u.module.p
          local xe = xp:view(at * C, { 1, n, C })
          local ge, ue = gate:view(at * H, { 1, n, H }), up:view(at * H, { 1, n, H })
          local he = h:view(at * H, { 1, n, H })
          local off = expert_rows(n, xp:device_name())
          local xw, w1 = self:matmul_operands(xe, p[k[1]])
          expert_forward(ge, xw, w1, off)
          local xw3, w3 = self:matmul_operands(xe, p[k[2]])
          expert_forward(ue, xw3, w3, off)
          if u.lora then LoraExperts.gate_up_forward(self, u, xe, ge, ue, n) end
          ops.swiglu_forward(he, ge, ue)
          local hw, w2 = self:matmul_operands(he, p[k[3]])
          expert_forward(yp:view(at * C, { 1, n, C }), hw, w2, off)
          off:free()
          if u.lora then LoraExperts.down_forward(self, u, he, yp:view(at * C, { 1, n, C }), n) end
        end
      end
    end)
  end
  local yo = yp
  if ex then
    yo = self:activation({ 1, R, C })
    exchanged(ex, yp, yo, C, true)
  end
  local y = self:activation(x:sizes())
  ops.moe_combine_forward(y:view(0, { N, C }), yo:view(0, { R, C }), route.weights,
                          route.row_of_slot)
  self.xp, self.gate, self.up, self.h, self.yo, self.route = xp, gate, up, h, yo, route
  self.ex = ex
  return y
end

-- Gathered whole, backward writes every gradient of the block's own
-- parameters when the engine sets self.grads_write (the first micro-step
-- of an accumulation): the three grouped GEMMs' dW write their parts, an
-- expert no row reached getting zeros; the per-expert GEMMs add into the
-- gradients zeroed first.
function Experts:writes_grads() return self.gather == "block" end
-- The grouped dW takes the gradient norm's block partials of what it
-- writes, where the engine hands them (self.norm_blocks: zero/reduce.lua's
-- norm_blocks_for), while each task's block is in cache.
Experts.takes_norm_blocks = true

-- dy [B, T, C] -> dx [B, T, C]; the experts' weight gradients accumulate
-- (or are written: writes_grads); self.dweights [N, k]: d(loss)/d(weights),
-- for the router's backward.
function Experts:backward(dy)
  local C, H, route, ex = self.n_embd, self.n_hidden, self.route, self.ex
  local R = route.rows
  local write, nb = self.grads_write, self.norm_blocks
  self.grads_write, self.norm_blocks = nil, nil
  local N = dy:numel() / C
  local st = not ex and not self.units[1].lora and self:stacked()
  local half = bf16_rows(st)
  local dyo = self:scratch({ 1, R, C }, half)
  local dweights = self:scratch(route.weights:sizes())
  ops.moe_combine_backward(dyo:view(0, { R, C }), dweights, dy:view(0, { N, C }),
                           self.yo:view(0, { R, C }), route.weights, route.row_of_slot)
  local rows, dyp = R, dyo
  if ex then
    rows = math.max(ex.rows, 1)
    dyp = self:scratch({ 1, rows, C })
    exchanged(ex, dyo, dyp, C, false)
  end
  local dh, dup = self:scratch({ 1, rows, H }), self:scratch({ 1, rows, H }, half)
  local dxp, dxu = self:scratch({ 1, rows, C }), self:scratch({ 1, rows, C })
  if st then
    local off = route.offsets
    local gemm_backward = write and ops.moe_gemm_part_backward_write or ops.moe_gemm_part_backward
    -- (where the block's gradients start in the slice the norm reads)
    local at = nb and st.g_in and nb.at(st.g_in)
    if at then
      gemm_backward = function(dx_, dw, dy_, x_, w, off_, part)
        return ops.moe_gemm_part_backward_norm(dx_, dw, dy_, x_, w, off_, part, write and 1 or 0,
                                               nb.ptr, nb.n, at)
      end
    end
    local dyw = self:matmul_operands(dyp, st.w_out)
    local hw = self:matmul_operands(self.h, st.w_out)
    gemm_backward(dh:view(0, { R, H }), st.g_out, dyw:view(0, { R, C }), hw:view(0, { R, H }),
                  st.w_out, off, 2)
    local dg = half and self:scratch({ 1, rows, H }, half) or dh
    ops.swiglu_backward(dg, dup, dh, self.gate, self.up)
    local dhw = self:matmul_operands(dg, st.w_in)
    local xw = self:matmul_operands(self.xp, st.w_in)
    gemm_backward(dxp:view(0, { R, C }), st.g_in, dhw:view(0, { R, H }), xw:view(0, { R, C }),
                  st.w_in, off, 0)
    local duw = self:matmul_operands(dup, st.w_in)
    gemm_backward(dxu:view(0, { R, C }), st.g_in, duw:view(0, { R, H }), xw:view(0, { R, C }),
                  st.w_in, off, 1)
    ops.add(dxp, dxp, dxu)
    free_stacked(st)
  elseif write then
    for _, g in pairs(self.g) do g:zero() end
  end
  for e = 1, st and 0 or self.n_experts do
    local runs = runs_of(ex, route, e)
    self:run_unit(e, true, function()
      for _, run in ipairs(runs) do
        local n, at = run.n, run.at
        if n > 0 then
          local u = self.units[e]
          local k, p, g = u.keys, u.module.p, u.module.g
          local dhe, due = dh:view(at * H, { 1, n, H }), dup:view(at * H, { 1, n, H })
          local dye, w2 = self:matmul_operands(dyp:view(at * C, { 1, n, C }), p[k[3]])
          local hw = self:matmul_operands(self.h:view(at * H, { 1, n, H }), w2)
          local off = expert_rows(n, dyp:device_name())
          expert_backward(dhe, g[k[3]], dye, hw, w2, off)
          if u.lora then
            LoraExperts.down_backward(self, u, dyp:view(at * C, { 1, n, C }),
                                      self.h:view(at * H, { 1, n, H }), dhe, n)
          end
          ops.swiglu_backward(dhe, due, dhe, self.gate:view(at * H, { 1, n, H }),
                              self.up:view(at * H, { 1, n, H }))
          local xe = self.xp:view(at * C, { 1, n, C })
          local dge, w1 = self:matmul_operands(dhe, p[k[1]])
          local xw = self:matmul_operands(xe, w1)
          expert_backward(dxp:view(at * C, { 1, n, C }), g[k[1]], dge, xw, w1, off)
          local due_, w3 = self:matmul_operands(due, p[k[2]])
          expert_backward(dxu:view(at * C, { 1, n, C }), g[k[2]], due_, xw, w3, off)
          off:free()
          ops.add(dxp:view(at * C, { 1, n, C }), dxp:view(at * C, { 1, n, C }),
                  dxu:view(at * C, { 1, n, C }))
          if u.lora then
            LoraExperts.gate_up_backward(self, u, xe, dhe, due, dxp:view(at * C, { 1, n, C }), n)
          end
        end
      end
    end)
  end
  local dxo = dxp
  if ex then
    dxo = self:scratch({ 1, R, C })
    exchanged(ex, dxp, dxo, C, true)
  end
  local dx = self:scratch(dy:sizes())
  ops.moe_permute_backward(dx:view(0, { N, C }), dxo:view(0, { R, C }), route.row_of_slot)
  self.dweights = dweights
  return dx
end

-- For B x T tokens at most every row goes to an expert k times: the
-- block passes k as self.top_k before the model sizes its arenas. Under
-- expert parallelism over P ranks a rank's experts may get the rows of all
-- P ranks (Rm), in buffers beside this rank's own rows.
function Experts:own_memory(B, T, dtype)
  local N, C, H = B * T, self.n_embd, self.n_hidden
  local R = N * (self.top_k or 1)
  local P = self:ep_size()
  local Rm, X = P * R, P > 1 and 1 or 0
  local w = C * H
  local function cast(x, y)
    return Module.matmul_cast_bytes(x, w, dtype) + Module.matmul_cast_bytes(y, w, dtype)
  end
  -- (bf16 casts rows: at most E runs of rows, Rm rows in all, each cast
  -- rounded up; the forward's casts, 2C + H a row, live through the
  -- backward's, 2C + 3H a row: 4 (C + H) a row, and 8 roundings a run. The
  -- grouped GEMMs' rows come bf16 and cast nothing. An f16 weight is cast
  -- whole: each expert's three in the forward and again in the backward,
  -- 6 E weights, within the second form's 8 (E + 1) under expert parallelism)
  local casts = (P == 1 and dtype ~= "bf16") and 3 * self.n_experts * cast(R * C, R * H)
                or 4 * (self.n_experts * cast(C, H) + cast(Rm * C, Rm * H))
  return {
    input = lz.arena_bytes(N * C),
    activations = 2 * lz.arena_bytes(R * C) + 2 * X * lz.arena_bytes(Rm * C) +
                  3 * lz.arena_bytes(Rm * H) + lz.arena_bytes(N * C),
    scratch = lz.arena_bytes(R * C) + 2 * lz.arena_bytes(Rm * C) +
              X * (lz.arena_bytes(Rm * C) + lz.arena_bytes(R * C)) + 2 * lz.arena_bytes(Rm * H) +
              lz.arena_bytes(N * C) + lz.arena_bytes(R),
    casts = casts,
  }
end

return Experts
