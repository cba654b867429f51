-- nn/model.lua — the base of a whole model: flat parameter and gradient
-- buffers, activation arenas sized from its modules' memory reports
-- (Module:memory), and the forward and backward through its layers, with or
-- without activation checkpointing.
--
-- A model lists its layers in self.layers when it is built:
--   stem    modules run before the blocks (an embedding)
--   blocks  the repeated blocks; with checkpointing each keeps only its input
--   top     modules run after the blocks (a final LayerNorm)
--   output  the last module (an LM head); its output (the logits) shares
--           memory with a block's replay under checkpointing
-- Whatever the model allocates itself (its loss) it reports in own_memory.
--
-- Arenas without checkpointing: one activation arena (ctx.arena) for the
-- whole forward, two scratch arenas taking turns in backward (each sized
-- for the layer needing the most), a cast arena (bf16/fp16) for one forward
-- and backward.
-- With checkpointing: the model's arena keeps the stem's and top's
-- activations, the model's own, a copy of the last block's output and the
-- top's and output's input gradients (and the kept block inputs, by
-- default); one shared region holds a block's activations (forward, then its
-- replay) with the two scratch arenas, and, over the same bytes, the
-- output's activations, dead before the first replay; the blocks' casts go
-- to an arena sized for one block, reset for each.
local ffi = require("ffi")
local bit = require("bit")
local lz = require("luazero")
local Module = require("luazero.nn.module")
local checkpoint = require("luazero.nn.checkpoint")
local clock = require("luazero.clock")
local rng = require("luazero.rng")

local Model = Module:extend("Model")

----------------------------------------------------------------- buffers

-- The device the model computes on: ctx.device ("cpu" unless an engine or
-- a script places it on "sim" or "cuda"). Its parameters, gradients and
-- activations live there; batches come from host memory.
function Model:device() return self.ctx.device or "cpu" end

-- One flat fp32 buffer for the parameters and one for their gradients; every
-- parameter is a view at its offset in the parameter table.
function Model:allocate()
  self.params_flat = lz.tensor({ self.n_params }, "f32", "params", self:device())
  self.grads_flat = lz.tensor({ self.n_params }, "f32", "grads", self:device())
  self:bind(self.param_table, self.params_flat, self.grads_flat)
  return self
end

function Model:zero_grad() self.grads_flat:zero() end

-- Every parameter as its init spec says, deterministic for a seed: one
-- generator walks the table in canonical order (drawn on the host, then
-- copied where a parameter lives on a device); a keyed init has its own
-- (Module.init_rng) and takes nothing from the walk's.
function Model:draw_params(seed)
  local r = rng.new(seed, 1)
  for _, e in ipairs(self.param_table) do
    local t = e.module.p[e.key]
    local host = t:device_name() ~= "cpu" and lz.tensor(t:sizes(), "f32", "workspace")
    Module.fill_init(e.init, ffi.cast("float *", (host or t).data), e.numel,
                     Module.init_rng(e, seed, r))
    if host then
      t:copy(host)
      host:free()
    end
  end
  return self
end

-- The same numbers as draw_params, streamed: sink(e, a, t) gets elements
-- [a, a + n) of parameter e (canonical order) in an f32 host tensor t of
-- at most `chunk` elements, valid during the call, so no buffer the size of
-- the model is made. Chunks are even (each normal pair stays whole);
-- elements from self:zero_from(e) on are zero (padding rows).
function Model:draw_stream(seed, sink, chunk)
  local largest = 2
  for _, e in ipairs(self.param_table) do largest = math.max(largest, e.numel) end
  chunk = math.max(2, math.floor(math.min(chunk or 2 ^ 22, largest + 1) / 2) * 2)
  local r = rng.new(seed, 1)
  local buf = lz.tensor({ chunk }, "f32", "workspace")
  local ptr = ffi.cast("float *", buf.data)
  local ok, err = pcall(function()
    for _, e in ipairs(self.param_table) do
      local zero_from = self:zero_from(e) or e.numel
      local g = Module.init_rng(e, seed, r)
      for a = 0, e.numel - 1, chunk do
        local n = math.min(chunk, e.numel - a)
        Module.fill_init(e.init, ptr, n, g)
        for i = math.max(zero_from - a, 0), n - 1 do ptr[i] = 0 end
        local t = buf:view(0, { n })
        sink(e, a, t)
        t:free()
      end
    end
  end)
  buf:free()
  if not ok then error(err, 0) end
end

-- Where a parameter's padding starts (draw_stream zeroes from there): none
-- by default.
function Model.zero_from() return nil end

function Model:free()
  self:release_arenas()
  if self.params_flat then self.params_flat:free() end
  if self.grads_flat then self.grads_flat:free() end
  self.params_flat, self.grads_flat = nil, nil
end

------------------------------------------------------------------ sizes

local sum = Module.sum_memory

local function most(reports, key)
  local n = 0
  for _, m in ipairs(reports) do n = math.max(n, m[key]) end
  return n
end

local function reports(modules, B, T, dtype)
  local out = {}
  for i, m in ipairs(modules) do out[i] = m:memory(B, T, dtype) end
  return out
end

-- The arenas this model takes for micro-batches of B x T under working dtype
-- `dtype` ("f32", "bf16", "f16"), in bytes, for its checkpointing setting:
--   without: arena, scratch (each of two), casts
--   with:    main (the model's arena, kept inputs included when they live
--            there), kept (one kept input), block, scratch, logits, shared,
--            casts, block_casts, store (the kept inputs' own buffer, if any,
--            in category store_category)
-- activations: the bytes on the ledger's activations category, offload
-- those on its offload category (kept inputs under cpu_checkpointing).
function Model:arena_plan(B, T, dtype)
  dtype = dtype or "f32"
  local L = self.layers
  local stem, top = reports(L.stem, B, T, dtype), reports(L.top, B, T, dtype)
  local blocks = reports(L.blocks, B, T, dtype)
  local out = L.output:memory(B, T, dtype)
  local own = self:own_memory(B, T, dtype)
  local before, after = sum(stem), sum(top)
  local n_blocks = #blocks
  local ck = self.checkpointing
  if not ck then
    local all = sum({ before, sum(blocks), after, out })
    local p = {
      arena = all.activations + (own.activations or 0),
      -- backward resets a scratch arena before each layer of each list
      scratch = math.max(most(stem, "scratch"), most(blocks, "scratch"),
                         most(top, "scratch"), out.scratch),
      casts = all.casts,
    }
    p.activations, p.offload = p.arena + 2 * p.scratch + p.casts, 0
    return p
  end
  local kept = most(blocks, "input")
  local p = {
    kept = kept, n_kept = n_blocks,
    main = before.activations + (after.input or out.input) + after.activations +
           (own.activations or 0) + before.scratch + after.scratch + out.scratch,
    block = most(blocks, "activations"), scratch = most(blocks, "scratch"),
    logits = out.activations,
    casts = before.casts + after.casts + out.casts,
    block_casts = most(blocks, "casts"),
  }
  p.shared = math.max(p.logits, p.block + 2 * p.scratch)
  local store_bytes, category = checkpoint.store_bytes(ck, n_blocks, kept)
  if category then
    p.store, p.store_category = store_bytes, category
  else
    p.main = p.main + store_bytes
  end
  p.activations = p.main + p.shared + p.casts + p.block_casts
  p.offload = 0
  if category == "offload" then p.offload = store_bytes
  elseif category then p.activations = p.activations + store_bytes end
  return p
end

-- Bytes of the cast arena a ZeRO engine gives a bf16/fp16 model (with
-- checkpointing: all but the blocks' casts, which get an arena of their own).
function Model:cast_arena_size(B, T, dtype)
  return self:arena_plan(B, T, dtype).casts
end

---------------------------------------------------------------- arenas

-- Activation checkpointing: opts is the activation_checkpointing settings
-- (luazero.config's normalised block; absent keys are off, as every one of
-- DeepSpeed's defaults is), true for those defaults, or false to turn it
-- off. Each block then keeps only its input during forward and replays its
-- forward just before its backward (bitwise the same activations, so
-- bitwise the same gradients). Re-sizes prepared arenas.
function Model:checkpoint_activations(opts)
  if opts == true then opts = {} end
  if opts then checkpoint.check(opts, #self.layers.blocks) end
  self.checkpointing = opts or nil
  local shape = self.prepared_shape
  self:release_arenas()
  if shape then self:prepare(shape[1], shape[2]) end
  return self
end

-- Sizes the arenas for micro-batches of B sequences of T tokens (and anything
-- smaller), casts for ctx.cast_dtype. Reallocates only when B x T grows.
function Model:prepare(B, T)
  if self.prepared and B * T <= self.prepared then return self end
  self:release_arenas()
  local ctx, dev = self.ctx, self:device()
  local plan = self:arena_plan(B, T, ctx.cast_dtype)
  if self.checkpointing then
    self:prepare_checkpointing(plan)
  else
    ctx.arena = lz.arena(plan.arena, "activations", dev)
    ctx.scratches = { lz.arena(plan.scratch, "activations", dev),
                      lz.arena(plan.scratch, "activations", dev) }
  end
  if dev ~= "cpu" then
    -- Where each batch's tokens and targets land on the device, and the
    -- host copy of the per-position losses.
    self.inputs = lz.tensor({ 2 * B * T }, "i32", "activations", dev)
    self.host_losses = lz.tensor({ B * T }, "f32", "workspace")
  end
  self.prepared, self.prepared_shape = B * T, { B, T }
  return self
end

-- The arenas of a checkpointing plan: the model's arena, the kept inputs
-- (nn/checkpoint.lua), and the shared region carved into the block arena,
-- the two scratch arenas and (over the same bytes) the output's arena.
function Model:prepare_checkpointing(plan)
  local ctx, dev = self.ctx, self:device()
  local main = lz.arena(plan.main, "activations", dev)
  local store = checkpoint.store(self.checkpointing, plan.n_kept, plan.kept, main, dev)
  local shared = lz.tensor({ plan.shared / 4 }, "f32", "activations", dev)
  local ck = {
    main = main, store = store, shared = shared,
    block = lz.arena_over(shared, 0, plan.block),
    head = lz.arena_over(shared, 0, plan.logits),
    block_cast_bytes = plan.block_casts,
  }
  ctx.scratches = { lz.arena_over(shared, plan.block, plan.scratch),
                    lz.arena_over(shared, plan.block + plan.scratch, plan.scratch) }
  ctx.arena, self.ckpt = main, ck
  ctx.checkpoint_profile = self.checkpointing.profile and
                           { forward = 0, recompute = 0, backward = 0 } or nil
end

function Model:release_arenas()
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
  if self.inputs then self.inputs:free(); self.host_losses:free() end
  if self.extra_inputs then self.extra_inputs:free() end
  self.inputs, self.host_losses, self.extra_inputs = nil, nil, nil
  ctx.arena, ctx.scratches, ctx.scratch, self.prepared = nil, nil, nil, nil
  self.prepared_shape = nil
end

------------------------------------------------------- forward, backward

-- Called first by a model's forward on a [B, T] batch: the arenas must be
-- prepared for it; resets them (one forward per micro-step).
function Model:begin_forward(B, T)
  local ctx = self.ctx
  if not ctx.arena then
    error("model: no batch shape yet: call model:prepare(B, T) before forward (an engine: " ..
          "zero.initialize{..., batch = {B, T}}, or engine:prepare(B, T))", 3)
  end
  if B * T > self.prepared then
    error(("model: a batch of %d x %d tokens does not fit the activation arena, sized for " ..
           "%d tokens: call model:prepare(%d, %d) first (an engine: engine:prepare(%d, %d), or " ..
           "batch = {%d, %d} to zero.initialize)"):format(B, T, self.prepared, B, T, B, T, B, T),
          3)
  end
  if self.ckpt then self:restore_arenas() end
  ctx.arena:reset()
  if ctx.cast_arena then ctx.cast_arena:reset() end
end

-- A batch for a token model, checked before anything runs: tokens i32
-- [B, T], targets nil or the same. A model fed something else overrides it.
function Model:check_batch(tokens, targets)
  local ok = lz.is_tensor(tokens) and tokens.ndim == 2 and tokens:dtype_name() == "i32"
  if ok and targets ~= nil then
    ok = lz.is_tensor(targets) and targets.ndim == 2 and targets:dtype_name() == "i32" and
         targets:dim(1) == tokens:dim(1) and targets:dim(2) == tokens:dim(2)
  end
  if not ok then
    error(("model: a batch must be tokens and targets, i32 tensors of the same shape [B, T] " ..
           "(got %s and %s); reshape them with t:view(0, {B, T})")
          :format(tostring(tokens), tostring(targets)), 0)
  end
end

-- extra.pos and extra.seg (packed documents: a position and a document id
-- per token) and extra.mask (0 on padding) must be i32 tensors shaped as
-- the tokens; the mask is read on the host.
local function check_extra(tokens, extra)
  for _, key in ipairs({ "pos", "seg", "mask" }) do
    local t = extra[key]
    if t ~= nil and (type(t) ~= "cdata" or t:dtype_name() ~= "i32" or t.ndim ~= 2 or
                     t:dim(1) ~= tokens:dim(1) or t:dim(2) ~= tokens:dim(2)) then
      error(("model: extra.%s must be an i32 tensor [%d, %d] like the tokens (got %s)"):format(
            key, tokens:dim(1), tokens:dim(2), tostring(t)), 0)
    end
  end
  if extra.mask ~= nil and extra.mask:device_name() ~= "cpu" then
    error(("model: extra.mask must be in host memory (got a tensor on %s); make it with " ..
           "lz.tensor({B, T}, \"i32\")"):format(extra.mask:device_name()), 0)
  end
end

-- A batch's tokens and targets (host i32 [B, T]; targets may be nil) and
-- its extra (nil, or { pos =, seg =, mask = } of host i32 [B, T]) where the
-- model computes: themselves on the cpu, copies on a device (the mask stays
-- on the host, where the routers' loss reads it).
function Model:place_inputs(tokens, targets, extra)
  if extra then check_extra(tokens, extra) end
  if not self.inputs or tokens:device_name() ~= "cpu" then return tokens, targets, extra end
  local B, T = tokens:dim(1), tokens:dim(2)
  local x = self.inputs:view(0, { B, T }):copy(tokens)
  local y = targets and self.inputs:view(B * T, { B, T }):copy(targets)
  if not extra then return x, y end
  -- Made at the first batch that has them, so plain runs hold no more memory.
  if not self.extra_inputs then
    self.extra_inputs = lz.tensor({ 2 * self.prepared }, "i32", "activations", self:device())
  end
  local placed = {
    pos = extra.pos and self.extra_inputs:view(0, { B, T }):copy(extra.pos),
    seg = extra.seg and self.extra_inputs:view(B * T, { B, T }):copy(extra.seg),
    mask = extra.mask,
  }
  return x, y, placed
end

-- The sum of an f32 tensor's elements, added on the host in order.
function Model:host_sum(t)
  if t:device_name() ~= "cpu" then t = self.host_losses:view(0, t:sizes()):copy(t) end
  local p, sum = ffi.cast("float *", t.data), 0
  local u = ffi.cast("uint32_t *", t.data)
  for i = 0, t:numel() - 1 do
    -- A NaN with a payload widens to a double LuaJIT reads as another type:
    -- count it as the NaN it is.
    if bit.band(u[i], 0x7f800000) == 0x7f800000 and bit.band(u[i], 0x7fffff) ~= 0 then
      sum = 0 / 0
    else
      sum = sum + p[i]
    end
  end
  return sum
end

-- Runs the layers on x; returns the output module's output. Afterwards
-- ctx.arena is the model's arena again.
function Model:forward_layers(x)
  local ctx, L, ck = self.ctx, self.layers, self.ckpt
  for _, m in ipairs(L.stem) do x = self:run_forward(m, x) end
  if ck then
    ck.store:reset()
    for i, b in ipairs(L.blocks) do x = self:checkpointed_forward(i, b, x) end
    x = ctx.arena:tensor(x:sizes()):copy(x) -- the top keeps its input
    for _, m in ipairs(L.top) do x = self:run_forward(m, x) end
    ck.head:reset()
    ctx.arena = ck.head
    x = self:run_forward(L.output, x)
    ctx.arena = ck.main
    return x
  end
  for _, b in ipairs(L.blocks) do x = self:run_forward(b, x) end
  for _, m in ipairs(L.top) do x = self:run_forward(m, x) end
  return self:run_forward(L.output, x)
end

-- Backward from dy, the gradient of the output's output; parameter
-- gradients accumulate into the flat gradient buffer.
function Model:backward_layers(dy)
  local ctx, L, ck = self.ctx, self.layers, self.ckpt
  local turn = 0
  local function next_scratch()
    turn = turn % 2 + 1
    ctx.scratch = ctx.scratches[turn]
    ctx.scratch:reset()
  end
  local d = dy
  if ck then
    -- The output lives in the shared region until its backward: its and the
    -- top's input gradients come from the model's arena.
    ctx.scratch = ck.main
    d = self:run_backward(L.output, d)
    for i = #L.top, 1, -1 do d = self:run_backward(L.top[i], d) end
    for i = #L.blocks, 1, -1 do
      self:enter_block()
      next_scratch()
      d = self:run_checkpointed_backward(L.blocks[i], ck.store:kept(i), d)
      self:restore_arenas()
    end
    ctx.scratch = ck.main
    for i = #L.stem, 1, -1 do d = self:run_backward(L.stem[i], d) end
  else
    next_scratch()
    d = self:run_backward(L.output, d)
    for i = #L.top, 1, -1 do next_scratch(); d = self:run_backward(L.top[i], d) end
    for i = #L.blocks, 1, -1 do next_scratch(); d = self:run_backward(L.blocks[i], d) end
    for i = #L.stem, 1, -1 do next_scratch(); d = self:run_backward(L.stem[i], d) end
  end
  ctx.scratch = nil
  return d
end

-------------------------------------------------- activation checkpointing

-- Where a block's activations and casts go while it runs (forward or
-- replay): the block arena and, when the engine casts (bf16/fp16), the
-- block cast arena, both reset for each block.
function Model:enter_block()
  local ctx, ck = self.ctx, self.ckpt
  ck.block:reset()
  ctx.arena = ck.block
  if ctx.cast_arena then
    if not ck.block_casts then
      ck.block_casts = lz.arena(ck.block_cast_bytes, "activations", self:device())
    end
    ck.casts = ctx.cast_arena
    ck.block_casts:reset()
    ctx.cast_arena = ck.block_casts
  end
end

function Model:restore_arenas()
  local ctx, ck = self.ctx, self.ckpt
  ctx.arena = ck.main
  if ck.casts and ctx.cast_arena == ck.block_casts then ctx.cast_arena = ck.casts end
end

-- Block i's forward from a kept copy of its input; its activations are
-- dropped when the next block starts. Returns the output (valid until then).
function Model:checkpointed_forward(i, block, x)
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
function Model:checkpoint_profile(reset)
  local prof = self.ctx.checkpoint_profile
  if not prof then return nil end
  local ms = { forward = prof.forward * 1e3, recompute = prof.recompute * 1e3,
               backward = prof.backward * 1e3 }
  if reset then prof.forward, prof.recompute, prof.backward = 0, 0, 0 end
  return ms
end

return Model
