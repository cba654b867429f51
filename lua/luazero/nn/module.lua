-- nn/module.lua — the Module base class (Torch7 nn style, no autograd tape).
--
-- A module declares its parameters (shape, initialisation, weight-decay group)
-- when it is built, but owns no memory for them: the model lays every
-- parameter of the tree out in one flat fp32 buffer (and one flat gradient
-- buffer) in canonical order and binds views into them (module.p.<key>,
-- module.g.<key>). A ZeRO engine can bind the same parameter table to
-- gathered or partitioned buffers instead, without touching the modules.
--
-- forward(x) saves what backward needs and returns its output from the
-- activation arena (ctx.arena, reset every micro-step). backward(dy)
-- ACCUMULATES parameter gradients into module.g and returns dx, allocated in
-- ctx.scratch (backward scratch, which a model may reset between blocks).
--
-- Containers run their children through Module:run_forward/run_backward,
-- which call the hooks registered on the shared context around each child:
-- the points where a ZeRO-3 engine gathers parameters before a module runs
-- and releases them / reduce-scatters their gradients after.
--
-- Activation checkpointing: a container may drop a child's activations
-- after its forward and run it through Module:run_checkpointed_backward,
-- which replays the child's forward from its kept input, then runs its
-- backward. The replay calls no forward hooks (it is not a new pass);
-- pre_recompute/post_recompute hooks bracket replay and backward together.
local lz = require("luazero")
local clock = require("luazero.clock")

local Module = {}
Module.__index = Module

-- Subclassing: local Linear = Module:extend("Linear").
function Module:extend(name)
  local cls = setmetatable({}, { __index = self })
  cls.__index = cls
  cls.__name = name
  cls.__tostring = function(m) return name .. "(" .. (m.path or "?") .. ")" end
  return cls
end

-- Fields every module has; subclasses call this first in their constructor.
function Module:init()
  self.params = {}   -- ordered parameter specs: {key, name, shape, numel, init, decay}
  self.children = {} -- ordered {name, module}
  self.p, self.g = {}, {}
  self.training = true
  return self
end

-- Declares a parameter. key: the field in module.p/module.g; name: the last
-- part of its stable name (defaults to key). init: {kind = "normal", std =
-- 0.02} | {kind = "zeros"} | {kind = "ones"}. decay: whether AdamW's weight
-- decay applies (2-D weights yes, biases and LayerNorm no).
function Module:param(key, shape, init, decay, name)
  local numel = 1
  for _, s in ipairs(shape) do numel = numel * s end
  self.params[#self.params + 1] = {
    key = key, name = name or key, shape = shape, numel = numel, init = init,
    decay = decay and true or false,
  }
end

-- name false: the child's parameters sit directly in this module's namespace.
function Module:add(name, child)
  self.children[#self.children + 1] = { name = name, module = child }
  if name then self[name] = child end
  return child
end

local function join(prefix, name)
  if not name or name == "" then return prefix end
  if prefix == "" then return name end
  return prefix .. "." .. name
end

-- Visits this module and its descendants depth first, own parameters before
-- children's: that is the canonical order of the parameter table.
function Module:walk(fn, prefix)
  prefix = prefix or ""
  self.path = prefix
  fn(self, prefix)
  for _, c in ipairs(self.children) do c.module:walk(fn, join(prefix, c.name)) end
end

-- The parameter table: { {name, shape, numel, offset, decay, init, module,
-- key}, ... } in canonical order, offsets in elements into the flat buffer.
function Module:parameter_table()
  local table_, offset = {}, 0
  self:walk(function(m, prefix)
    for _, spec in ipairs(m.params) do
      table_[#table_ + 1] = {
        name = join(prefix, spec.name), shape = spec.shape, numel = spec.numel,
        offset = offset, decay = spec.decay, init = spec.init, module = m, key = spec.key,
      }
      offset = offset + spec.numel
    end
  end)
  return table_, offset
end

-- Points every module's p/g at views of the flat buffers (grads may be nil,
-- e.g. for inference).
function Module:bind(entries, params_flat, grads_flat)
  for _, e in ipairs(entries) do
    e.module.p[e.key] = params_flat:view(e.offset, e.shape)
    if grads_flat then e.module.g[e.key] = grads_flat:view(e.offset, e.shape) end
  end
end

-- Fills n floats at ptr (host memory) as an init spec says (see param):
-- normal draws from generator r, ones and zeros need none.
function Module.fill_init(init, ptr, n, r)
  local kind = init and init.kind or "zeros"
  if kind == "normal" then
    r:fill_normal(ptr, n, init.std)
  else
    local v = kind == "ones" and 1 or 0
    for i = 0, n - 1 do ptr[i] = v end
  end
end

-- The generator parameter e draws from: `walk` (the one shared along the
-- table), or, where its init is keyed (init.keyed), its own, whose numbers
-- depend on the seed and e's full name alone, not on its place in the
-- table (an expert's adapters sit at other places under gather "block" and
-- "expert": nn/lora_experts.lua). draw_params, draw_stream and hf.lua's
-- drawn adapters take it.
function Module.init_rng(e, seed, walk)
  if not (e.init and e.init.keyed) then return walk end
  local rng = require("luazero.rng")
  return rng.new(lz.C.lz_hash_xxh64(e.name, #e.name, rng.keyed(seed, 6)), 6)
end

-- Freezes the parameters whose full name matches `what` (a Lua pattern,
-- or a function of the name returning true): they get no gradients, no
-- optimizer states and no gradient communication, and stay exactly as they
-- are. Call it on the whole model before the engine is built. Returns how
-- many were frozen; naming none is an error.
function Module:freeze(what)
  local match = type(what) == "function" and what or function(name) return name:find(what) end
  local table_ = self.param_table or self:parameter_table()
  local n = 0
  for _, e in ipairs(table_) do
    if not e.frozen and match(e.name) then
      e.frozen = true
      e.module.frozen = e.module.frozen or {}
      e.module.frozen[e.key] = true
      n = n + 1
    end
  end
  if n == 0 and type(what) ~= "function" then
    error(("freeze: no parameter name matches %q (names look like %s)")
          :format(tostring(what), table_[1] and table_[1].name or "?"), 2)
  end
  return n
end

-- The parameters that train (not frozen), with offsets renumbered over
-- them alone: the table an engine lays out and checkpoints save.
function Module:trainable_table()
  local out, offset = {}, 0
  for _, e in ipairs(self.param_table or self:parameter_table()) do
    if not e.frozen then
      local c = {}
      for k, v in pairs(e) do c[k] = v end
      c.offset = offset
      out[#out + 1] = c
      offset = offset + e.numel
    end
  end
  return out, offset
end

-- Whether backward writes every gradient of this module's own parameters
-- in one kernel call when self.grads_write is set (a Linear's weight and
-- bias; nn/linear.lua), so a ZeRO engine may hand it gradients holding no
-- zeros on the first micro-step of an accumulation. The others add into
-- zeroed gradients.
function Module:writes_grads() return false end

-- Where a kernel that must write a gradient accumulates a frozen
-- parameter's: a scratch of the model's (ctx.sinks), never read.
function Module:grad_or_sink(key)
  local g = self.g[key]
  if g then return g end
  local p = self.p[key]
  local sinks = self.ctx.sinks or {}
  self.ctx.sinks = sinks
  local n, dev = p:numel(), p:device_name()
  local id = dev .. ":" .. n
  if not sinks[id] then sinks[id] = lz.tensor({ n }, "f32", "workspace", dev) end
  return sinks[id]:view(0, p:sizes())
end

-- Puts `new` where the child `old` was: the same place among the children
-- (the same name) and every field of this module that held `old`.
function Module:replace(old, new)
  local found = false
  for _, c in ipairs(self.children) do
    if c.module == old then c.module, found = new, true end
  end
  assert(found, "nn: replace: not a child of this module")
  for k, v in pairs(self) do
    if v == old then self[k] = new end
  end
  return new
end

-- The context shared by a whole model: arena, scratch, hooks.
function Module:set_context(ctx)
  self:walk(function(m) m.ctx = ctx end)
end

function Module:train()
  self:walk(function(m) m.training = true end)
end

function Module:evaluate()
  self:walk(function(m) m.training = false end)
end

------------------------------------------------------------------- hooks

local hook_kinds = { pre_forward = true, post_forward = true, pre_backward = true,
                     post_backward = true, pre_recompute = true, post_recompute = true }

-- fn(module) runs around every child a container runs (not the root itself);
-- pre_recompute/post_recompute around a checkpointed child's replayed
-- forward and the backward that follows it.
function Module:register_hook(kind, fn)
  assert(hook_kinds[kind], "nn: hook kind must be pre_forward, post_forward, pre_backward, "
         .. "post_backward, pre_recompute or post_recompute (got " .. tostring(kind) .. ")")
  local ctx = assert(self.ctx, "nn: set_context before registering hooks")
  ctx.hooks = ctx.hooks or {}
  local list = ctx.hooks[kind] or {}
  ctx.hooks[kind] = list
  list[#list + 1] = fn
end

local function run_hooks(ctx, kind, m)
  local list = ctx.hooks and ctx.hooks[kind]
  if list then for i = 1, #list do list[i](m) end end
end

function Module:run_forward(child, ...)
  local ctx = self.ctx
  if ctx.recomputing then return child:forward(...) end
  run_hooks(ctx, "pre_forward", child)
  local out = child:forward(...)
  run_hooks(ctx, "post_forward", child)
  return out
end

function Module:run_backward(child, dy, ...)
  local ctx = self.ctx
  run_hooks(ctx, "pre_backward", child)
  local dx = child:backward(dy, ...)
  run_hooks(ctx, "post_backward", child)
  return dx
end

-- Replays child:forward(x) (x: the input kept by the checkpointed forward;
-- the same kernels on the same bits give the same activations), then runs
-- its backward with dy. The caller points ctx.arena where the replayed
-- activations may go.
-- ctx.checkpoint_profile, when set, sums the seconds of replays and of the
-- backwards after them (activation_checkpointing.profile).
function Module:run_checkpointed_backward(child, x, dy)
  local ctx = self.ctx
  local prof = ctx.checkpoint_profile
  run_hooks(ctx, "pre_recompute", child)
  local t0 = prof and clock.now()
  ctx.recomputing = true
  local ok, err = pcall(child.forward, child, x)
  ctx.recomputing = false
  if not ok then error(err, 0) end
  local t1 = prof and clock.now()
  local dx = self:run_backward(child, dy)
  if prof then
    prof.recompute = prof.recompute + (t1 - t0)
    prof.backward = prof.backward + (clock.now() - t1)
  end
  run_hooks(ctx, "post_recompute", child)
  return dx
end

------------------------------------------------------------- allocation

local F32, BF16 = 0, 1 -- lz_dtype values

-- Mixed precision: t in `dtype` ("f32" or "bf16"). A tensor already in
-- that dtype comes back as is; otherwise a converted copy from ctx.cast_arena
-- (the engine sizes it for bf16/fp16 working parameters and resets it with
-- each forward). Without a cast arena nothing is converted.
function Module:cast(t, dtype)
  if t == nil then return nil end
  local want = dtype == "bf16" and BF16 or F32
  if tonumber(t.dtype) == want then return t end
  local arena = assert(self.ctx.cast_arena, "nn: a bf16/f16 parameter needs ctx.cast_arena")
  local c = arena:tensor(t:sizes(), dtype)
  return c:copy(t)
end

-- A table read by rows (an embedding): a bf16 one as is, since the lookup
-- widens only the rows it reads (exactly); any other dtype as f32.
function Module:table_operand(t)
  if t ~= nil and tonumber(t.dtype) == BF16 then return t end
  return self:cast(t, "f32")
end

-- A weight and input ready for a matmul: both bf16 when the weight is bf16
-- (oneDNN, fp32 accumulation), else both f32 (an f16 weight computes in
-- f32: this CPU has no f16 GEMM). An input that came bf16 (a producer that
-- writes its GEMM operand directly) is used as is, or widened (exactly).
function Module:matmul_operands(x, w)
  if tonumber(w.dtype) == BF16 then return self:cast(x, "bf16"), w end
  return self:cast(x, "f32"), self:cast(w, "f32")
end

-- How many bf16 copies of its forward input this module makes for matmuls,
-- when that input is the only thing it reads it for (0: it reads it
-- otherwise too, or not at all). A producer whose output this module takes
-- writes it in bf16 directly under bf16 training when this is above 0: the
-- copies then cost no cast pass and no bytes of their own.
function Module:gemm_input() return 0 end

-- Whether a producer writes its output for `consumer` in bf16 directly:
-- bf16 training (the cast arena holds the copy, for as long as a cast would
-- live) and a consumer that only multiplies it.
function Module:writes_bf16_for(consumer)
  local ctx = self.ctx
  return consumer ~= nil and ctx.cast_dtype == "bf16" and ctx.cast_arena ~= nil and
         consumer:gemm_input() > 0
end

-- A producer's output of `shape` for `consumer`: bf16 in the cast arena
-- (writes_bf16_for), else an f32 activation.
function Module:output_for(consumer, shape)
  if self:writes_bf16_for(consumer) then return self.ctx.cast_arena:tensor(shape, "bf16") end
  return self:activation(shape)
end

-- A gradient of `shape` flowing back into `consumer` (a Linear: its
-- backward multiplies it only): bf16 in the cast arena under bf16 training,
-- where the consumer would have cast it, else f32 scratch.
function Module:grad_for(consumer, shape)
  if self:writes_bf16_for(consumer) then return self.ctx.cast_arena:tensor(shape, "bf16") end
  return self:scratch(shape)
end

-- Memory of a producer's output of n elements for `consumer` under working
-- dtype `dtype`: { activations, casts } bytes. Written bf16, it takes the
-- cast arena's bytes one copy takes and saves the consumer's copies.
function Module.output_bytes_for(consumer, n, dtype)
  local copies = consumer and consumer:gemm_input() or 0
  if dtype ~= "bf16" or copies == 0 then return lz.arena_bytes(n), 0 end
  return 0, lz.arena_bytes(n, "bf16") * (1 - copies)
end

------------------------------------------------------------------ memory

-- What one forward and backward on a batch of B x T positions take from the
-- model's arenas, in bytes, for working dtype `dtype` ("f32", "bf16",
-- "f16": the dtype of the parameters the modules see):
--   activations  forward outputs kept for backward (ctx.arena)
--   scratch      backward's tensors, input gradients included (ctx.scratch)
--   casts        converted copies (ctx.cast_arena)
--   input        the bytes of the input forward receives
-- Each tensor counts as the arena rounds it (lz.arena_bytes). A module
-- reports what it allocates itself in own_memory (same fields, absent ones
-- zero); memory adds its children's reports, and a container's input is its
-- first child's.
function Module:memory(B, T, dtype)
  dtype = dtype or "f32"
  local reports = { self:own_memory(B, T, dtype) }
  for _, c in ipairs(self.children) do reports[#reports + 1] = c.module:memory(B, T, dtype) end
  return Module.sum_memory(reports)
end

-- Reports added field by field; the input is the first one given.
function Module.sum_memory(reports)
  local r = { activations = 0, scratch = 0, casts = 0 }
  for _, m in ipairs(reports) do
    r.activations = r.activations + (m.activations or 0)
    r.scratch = r.scratch + (m.scratch or 0)
    r.casts = r.casts + (m.casts or 0)
    r.input = r.input or m.input
  end
  return r
end

function Module:own_memory() return {} end

-- Bytes of the copy cast(p, "f32") makes of a parameter of n elements
-- under working dtype `dtype` (none when the parameters are f32).
function Module.param_cast_bytes(n, dtype)
  return dtype == "f32" and 0 or lz.arena_bytes(n, "f32")
end

-- Bytes of the copy table_operand(p) makes of a table of n elements.
function Module.table_cast_bytes(n, dtype)
  return dtype == "bf16" and 0 or Module.param_cast_bytes(n, dtype)
end

-- Bytes of the copies matmul_operands makes for an input of x elements and
-- a weight of w elements under working dtype `dtype`.
function Module.matmul_cast_bytes(x, w, dtype)
  if dtype == "bf16" then return lz.arena_bytes(x, "bf16") end
  return Module.param_cast_bytes(w, dtype)
end

-- Activations of this micro-step (forward outputs, saved for backward).
function Module:activation(shape, dtype)
  return self.ctx.arena:tensor(shape, dtype)
end

-- Gradients flowing backward; dead once the previous module has used them.
function Module:scratch(shape, dtype)
  local ctx = self.ctx
  return (ctx.scratch or ctx.arena):tensor(shape, dtype)
end

return Module
