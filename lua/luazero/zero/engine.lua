-- zero/engine.lua — the ZeRO engine: luazero.zero.initialize{model=..., config=...}
-- returns an engine with forward, backward, step and train_batch, in the
-- spirit of deepspeed.initialize. What lives where is the
-- placement plan (zero/plan.lua), built once here and read everywhere
-- below; bf16/fp16 working copies over fp32 master weights, dynamic loss
-- scaling, gradient clipping with a global norm computed in a canonical
-- order, and the update by an optimizer object (luazero/optim/).
-- docs/zero.md describes the design.
--
--   local engine = zero.initialize{ model = gpt2.new(cfg), config = cfg_table,
--                                 seed = 1337, batch = {B, T}, lr = fn(step) }
--   local rec = engine:train_batch(loader)   -- one optimizer step
--   engine:params_checksum(); print(engine:plan())
local ffi = require("ffi")
local lz = require("luazero")
local config = require("luazero.config")
local optim = require("luazero.optim")
local layout = require("luazero.zero.layout")
local Placement = require("luazero.zero.plan")
local Pool = require("luazero.zero.pool")
local Scaler = require("luazero.zero.scaler")
local offload = require("luazero.zero.offload")
local clock = require("luazero.clock")

local ops = lz.ops

local M = {}
local Engine = {}
Engine.__index = Engine

local wdtypes = { fp32 = "f32", bf16 = "bf16", fp16 = "f16" }
local CHUNK = 65536
local at = Placement.offset

-- The settings the engine reads from a DeepSpeed config (normalised by
-- luazero.config, or a partial table in tests): what is absent takes the
-- defaults luazero.config holds, the one home of defaults.
local function settings(cfg)
  cfg = cfg or {}
  local zd = config.zero_defaults
  local z = cfg.zero_optimization or {}
  local fp16, bf16 = cfg.fp16 or {}, cfg.bf16 or {}
  local dtype = "fp32"
  if fp16.enabled then dtype = "fp16" elseif bf16.enabled then dtype = "bf16" end
  local function zget(k) if z[k] == nil then return zd[k] end return z[k] end
  local opt = cfg.optimizer or config.optimizer_default
  return {
    stage = zget("stage"),
    dtype = dtype,
    accum = cfg.gradient_accumulation_steps or 1,
    micro_batch = cfg.train_micro_batch_size_per_gpu,
    clip = cfg.gradient_clipping or config.gradient_clipping_default,
    optimizer = opt,
    lr = (opt.params or {}).lr or config.adam_defaults.lr,
    reduce_bucket = zget("reduce_bucket_size"),
    allgather_bucket = zget("allgather_bucket_size"),
    overlap = z.overlap_comm == true,
    prefetch = zget("stage3_prefetch_bucket_size"),
    persistence = zget("stage3_param_persistence_threshold"),
    max_live = zget("stage3_max_live_parameters"),
    fp16 = fp16,
    -- data_types.grad_accum_dtype: the dtype the gradients are kept in.
    grad_dtype = cfg.grad_accum_dtype or "fp32",
    offload_opt = z.offload_optimizer or config.offload_optimizer_defaults,
    offload_param = z.offload_param or config.offload_param_defaults,
    sub_group = zget("sub_group_size"),
    aio = cfg.aio,
  }
end
M.settings = settings

-- The placement plan a configuration gives (zero/plan.lua); states: the
-- optimizer class's per-element states.
function M.plan_of(s, device, states)
  return Placement.new{ stage = s.stage, dtype = s.dtype, grad_dtype = s.grad_dtype,
                        offload_optimizer = s.offload_opt.device,
                        offload_param = s.offload_param.device, device = device or "cpu",
                        accum = s.accum, optimizer_states = states }
end

-- opts: model (not allocated), config (normalised DeepSpeed table), seed,
-- batch {B, T} (sizes the activation arenas), lr (function of the 1-based
-- optimizer step; default: the config's constant lr), comm (default
-- luazero.comm), checkpoint_activations (true: the model keeps only each
-- block's input and replays its forward in backward, as the config's
-- activation_checkpointing block says), device ("cpu", "sim" or "cuda":
-- where the model computes and the plan's device tier lives; "cpu").
function M.initialize(opts)
  local model = assert(opts.model, "initialize: model is required")
  local s = settings(opts.config)
  local comm = opts.comm or require("luazero.comm")
  local W, rank = comm.size(), comm.rank()
  local optimizer = optim.new(s.optimizer)
  local device = opts.device or "cpu"
  local ok, P = pcall(M.plan_of, s, device, optimizer.states)
  if not ok then error("initialize: " .. tostring(P):gsub("^plan: ", ""), 0) end
  if device ~= "cpu" then lz.device_init(device) end
  model.ctx.device = device
  local self = setmetatable({
    model = model, s = s, comm = comm, world = W, rank = rank, P = P, stage = P.stage,
    dev = device, seed = opts.seed or 0,
    dtype = s.dtype, wdt = P.dtype, gdt = P.grad_dtype,
    lr = opts.lr or function() return s.lr end,
    micro = 0, optimizer_steps = 0, global_steps = 0, skipped_steps = 0, inflight = {},
    landing = {},
    loss_sum = 0, loss_count = 0,
  }, Engine)
  -- Gradients kept in the working dtype (data_types.grad_accum_dtype):
  -- the kernels still write fp32 module gradients into the staging buffer;
  -- it is rounded to gdt, reduced in gdt and added (in fp32, rounded back)
  -- into the gdt gradients. docs/zero.md, "Gradient dtype".
  assert(self.gdt == "f32" or self.gdt == self.wdt,
         "initialize: data_types.grad_accum_dtype must be fp32 or the working dtype")
  self.half_grads = self.gdt ~= "f32"
  self.optimizer = optimizer
  -- Frozen parameters (model:freeze) are not laid out: the engine keeps
  -- them whole in the working dtype, with no gradients and no states.
  self.ptable = model:trainable_table()
  self.frozen_entries = {}
  for _, e in ipairs(model.param_table) do
    if e.frozen then self.frozen_entries[#self.frozen_entries + 1] = e end
  end
  if #self.ptable == 0 then
    error("initialize: every parameter is frozen (model:freeze); leave some to train", 0)
  end
  self.L = layout.new(self.ptable, W)
  self.pool = Pool.new(device)
  -- Host staging for gradients copied off the device (host-tier optimizer).
  self.hpool = Pool.new(device == "cpu" and "cpu" or "pinned")
  self.scaler = Scaler.new(s.dtype == "fp16" and s.fp16 or nil)
  self:find_users()
  local ok, err = pcall(function()
    self:allocate()
    -- draw_weights false: the weights are loaded next (--init): nothing is
    -- drawn, and no whole-model buffer is made.
    if opts.draw_weights == false then
      self:zero_weights()
    else
      self:init_weights(opts.seed or 0)
    end
    self:build_calls()
    self:install_hooks()
    if opts.checkpoint_activations then
      model:checkpoint_activations((opts.config or {}).activation_checkpointing or true)
    end
    if opts.batch then self:prepare(opts.batch[1], opts.batch[2]) end
  end)
  if not ok then
    if tostring(err):find("out of device memory", 1, true) then
      error(self:out_of_memory(opts.batch), 0)
    end
    error(err, 0)
  end
  return self
end

-- The error when device memory runs out while the engine places its
-- buffers: what this configuration wants on the device per rank (model
-- states as the plan places them, and activations), the device's
-- capacity, and the first placement that fits (estimate.lua's rows).
function Engine:out_of_memory(batch)
  local estimate = require("luazero.estimate")
  local L, s = self.L, self.s
  local persistent = 0
  for _, seg in ipairs(L.segments) do
    if seg.numel <= s.persistence then persistent = persistent + seg.padded end
  end
  local acts = batch and estimate.activations(self.model, batch[1], batch[2], self.dtype).device
               or 0
  local function wants(stage, offload)
    local r = estimate.model_states(L.numel, self.world, stage, {
      dtype = self.dtype, offload = offload, device = "cuda",
      grads = self.half_grads and "working" or "fp32",
      layout = { full = L.full_numel, shard = L.shard_numel }, persistent = persistent })
    return r and r.device + acts
  end
  local offload = s.offload_opt.device ~= "none" and "cpu" or "none"
  if s.offload_param.device ~= "none" then offload = "cpu+param" end
  local want = wants(self.stage, offload)
  local cap = lz.device_capacity(self.dev)
  local mib = function(b) return ("%.1f MiB"):format(b / 2 ^ 20) end
  local names = { none = "", cpu = " with offload_optimizer", ["cpu+param"] =
                  " with offload_optimizer and offload_param" }
  local fit
  if cap then
    for _, c in ipairs({ { 1, "none" }, { 2, "none" }, { 3, "none" }, { 2, "cpu" }, { 3, "cpu" },
                         { 3, "cpu+param" } }) do
      local w = wants(c[1], c[2])
      if w and w < cap and (c[1] > self.stage or c[2] ~= "none") then
        fit = ("ZeRO stage %d%s (device: \"cpu\") wants %s and fits"):format(c[1], names[c[2]],
                                                                           mib(w))
        break
      end
    end
  end
  return ("initialize: %s: out of device memory: ZeRO stage %d%s with %s wants %s of device " ..
          "memory per rank (model states %s, activations %s)%s; %s"):format(
    self.dev, self.stage, names[offload], self.dtype, mib(want), mib(want - acts), mib(acts),
    cap and (", more than the device's %s"):format(mib(cap)) or "",
    fit or "no ZeRO stage or offload tier fits: use a smaller model or micro-batch, or more ranks")
end

-- The placement plan: print(engine:plan()) shows what lives where.
function Engine:plan() return self.P end

------------------------------------------------------------- layout, buffers

-- Which segments a module touches: its own, and a tied one (the LM head
-- reads the embedding's table).
function Engine:find_users()
  local L, model = self.L, self.model
  self.segs_of = {}
  local by_name = {}
  for _, e in ipairs(self.ptable) do by_name[e.name] = e end
  for _, seg in ipairs(L.segments) do
    seg.users = 1
    self.segs_of[seg.module] = { seg }
    -- This rank's slice of the segment, as a run (layout.shard_runs).
    seg.mine = { full_offset = seg.full_offset + self.rank * seg.slice,
                 shard_offset = seg.shard_offset, numel = seg.slice }
  end
  model:walk(function(m)
    if m.tied then
      local list = self.segs_of[m] or {}
      for _, name in pairs(m.tied) do
        local e = by_name[name]
        -- (a frozen table is whole on every rank: nothing to gather)
        if e then
          local seg = L.by_module[e.module]
          seg.users = seg.users + 1
          list[#list + 1] = seg
        end
      end
      self.segs_of[m] = list
    end
  end)
end

-- Binds module.p (or .g) views of one segment onto `buf` (its padded full
-- extent), or unbinds them (nil).
local function bind(field, seg, buf)
  for _, e in ipairs(seg.entries) do
    e.entry.module[field][e.entry.key] = buf and buf:view(e.seg_offset, e.shape) or nil
  end
end
local function bind_params(seg, buf) bind("p", seg, buf) end
local function bind_grads(seg, buf) bind("g", seg, buf) end

-- Elements of a buffer of this extent on this rank.
function Engine:numel(extent)
  if extent == "full" then return self.L.full_numel end
  if extent == "shard" then return self.L.shard_numel end
  return 0
end

-- A buffer of n elements for a state the plan puts on `tier`: device
-- memory under the state's ledger category, or host memory (pinned beside
-- an accelerator) under offload.
function Engine:buffer(n, dtype, name, tier)
  if tier == "host" then return offload.host({ n }, dtype, self.dev) end
  return lz.tensor({ n }, dtype, name, self.dev)
end

-- One buffer per state the plan keeps in memory: the working parameters
-- (self.work), the gradients (self.grads), the optimizer's fp32 master and
-- states (self.states: zero/offload.lua, resident or swapped to NVMe).
function Engine:allocate()
  local L, P, s = self.L, self.P, self.s
  local pp = P.params
  -- Frozen parameters: one whole buffer in the working dtype, on the device.
  local nf = 0
  for _, e in ipairs(self.frozen_entries) do nf = nf + e.numel end
  if nf > 0 then
    self.frozen = lz.tensor({ nf }, pp.dtype, "params", self.dev)
    local off = 0
    for _, e in ipairs(self.frozen_entries) do
      e.frozen_offset = off
      e.module.p[e.key] = self.frozen:view(off, e.shape)
      e.module.g[e.key] = nil
      off = off + e.numel
    end
  end
  if pp.tier == "nvme" then
    local op = s.offload_param
    self.pshard = offload.param_shard{ n = self:numel(pp.extent), dtype = pp.dtype,
                                       nvme_path = op.nvme_path, aio = s.aio,
                                       buffer_count = op.buffer_count, compute = self.dev }
    -- DeepSpeed's offload_param.buffer_size: the largest parameter slice
    -- held at once must fit.
    for _, seg in ipairs(L.segments) do
      if op.buffer_size and seg.slice > op.buffer_size then
        error(("initialize: zero_optimization.offload_param.buffer_size %d is smaller than " ..
               "%s's slice of %d elements; raise it to at least %d")
              :format(op.buffer_size, seg.entries[1].entry.name or "a parameter", seg.slice,
                      seg.slice), 0)
      end
    end
  else
    self.work = self:buffer(self:numel(pp.extent), pp.dtype, "params", pp.tier)
  end
  for _, seg in ipairs(L.segments) do
    if pp.extent == "full" then
      bind_params(seg, self.work:view(seg.full_offset, { seg.padded }))
    elseif seg.numel <= s.persistence then
      seg.persistent = lz.tensor({ seg.padded }, pp.persistent.dtype, "params", self.dev)
      bind_params(seg, seg.persistent)
    end
  end
  -- The fp32 master (the working buffer itself where the plan says so) and
  -- the optimizer's states, where offload_optimizer puts them.
  local oo = s.offload_opt
  self.states = offload.states{
    n = self:numel(P.optimizer.extent), master = not P.master.alias, names = self.optimizer.states,
    device = oo.device, nvme_path = oo.nvme_path, aio = s.aio, sub_group_size = s.sub_group,
    buffer_count = oo.buffer_count, pipeline_read = oo.pipeline_read,
    pipeline_write = oo.pipeline_write, params = self.pshard, work_dtype = pp.dtype,
    compute = self.dev,
  }
  if P.master.alias then self.master = self.work else self.master = self.states.master end
  -- The gradients (none on the device when stages 2-3 reduce straight into
  -- the optimizer's host shard), and what the optimizer reads: the same
  -- buffer, or a shard of its own in host memory.
  local G, OG = P.grads, P.opt_grads
  if G.extent ~= "none" then
    self.grads = self:buffer(self:numel(G.extent), G.dtype, "grads", G.tier)
  end
  if OG.alias then
    self.ograds = self.grads
  else
    self.ograds = self:buffer(self:numel(OG.extent), OG.dtype, "grads", OG.tier):zero()
  end
  -- Device memory holds the comm buffers live at once, plus idle ones up
  -- to that: the prefetch window beside the largest module gathered, and
  -- reduce_bucket_size of gradients beside the largest module's.
  if self.dev ~= "cpu" then
    local largest = 0
    for _, seg in ipairs(L.segments) do largest = math.max(largest, seg.padded) end
    self.pool:set_cap((s.prefetch + 2 * largest) * Placement.esize[self.wdt] +
                      (s.reduce_bucket + largest) * 4)
  end
  -- A host optimizer whose working parameters live on the device writes
  -- the updated working shard to host staging, copied to the device after
  -- each sub-group (on the copy stream, overlapping the next group's update).
  self.push_params = self.dev ~= "cpu" and P.optimizer.tier ~= "device" and pp.tier == "device"
  if self.push_params then
    self.wstage = offload.host({ L.shard_numel }, pp.dtype, self.dev)
    self.pushed = lz.event()
  end
  if not P.reduce.buffered then
    for _, seg in ipairs(L.segments) do
      bind_grads(seg, self.grads:view(seg.full_offset, { seg.padded }))
    end
  end
end

-- Half gradients: an fp32 scratch of 2 x CHUNK elements beside a tensor
-- (on its device), for the optimizer's view of the gradients and for
-- accumulating into them.
function Engine:scratch_by(t)
  self.scratches = self.scratches or {}
  local d = t:device_name()
  local sc = self.scratches[d]
  if not sc then
    sc = lz.tensor({ 2 * CHUNK }, "f32", "workspace", d)
    self.scratches[d] = sc
  end
  return sc
end

-- Every rank draws the same initial weights (same seed, canonical order)
-- into a temporary fp32 buffer, then keeps what the plan places on it.
function Engine:init_weights(seed)
  local L, model, P = self.L, self.model, self.P
  local tmp = lz.tensor({ L.full_numel }, "f32", "workspace")
  -- Frozen parameters are drawn into an fp32 buffer of their own (the draws
  -- walk every parameter in canonical order), then rounded into theirs.
  local ftmp = self.frozen and lz.tensor({ self.frozen:numel() }, "f32", "workspace")
  for _, e in ipairs(self.frozen_entries) do
    e.module.p[e.key] = ftmp:view(e.frozen_offset, e.shape)
  end
  local saved = {}
  for _, seg in ipairs(L.segments) do
    for _, e in ipairs(seg.entries) do
      saved[e] = e.entry.module.p[e.entry.key]
    end
    bind_params(seg, tmp:view(seg.full_offset, { seg.padded }))
  end
  model:init_weights(seed)
  if ftmp then
    self.frozen:convert(ftmp)
    for _, e in ipairs(self.frozen_entries) do
      e.module.p[e.key] = self.frozen:view(e.frozen_offset, e.shape)
    end
    ftmp:free()
  end
  -- A state's part of segment seg: the whole padded segment (full) or this
  -- rank's slice (shard), copied from the drawn weights.
  local function place(buf, extent, seg)
    if not buf then return end
    if extent == "full" then
      buf:view(seg.full_offset, { seg.padded })
         :convert(tmp:view(seg.full_offset, { seg.padded }))
    else
      buf:view(seg.shard_offset, { seg.slice })
         :convert(tmp:view(seg.mine.full_offset, { seg.slice }))
    end
  end
  for _, seg in ipairs(L.segments) do
    bind_params(seg, nil)
    for _, e in ipairs(seg.entries) do e.entry.module.p[e.entry.key] = saved[e] end
    place(self.work, P.params.extent, seg)
    if seg.persistent then seg.persistent:convert(tmp:view(seg.full_offset, { seg.padded })) end
    if not P.master.alias then place(self.master, P.master.extent, seg) end
  end
  -- Sub-groups on NVMe: the master slices and zero states to the state
  -- file, the working copy (the master rounded) to the parameter file.
  local st = self.states
  if st.nb > 0 then
    st:each_group(true, function(_, lo, n, v)
      if st.swap then
        if v.master then
          self:shard_pieces(lo, n, function(seg, a, len)
            local from = seg.mine.full_offset + (a - seg.shard_offset)
            v.master:view(a - lo, { len }):copy(tmp:view(from, { len }))
          end)
        end
        for _, t in ipairs(v.s) do t:zero() end
      end
      if v.work then v.work:copy(v.master) end
    end, true) -- fresh: every state is written here, nothing to read first
  end
  tmp:free()
end

-- Zero weights everywhere the plan keeps them (the loader fills them next).
function Engine:zero_weights()
  if self.work then self.work:zero() end
  if self.master and self.master ~= self.work then self.master:zero() end
  for _, seg in ipairs(self.L.segments) do
    if seg.persistent then seg.persistent:zero() end
  end
  local st = self.states
  if st.nb > 0 then
    st:each_group(true, function(_, _, _, v)
      if v.master then v.master:zero() end
      for _, t in ipairs(v.s) do t:zero() end
      if v.work then v.work:zero() end
    end, true)
  end
end

-- Calls fn(seg, a, len) for the pieces of shard elements [lo, lo + n) that
-- fall in each segment's slice (a: the piece's shard offset), in order.
function Engine:shard_pieces(lo, n, fn)
  local hi = lo + n
  for _, seg in ipairs(self.L.segments) do
    local a = math.max(lo, seg.shard_offset)
    local b = math.min(hi, seg.shard_offset + seg.slice)
    if b > a then fn(seg, a, b - a) end
    if seg.shard_offset >= hi then break end
  end
end

-- The optimizer's calls: it updates every rank's slices where the plan
-- replicates it, this rank's otherwise. Each run is a piece of
-- one decay setting; the pieces that fall in each optimizer sub-group
-- (zero/offload.lua) become that group's calls, with views into the
-- group's master and states (resident or read from NVMe), the gradients and (bf16/
-- fp16, or an NVMe parameter shard) the working copy.
function Engine:build_calls()
  local L, P = self.L, self.P
  local ranks = {}
  if P.optimizer.ranks == "all" then
    for r = 0, self.world - 1 do ranks[#ranks + 1] = r end
  else
    ranks[1] = self.rank
  end
  local runs = {}
  for _, r in ipairs(ranks) do
    for _, run in ipairs(layout.shard_runs(L, r)) do
      local shape = { run.numel }
      local item = {
        decay = run.decay, numel = run.numel, opt_off = at(P.optimizer.extent, run),
        master_off = at(P.master.extent, run),
        g = self.ograds:view(at(P.opt_grads.extent, run), shape),
        -- The working copy the update rounds into (none when it is the
        -- master itself, or on NVMe: each sub-group's staging then).
        w = (self.wdt ~= "f32" and self.work) and self.work:view(at(P.params.extent, run), shape)
            or nil,
      }
      if self.push_params then
        -- Host staging, then the device's working copy.
        item.w = self.wstage:view(run.shard_offset, shape)
        item.wdev = self.work:view(at(P.params.extent, run), shape)
      end
      runs[#runs + 1] = item
    end
  end
  self.calls = {}
  for k, g in ipairs(self.states.groups) do
    local gv, calls = self.states.views[k], {}
    for _, run in ipairs(runs) do
      local a = math.max(run.opt_off, g.lo)
      local b = math.min(run.opt_off + run.numel, g.lo + g.n)
      if b > a then
        local d, len, rel = a - run.opt_off, b - a, a - g.lo
        local function piece(off, n)
          local st = {}
          for i, t in ipairs(gv.s) do st[i] = t:view(rel + off, { n }) end
          return {
            decay = run.decay, s = st,
            p = gv.master and gv.master:view(rel + off, { n })
                or self.master:view(run.master_off + d + off, { n }),
            g = run.g:view(d + off, { n }),
            w = run.w and run.w:view(d + off, { n }) or (gv.work and gv.work:view(rel + off, { n })),
            wdev = run.wdev and run.wdev:view(d + off, { n }),
          }
        end
        if self.half_grads then
          -- The optimizer reads fp32 gradients: each chunk's gradients
          -- (half) are converted into the scratch just before its update.
          for off = 0, len - 1, CHUNK do
            local c = piece(off, math.min(CHUNK, len - off))
            c.half_g, c.g = c.g, self:scratch_by(c.g):view(0, { c.p:numel() })
            calls[#calls + 1] = c
          end
        else
          calls[#calls + 1] = piece(0, len)
        end
      end
    end
    self.calls[k] = calls
  end
  -- This rank's gradient slices, for the norm's canonical partials.
  self.grad_slices = {}
  for i, seg in ipairs(L.segments) do
    self.grad_slices[i] = self.ograds:view(at(P.opt_grads.extent, seg.mine), { seg.slice })
  end
  local K = #L.segments + 1 -- the loss, then one partial per segment
  self.meta_k = K
  self.meta_send = lz.tensor({ 2 * K }, "i32", "workspace")
  self.meta_recv = lz.tensor({ 2 * K * self.world }, "i32", "workspace")
end

-- Activation arenas, plus (bf16/fp16) an arena for the casts modules make.
function Engine:prepare(B, T)
  local model = self.model
  model.ctx.cast_dtype = self.wdt -- what the cast arenas are sized for
  model:prepare(B, T)
  if self.wdt ~= "f32" then
    local ctx = model.ctx
    if ctx.cast_arena then ctx.cast_arena:free() end
    ctx.cast_arena = lz.arena(model:cast_arena_size(B, T, self.wdt), "activations", self.dev)
  end
end

------------------------------------------------------------------- hooks

local function is_boundary(self) return self.micro % self.s.accum == 0 end

function Engine:install_hooks()
  local model = self.model
  model:register_hook("pre_forward", function(m) self:pre_forward(m) end)
  model:register_hook("post_forward", function(m) self:post_forward(m) end)
  model:register_hook("pre_backward", function(m) self:pre_backward(m) end)
  model:register_hook("post_backward", function(m) self:post_backward(m) end)
  model:register_hook("pre_recompute", function(m) self:pre_recompute(m) end)
  model:register_hook("post_recompute", function(m) self:post_recompute(m) end)
end

-- Parameters gathered per module: a segment's, into a pooled buffer.
function Engine:gather(seg, async)
  if seg.persistent or seg.pbuf then return end
  seg.pbuf = self.pool:get(seg.padded, self.wdt)
  self.live = (self.live or 0) + seg.padded
  local send
  send, seg.pslot = self:shard_slice(seg)
  seg.pwork = self.comm.all_gather(send, seg.pbuf, async)
  if not async then seg.pwork = nil; self:gathered(seg) end
end

-- This rank's working slice of a segment (a sharded working copy), where
-- the gather reads it: a view of the shard, or, read from the NVMe
-- parameter file or copied from host memory to the device, a staging
-- buffer (returned second, for release_slice once the gather has read it).
function Engine:shard_slice(seg)
  local v, stage
  if self.pshard then
    v, stage = self.pshard:slice(seg.shard_offset, seg.slice)
  else
    v = self.work:view(seg.shard_offset, { seg.slice })
  end
  if v:device_name() == self.dev then return v, stage end
  local d = self.pool:get(seg.slice, self.wdt)
  if self.s.overlap then
    -- On the copy stream; the device's work after this (the gather) waits
    -- for it, the host does not.
    lz.copy_async(d, v, "copy")
    self.staged = self.staged or lz.event()
    self.staged:record("copy")
    self.staged:wait_on("compute")
  else
    d:copy(v)
  end
  return d, { pooled = d, read = stage }
end

function Engine:release_slice(stage)
  if not stage then return end
  if stage.pooled then
    self.pool:put(stage.pooled)
    stage = stage.read
  end
  if stage then self.pshard:release(stage) end
end

-- A gather of seg has completed: its staging can go.
function Engine:gathered(seg)
  if seg.pwork then seg.pwork:wait() end
  seg.pwork = nil
  if seg.pslot then self:release_slice(seg.pslot); seg.pslot = nil end
end

function Engine:ensure(seg)
  if seg.persistent then return end
  if not seg.pbuf then self:gather(seg, false) end
  if seg.pwork then self:gathered(seg) end
  seg.in_use = (seg.in_use or 0) + 1
  if seg.in_use == 1 then bind_params(seg, seg.pbuf) end
end

function Engine:release(seg)
  if seg.persistent then return end
  seg.in_use = seg.in_use - 1
  if seg.in_use > 0 then return end
  bind_params(seg, nil)
  self.pool:put(seg.pbuf)
  self.live = self.live - seg.padded
  seg.pbuf = nil
end

-- Prefetch along the order recorded on the first pass: segments of the
-- next modules, up to stage3_prefetch_bucket_size elements ahead and
-- stage3_max_live_parameters gathered at once.
function Engine:prefetch(order, k)
  if not (self.s.overlap and order.done) then return end
  local budget, s = self.s.prefetch, self.s
  for i = k + 1, #order do
    local seg = order[i]
    if not seg.persistent and not seg.pbuf then
      if budget < seg.padded or (self.live or 0) + seg.padded > s.max_live then break end
      if self.pshard and not self.pshard:can_prefetch() then break end
      budget = budget - seg.padded
      self:gather(seg, true)
    end
  end
end

local function record(order, seg, pass)
  if not order.done then order[#order + 1] = seg end
  pass.k = pass.k + 1
  return pass.k
end

-- Gathers a module's segments before it runs (forward or backward),
-- recording the order and prefetching along the recorded one.
function Engine:gather_for(m, order, pass)
  for _, seg in ipairs(self.segs_of[m]) do
    local k = record(order, seg, pass)
    self:ensure(seg)
    self:prefetch(order, k)
  end
end

function Engine:pre_forward(m)
  if not self.segs_of[m] or not self.P.params.gather then return end
  self:gather_for(m, self.fwd_order, self.fwd_pass)
end

function Engine:post_forward(m)
  local segs = self.segs_of[m]
  if not segs or not self.P.params.gather then return end
  for _, seg in ipairs(segs) do self:release(seg) end
end

function Engine:pre_backward(m)
  local segs = self.segs_of[m]
  if not segs then return end
  if self.P.params.gather then self:gather_for(m, self.bwd_order, self.bwd_pass) end
  for _, seg in ipairs(segs) do
    if self.P.reduce.buffered and not seg.gbuf then
      self:make_room(seg.padded)
      seg.gbuf = self.pool:get(seg.padded, "f32"):zero()
      bind_grads(seg, seg.gbuf)
      seg.pending = seg.users
    elseif not self.P.reduce.buffered and seg.pending == nil then
      seg.pending = seg.users
    end
  end
end

function Engine:post_backward(m)
  local segs = self.segs_of[m]
  if not segs then return end
  for _, seg in ipairs(segs) do
    if self.P.params.gather then self:release(seg) end
    seg.pending = seg.pending - 1
    if seg.pending == 0 then
      seg.pending = nil
      self:grads_ready(seg)
    end
  end
end

-- Activation checkpointing with parameters gathered per module: a
-- checkpointed module's parameters (all its descendants' segments) are
-- gathered before its forward is replayed and held through its backward,
-- so one gather serves both. The replay runs no forward hooks: the
-- recorded prefetch orders and the gradient reductions see only the real
-- forward and backward.
function Engine:recompute_segs(m)
  self.recompute_segs_of = self.recompute_segs_of or {}
  local list = self.recompute_segs_of[m]
  if list then return list end
  list = {}
  local seen = {}
  local function visit(x)
    for _, seg in ipairs(self.segs_of[x] or {}) do
      if not seen[seg] then seen[seg] = true; list[#list + 1] = seg end
    end
    for _, c in ipairs(x.children) do visit(c.module) end
  end
  visit(m)
  self.recompute_segs_of[m] = list
  return list
end

function Engine:pre_recompute(m)
  if not self.P.params.gather then return end
  for _, seg in ipairs(self:recompute_segs(m)) do self:ensure(seg) end
end

function Engine:post_recompute(m)
  if not self.P.params.gather then return end
  for _, seg in ipairs(self:recompute_segs(m)) do self:release(seg) end
end

------------------------------------------------------- gradient reduction

-- A segment's gradients are complete for this micro-step: reduced as the
-- plan says (P.reduce).
function Engine:grads_ready(seg)
  local comm, async, R = self.comm, self.s.overlap, self.P.reduce
  if R.buffered then
    -- Reduce the staging buffer: all-reduce of all of it (added into the
    -- full gradients), or reduce-scatter in place (this rank's slice, added
    -- into this rank's slice of the gradients, full or shard). The shm
    -- backend reduces elementwise in rank order, so this rank's slice holds
    -- the same bits either way.
    if self.half_grads then
      -- Round the fp32 staging buffer to gdt; reduce that.
      local h = self.pool:get(seg.padded, self.gdt)
      h:copy(seg.gbuf)
      self.pool:put(seg.gbuf)
      seg.gbuf = h
    end
    local recv, dst, w
    if R.op == "all_reduce" then
      recv = seg.gbuf
      dst = self.grads:view(seg.full_offset, { seg.padded })
      w = comm.all_reduce(seg.gbuf, "avg", async)
    else
      recv = seg.gbuf:view(self.rank * seg.slice, { seg.slice })
      -- Into the gradient shard, or (none on the device) the optimizer's.
      dst = (self.grads or self.ograds):view(at(R.into, seg.mine), { seg.slice })
      w = comm.reduce_scatter(seg.gbuf, recv, "avg", async)
    end
    local item = { seg = seg, recv = recv, dst = dst, elems = seg.padded }
    if async then
      item.work = w
      self.inflight[#self.inflight + 1] = item
      self.inflight_elems = (self.inflight_elems or 0) + seg.padded
    else
      self:finish_reduce(item)
    end
    bind_grads(seg, nil)
    return
  end
  if not is_boundary(self) then return end
  if R.op == "reduce_scatter" then
    -- In place, in the full gradient buffer: this rank's slice is reduced.
    local full = self.grads:view(seg.full_offset, { seg.padded })
    local recv = self.grads:view(seg.mine.full_offset, { seg.slice })
    local w = comm.reduce_scatter(full, recv, "avg", async)
    if async then self.inflight[#self.inflight + 1] = { work = w } end
    return
  end
  -- All-reduce, neighbouring segments batched into buckets of
  -- reduce_bucket_size elements (backward visits them back to front).
  local b = self.bucket
  if b and seg.full_offset + seg.padded == b.lo then
    b.lo = seg.full_offset
  else
    self:flush_bucket()
    b = { lo = seg.full_offset, hi = seg.full_offset + seg.padded }
    self.bucket = b
  end
  if b.hi - b.lo >= self.s.reduce_bucket then self:flush_bucket() end
end

function Engine:flush_bucket()
  local b = self.bucket
  if not b then return end
  self.bucket = nil
  local w = self.comm.all_reduce(self.grads:view(b.lo, { b.hi - b.lo }), "avg", self.s.overlap)
  if self.s.overlap then self.inflight[#self.inflight + 1] = { work = w } end
end

-- Staged gradients: adds a reduced staging buffer (all-reduce) or slice
-- (reduce-scatter) into the gradients the optimizer reads.
function Engine:finish_reduce(item)
  if item.work then item.work:wait() end
  local seg = item.seg
  if seg then
    self.inflight_elems = (self.inflight_elems or 0) - (item.work and item.elems or 0)
    if item.recv.device ~= item.dst.device then
      -- Reduced on the device, added into the host's gradients: copied off
      -- on the copy stream (overlap_comm: while backward goes on; the add
      -- waits for it in land), else at once.
      local host = self.hpool:get(item.recv:numel(), item.recv:dtype_name())
      item.host, item.gbuf = host, seg.gbuf
      seg.gbuf = nil
      if self.s.overlap then
        lz.copy_async(host, item.recv, "copy")
        item.landed = lz.event()
        item.landed:record("copy")
        self.landing[#self.landing + 1] = item
      else
        host:copy(item.recv)
        self:land(item)
      end
      return
    end
    self:accumulate(item.dst, item.recv)
    self.pool:put(seg.gbuf)
    seg.gbuf = nil
  end
end

-- dst += a reduced micro-step gradient src (both where the add runs).
function Engine:accumulate(dst, src)
  if self.half_grads then self:add_half(dst, src) else ops.axpy(dst, 1.0, src) end
end

-- A reduced gradient copied off the device is added into the host's
-- gradients once its copy has landed; its buffers go back to their pools.
function Engine:land(item)
  if item.landed then
    self:wait_copies(item.landed)
    item.landed:free()
  end
  self:accumulate(item.dst, item.host)
  self.hpool:put(item.host)
  self.pool:put(item.gbuf)
end

-- Waits for copies queued to overlap (up to event ev), counting the host's
-- wait: the part of their time that was not hidden (copy_wait_s).
function Engine:wait_copies(ev)
  local t0 = clock.now()
  ev:synchronize()
  self.copy_wait = (self.copy_wait or 0) + (clock.now() - t0)
end

-- Lands the copies in flight, in order (all, or those already done).
function Engine:land_all(done_only)
  local landing = self.landing
  while #landing > 0 and (not done_only or landing[1].landed:query()) do
    self:land(table.remove(landing, 1))
  end
end

-- dst += src for gdt tensors: both converted to fp32, added, dst rounded
-- back (nearest even), CHUNK elements at a time. Elementwise, so every
-- plan gets the same bits.
--
-- An fp32 dst (the optimizer's host gradients) holds gdt values: the sum
-- is rounded to gdt and widened back, the same numbers a gdt dst holds.
function Engine:add_half(dst, src)
  local n, scratch = dst:numel(), self:scratch_by(dst)
  local round = dst.dtype ~= src.dtype and src:dtype_name()
  if round and not self.round_scratch then
    self.round_scratch = lz.tensor({ CHUNK }, round, "workspace")
  end
  for off = 0, n - 1, CHUNK do
    local len = math.min(CHUNK, n - off)
    local a = scratch:view(0, { len })
    local b = scratch:view(CHUNK, { len })
    local d = dst:view(off, { len })
    a:copy(d)
    b:copy(src:view(off, { len }))
    ops.axpy(a, 1.0, b)
    if round then
      local r = self.round_scratch:view(0, { len })
      r:copy(a)
      d:copy(r)
    else
      d:copy(a)
    end
  end
end

-- Keeps the gradient buckets in flight under reduce_bucket_size elements.
function Engine:make_room(n)
  self:land_all(true)
  while #self.inflight > 0 and (self.inflight_elems or 0) + n > self.s.reduce_bucket do
    self:finish_reduce(table.remove(self.inflight, 1))
  end
  -- Gradient buffers whose copies are in flight count against the bucket too.
  while #self.landing > 0 and (self.inflight_elems or 0) + self:landing_elems() + n >
        self.s.reduce_bucket do
    self:land(table.remove(self.landing, 1))
  end
end

function Engine:landing_elems()
  local n = 0
  for _, item in ipairs(self.landing) do n = n + item.elems end
  return n
end

function Engine:wait_all()
  self:flush_bucket()
  while #self.inflight > 0 do self:finish_reduce(table.remove(self.inflight, 1)) end
  self.inflight_elems = 0
  self:land_all()
end

------------------------------------------------------- forward, backward

function Engine:forward(x, y)
  local model = self.model
  if model.ctx.cast_arena then model.ctx.cast_arena:reset() end
  self.fwd_order = self.fwd_order or {}
  self.fwd_pass = { k = 0 }
  local loss = model:forward(x, y)
  if #self.fwd_order > 0 then self.fwd_order.done = true end
  self:drop_prefetched()
  return loss
end

-- Gathers that were prefetched but not used (a pass that ended early).
function Engine:drop_prefetched()
  if not self.P.params.gather then return end
  for _, seg in ipairs(self.L.segments) do
    if seg.pbuf and (seg.in_use or 0) == 0 then
      self:gathered(seg)
      seg.in_use = 1
      self:release(seg)
    end
  end
end

-- Backward of the last forward; the loss is scaled by 1/accumulation steps
-- and by the fp16 loss scale.
function Engine:backward(loss)
  self.micro = self.micro + 1
  if loss then
    self.loss_sum = self.loss_sum + loss
    self.loss_count = self.loss_count + 1
  end
  self.bwd_order = self.bwd_order or {}
  self.bwd_pass = { k = 0 }
  self.model:backward(self.scaler.scale / self.s.accum)
  if #self.bwd_order > 0 then self.bwd_order.done = true end
  self:drop_prefetched()
  if self.P.reduce.buffered or is_boundary(self) then self:wait_all() end
end

function Engine:is_gradient_accumulation_boundary() return is_boundary(self) end

---------------------------------------------------------------- the step

local function inject_inf(self)
  local k = tonumber(os.getenv("LZ_INJECT_INF_STEP") or "")
  if k and k == self.global_steps + 1 and self.rank == 0 then
    local inf = lz.from_table({ math.huge }, { 1 }, self.grad_slices[1]:dtype_name())
    self.grad_slices[1]:view(0, { 1 }):copy(inf)
    inf:free()
  end
end

-- Gathers every rank's loss and norm partials (as doubles) in one
-- all-gather; sums them in canonical order (segment, then slice).
function Engine:exchange(local_loss)
  local K, W = self.meta_k, self.world
  local send = ffi.cast("double *", self.meta_send.data)
  send[0] = local_loss
  for i, g in ipairs(self.grad_slices) do send[i] = g:sq_norm() end
  self.comm.all_gather(self.meta_send, self.meta_recv)
  local all = ffi.cast("double *", self.meta_recv.data)
  local loss = 0
  for r = 0, W - 1 do loss = loss + all[r * K] end
  local sq = 0
  for i = 1, K - 1 do
    for r = 0, W - 1 do sq = sq + all[r * K + i] end
  end
  return loss / W, sq
end

-- The optimizer step at the end of an accumulation cycle. Returns a
-- record: loss (mean over ranks and micro-steps), lr, grad_norm (before
-- clipping, unscaled), loss_scale (used for this step), skipped.
function Engine:step()
  local s = self.s
  self:pull_grads()
  inject_inf(self)
  local local_loss = self.loss_count > 0 and self.loss_sum / self.loss_count or 0
  local loss, sq = self:exchange(local_loss)
  self.loss_sum, self.loss_count = 0, 0
  self.global_steps = self.global_steps + 1
  local loss_scale = self.scaler.scale
  local norm = math.sqrt(sq) / loss_scale
  local overflow = not (sq < math.huge) -- inf or NaN
  local rec = { loss = loss, grad_norm = norm, loss_scale = loss_scale, skipped = overflow }
  self.scaler:update(overflow)
  if overflow then
    self.skipped_steps = self.skipped_steps + 1
    rec.lr = self.lr(self.optimizer_steps + 1)
    self:zero_grad()
    return rec
  end
  self.optimizer_steps = self.optimizer_steps + 1
  local lr = self.lr(self.optimizer_steps)
  rec.lr = lr
  -- The loss scale's undo and clipping (torch.nn.utils.clip_grad_norm_:
  -- scale by clip / (norm + 1e-6) when that is below 1), folded into the
  -- optimizer's gradient scale.
  local scale = 1.0 / loss_scale
  if s.clip > 0 then
    local c = s.clip / (norm + 1e-6)
    if c < 1 then scale = scale * c end
  end
  local opt, t = self.optimizer, self.optimizer_steps
  if self.push_params then self:wait_copies(self.pushed) end -- the last step's copies
  self.states:each_group(true, function(k)
    for _, c in ipairs(self.calls[k]) do
      if c.half_g then c.g:copy(c.half_g) end
      opt:update(c, t, lr, scale)
    end
    if self.push_params then
      for _, c in ipairs(self.calls[k]) do
        if s.overlap then lz.copy_async(c.wdev, c.w, "copy") else c.wdev:copy(c.w) end
      end
    end
  end)
  if self.push_params then
    -- The device's kernels and collectives run after the new parameters landed.
    self.pushed:record("copy")
    self.pushed:wait_on("compute")
  end
  self:gather_params()
  self:zero_grad()
  return rec
end

-- What the plan gathers after the step: every rank's updated slices into
-- every rank's full working copy, or the persistent parameters.
function Engine:gather_params()
  local after, comm = self.P.after_step, self.comm
  if after == "none" then return end
  local async, works, slots = self.s.overlap, {}, {}
  for _, seg in ipairs(self.L.segments) do
    local send, recv, stg
    if after == "gather_full" then
      recv = self.work:view(seg.full_offset, { seg.padded })
      send = recv:view(self.rank * seg.slice, { seg.slice })
    elseif seg.persistent then
      recv = seg.persistent
      send, stg = self:shard_slice(seg)
    end
    if recv then works[#works + 1] = comm.all_gather(send, recv, async) end
    if stg then
      if async then slots[#slots + 1] = stg else self:release_slice(stg) end
    end
  end
  if async then for _, w in ipairs(works) do w:wait() end end
  for _, stg in ipairs(slots) do self:release_slice(stg) end
end

-- A host optimizer's gradients when the device keeps whole ones (stage 1,
-- or accumulation before stage 2): this rank's slices, copied off the
-- device once per step.
function Engine:pull_grads()
  if self.ograds == self.grads or not self.grads then return end
  local P = self.P
  for _, seg in ipairs(self.L.segments) do
    self.ograds:view(at(P.opt_grads.extent, seg.mine), { seg.slice })
        :copy(self.grads:view(at(P.grads.extent, seg.mine), { seg.slice }))
  end
end

function Engine:zero_grad()
  if self.grads then self.grads:zero() end
  if self.ograds ~= self.grads then self.ograds:zero() end
end

-- One optimizer step: accumulation micro-steps from batches:next_batch().
function Engine:train_batch(batches)
  for _ = 1, self.s.accum do
    local x, y = batches:next_batch()
    local loss = self:forward(x, y)
    self:backward(loss)
  end
  return self:step()
end

-- Mean loss over validation batches 1..n (the same batches on every rank).
function Engine:evaluate(loader, n)
  local model, sum = self.model, 0
  model:evaluate()
  for i = 1, n do sum = sum + self:forward(loader:val_batch(i)) end
  model:train()
  return sum / n
end

-------------------------------------------- optimizer states (checkpoints)
-- The interface checkpoints use (luazero/checkpoint.lua); nothing else
-- reads the master and the optimizer's states for them. docs/checkpoints.md.

-- This rank's optimizer elements: the full padded layout where the plan
-- replicates the optimizer, its shard otherwise.
function Engine:state_numel() return self:numel(self.P.optimizer.extent) end

-- Calls fn(offset, master, state1, state2, ...) for chunks covering this
-- rank's optimizer elements [0, state_numel()) in order, with f32 views of
-- equal length (the optimizer's states in its `states` order: m, v for
-- AdamW): the optimizer's sub-groups (zero/offload.lua), read from NVMe
-- where they live there. write_back: fn modifies them (a load); on NVMe
-- they are written back, and an NVMe parameter shard gets the rounded
-- master with them.
function Engine:visit_states(write_back, fn)
  local P = self.P
  if self.dev ~= "cpu" and P.optimizer.tier == "device" then
    -- Host copies of the device's chunks (copied back when written).
    local inner = fn
    fn = function(off, ...)
      local dev, host = { ... }, {}
      for i, t in ipairs(dev) do host[i] = t:to("cpu") end
      inner(off, unpack(host))
      for i, t in ipairs(dev) do
        if write_back then t:copy(host[i]) end
        host[i]:free()
      end
    end
  end
  self.states:each_group(write_back, function(_, lo, n, v)
    if v.master then
      fn(lo, v.master, unpack(v.s))
      if write_back and v.work then v.work:copy(v.master) end
    elseif P.master.extent == P.optimizer.extent then
      fn(lo, self.master:view(lo, { n }), unpack(v.s))
    else
      -- The master is the full working buffer, the states a shard: this
      -- rank's slices of it, one chunk per segment.
      self:shard_pieces(lo, n, function(seg, a, len)
        local st = {}
        for i, t in ipairs(v.s) do st[i] = t:view(a - lo, { len }) end
        fn(a, self.master:view(seg.mine.full_offset + (a - seg.shard_offset), { len }),
           unpack(st))
      end)
    end
  end)
end

-- How optimizer-element offsets map to canonical parameter coordinates:
-- { numel = state_numel(), runs = { {offset, canonical, numel}, ... } }.
function Engine:state_layout()
  return { numel = self:state_numel(),
           runs = layout.canonical_runs(self.L, self.P.optimizer.extent == "shard" and self.rank or nil) }
end

-- Whether every rank holds the same optimizer states (one writer is enough).
function Engine:states_replicated() return self.P.optimizer.extent == "full" end

-- After the master was written (a load): the working copy is its rounding
-- (the update writes round(master); init rounds the same way), then what
-- the plan gathers after a step is gathered again.
function Engine:after_load()
  local L, P = self.L, self.P
  -- (an NVMe shard got it in visit_states; a host master beside a device
  -- working copy is never the working copy itself)
  local work = (self.wdt ~= "f32" or self.push_params) and self.work
  if work then
    if self.master and P.params.extent == P.master.extent then
      work:convert(self.master)
    elseif self.master then
      for _, seg in ipairs(L.segments) do
        work:view(seg.mine.full_offset, { seg.slice })
            :convert(self.master:view(seg.shard_offset, { seg.slice }))
      end
    else
      -- The master is on NVMe: one pass over its sub-groups.
      self.states:each_group(false, function(_, lo, n, v)
        if P.params.extent == "shard" then
          work:view(lo, { n }):convert(v.master)
        else
          self:shard_pieces(lo, n, function(seg, a, len)
            work:view(seg.mine.full_offset + (a - seg.shard_offset), { len })
                :convert(v.master:view(a - lo, { len }))
          end)
        end
      end)
    end
  end
  self:gather_params()
  self:zero_grad()
end

-- engine:save(dir, extra, opts) and engine:load(path): luazero/checkpoint.lua.
function Engine:save(dir, extra, opts)
  return require("luazero.checkpoint").save(self, dir, extra, opts)
end
function Engine:load(path) return require("luazero.checkpoint").load(self, path) end

---------------------------------------------------------- checkpoints

-- The full fp32 master parameters in canonical order (unpadded), as an f32
-- tensor (category workspace) on every rank.
function Engine:master_params()
  local out = lz.tensor({ self.L.numel }, "f32", "workspace")
  self:full_master_segments(function(seg, full)
    out:view(seg.entries[1].offset, { seg.numel }):copy(full:view(0, { seg.numel }))
  end)
  return out
end

-- Calls fn(seg, full) for every segment in order with its whole fp32
-- master (padded), the same on every rank: a view of a resident full
-- master, or this rank's slices gathered into a temporary one segment at
-- a time.
function Engine:full_master_segments(fn)
  if self.master and self.P.master.extent == "full" then
    for _, seg in ipairs(self.L.segments) do
      local full = self.master:view(seg.full_offset, { seg.padded })
      if full:device_name() ~= "cpu" then
        full = full:to("cpu")
        fn(seg, full)
        full:free()
      else
        fn(seg, full)
      end
    end
    return
  end
  self:master_slices(function(seg, slice)
    local full = lz.tensor({ seg.padded }, "f32", "workspace")
    local host = slice:device_name() ~= "cpu" and slice:to("cpu")
    self.comm.all_gather(host or slice, full)
    if host then host:free() end
    fn(seg, full)
    full:free()
  end)
end

-- Calls fn(seg, slice) for every segment in order with this rank's fp32
-- master slice of it (a sharded master): a view of the resident master, or
-- assembled from the sub-groups read from NVMe.
function Engine:master_slices(fn)
  local segs = self.L.segments
  if self.master then
    for _, seg in ipairs(segs) do fn(seg, self.master:view(seg.shard_offset, { seg.slice })) end
    return
  end
  local i, part = 1, nil
  self.states:each_group(false, function(_, lo, n, v)
    local hi = lo + n
    while i <= #segs do
      local seg = segs[i]
      local so, se = seg.shard_offset, seg.shard_offset + seg.slice
      if so >= hi then break end
      local a, b = math.max(so, lo), math.min(se, hi)
      if a == so and b == se then
        fn(seg, v.master:view(a - lo, { seg.slice }))
      else
        part = part or lz.tensor({ seg.slice }, "f32", "workspace")
        part:view(a - so, { b - a }):copy(v.master:view(a - lo, { b - a }))
        if b == se then fn(seg, part); part:free(); part = nil end
      end
      if se > hi then break end
      i = i + 1
    end
  end)
end

-- xxh64 of the full fp32 master parameters in canonical order (hex),
-- streamed one segment at a time: memory of one gathered segment.
function Engine:params_checksum()
  local h = lz.hasher(0)
  self:full_master_segments(function(seg, full) h:update(full.data, seg.numel * 4) end)
  local hex = require("bit").tohex(h:digest(), 16)
  h:free()
  return hex
end

-- Seconds the host has waited so far for host<->device copies queued to
-- overlap with compute (overlap_comm): the part of their time not hidden.
function Engine:copy_wait_s() return self.copy_wait or 0 end

-- Bytes this rank has read from and written to its NVMe swap files so far
-- (nil when nothing is on NVMe).
function Engine:nvme_bytes()
  if not (self.states.swap or self.pshard) then return nil end
  return self.states:io_bytes()
end

-- Where the states live, for the start-up line: nil without offload.
function Engine:offload_summary()
  local oo, op, st = self.s.offload_opt, self.s.offload_param, self.states
  if oo.device == "none" and op.device == "none" then return nil end
  local parts = {}
  if oo.device ~= "none" then
    parts[#parts + 1] = "optimizer states on " .. oo.device
  end
  if op.device ~= "none" then parts[#parts + 1] = "parameter shard on " .. op.device end
  local line = "offload: " .. table.concat(parts, ", ")
  if st.nb > 0 then
    line = line .. ("; %d sub-groups of %d elements, %d staging buffers (%.1f MiB)")
                   :format(#st.groups, st.G, st.nb, st:staging_bytes() / 2 ^ 20)
    local sw = st.swap or (self.pshard and self.pshard.swap)
    if sw and not sw:stats().direct then line = line .. ", buffered I/O" end
  end
  return line
end

-- This engine's own model-state bytes on this rank, from its plan and
-- layout (never the process-wide ledger, which also counts every other live
-- engine and tensor): { params, grads, optimizer, total } over the device
-- and host tiers, frozen parameters under params; nvme = bytes in swap files.
function Engine:state_bytes()
  local persistent = 0
  for _, seg in ipairs(self.L.segments) do
    if seg.persistent then persistent = persistent + seg.padded end
  end
  local by = self.P:bytes{ full = self.L.full_numel, shard = self.L.shard_numel,
                           persistent = persistent }
  local out = { nvme = by.nvme.total }
  for _, cat in ipairs({ "params", "grads", "optimizer" }) do
    out[cat] = by.device[cat] + by.host[cat]
  end
  if self.frozen then out.params = out.params + self.frozen:bytes() end
  out.total = out.params + out.grads + out.optimizer
  return out
end

function Engine:model_state_bytes() return self:state_bytes().total end

function Engine:free()
  self:wait_all()
  self.pool:free()
  local function f(t) if t then t:free() end end
  if self.ograds ~= self.grads then f(self.ograds) end
  f(self.grads)
  f(self.wstage)
  if self.pushed then self.pushed:free() end
  if self.staged then self.staged:free() end
  self.hpool:free()
  for _, t in pairs(self.scratches or {}) do t:free() end
  self.states:free()
  if self.pshard then self.pshard:free() end
  self.master = nil
  f(self.work)
  for _, seg in ipairs(self.L.segments) do f(seg.persistent) end
  f(self.meta_send); f(self.meta_recv); f(self.round_scratch); f(self.frozen)
  local ctx = self.model.ctx
  if ctx.cast_arena then ctx.cast_arena:free(); ctx.cast_arena = nil end
  self.model:release_arenas()
end

M.Engine = Engine
return M
