-- zero/engine.lua — the ZeRO engine: luazero.zero.initialize{model=..., config=...}
-- returns an engine with forward, backward, step and train_batch, in the
-- spirit of deepspeed.initialize. What lives where is the
-- placement plan (zero/plan.lua), built once here and read everywhere
-- below; bf16/fp16 working copies over fp32 master weights, dynamic loss
-- scaling, gradient clipping with a global norm computed in a canonical
-- order, and the update by an optimizer object (luazero/optim/).
-- docs/zero.md describes the design.
--
-- This file holds the engine's making and the step's outline: gradients
-- ready -> reduced -> the optimizer's step -> parameters gathered. The
-- parameter gathers and the module hooks (zero/gather.lua, self.gatherer)
-- and gradient reduction (zero/reduce.lua, self.reducer) are components
-- with their own state, as are the optimizer's states over their store
-- (zero/offload.lua, self.states), the model states as numbers over them
-- (zero/states.lua, self.model_states: initial weights, the optimizer's
-- calls and update, what checkpoints and checksums read), the frozen
-- parameters (zero/frozen.lua, self.frozen) and the loss scaler
-- (self.scaler). What the engine says about itself (zero/report.lua) sits
-- above it, handed in by luazero.zero.initialize.
--
--   local engine = zero.initialize{ model = gpt2.new(cfg), config = cfg_table,
--                                 seed = 1337, batch = {B, T}, lr = fn(step) }
--   local rec = engine:train_batch(loader)   -- one optimizer step
--   engine:params_checksum(); print(engine:plan())
local ffi = require("ffi")
local lz = require("luazero")
local moe_config = require("luazero.config.moe")
local optim = require("luazero.optim")
local formats = require("luazero.optim.formats")
local layout = require("luazero.zero.layout")
local Placement = require("luazero.zero.plan")
local Pool = require("luazero.zero.pool")
local Scaler = require("luazero.zero.scaler")
local offload = require("luazero.zero.offload")
local spill = require("luazero.zero.spill")
local store = require("luazero.zero.store")
local reduce = require("luazero.zero.reduce")
local gather = require("luazero.zero.gather")
local api = require("luazero.zero.api")
local Frozen = require("luazero.zero.frozen")
local States = require("luazero.zero.states")
local Matrices = require("luazero.zero.matrices")
local experts = require("luazero.zero.experts")
local Settings = require("luazero.zero.settings")

local M = {}
local Engine = {}
Engine.__index = Engine

-- The settings a config gives and the plan they make (zero/settings.lua).
local settings = Settings.read
M.settings, M.plan_of = Settings.read, Settings.plan_of

-- What the engine cannot train, refused before anything is allocated: a
-- module that runs forward but has no backward, and a parameter the engine
-- did not lay out (a tensor put in module.p by hand).
local function check_modules(model)
  model:walk(function(m, path)
    local where = ("module %s (%s)"):format(path == "" and "(the model)" or path,
                                            m.__name or "Module")
    if type(m.forward) == "function" and type(m.backward) ~= "function" then
      error(("initialize: %s has a forward but no backward; give it backward(dy), which " ..
             "adds its parameters' gradients into self.g and returns dx (docs/api.md)")
            :format(where), 0)
    end
    local declared = {}
    for _, spec in ipairs(m.params) do declared[spec.key] = true end
    for key in pairs(m.p) do
      if not declared[key] then
        error(("initialize: %s holds p.%s, a tensor made outside the engine; declare it in " ..
               "the constructor with self:param(%q, shape, init) and the engine allocates it")
              :format(where, key, key), 0)
      end
    end
  end)
end

-- opts: model (not allocated), config (normalised DeepSpeed table), seed,
-- batch {B, T} (sizes the activation arenas), lr (function of the 1-based
-- optimizer step; default: the config's constant lr), comm (default
-- luazero.comm), checkpoint_activations (true: the model keeps only each
-- block's input and replays its forward in backward, as the config's
-- activation_checkpointing block says), device ("cpu", "sim" or "cuda":
-- where the model computes and the plan's device tier lives; "cpu").
-- above: the modules above the engine that it hands itself to, which
-- luazero.zero.initialize passes (the engine requires none of them):
-- estimate (estimate/live.lua: engine:estimate() and the out-of-memory
-- error; without it that error is the allocator's own) and checkpoint
-- (luazero.checkpoint: engine:save and engine:load, through
-- engine:state_parts()), report (zero/report.lua: engine:describe(),
-- offload_summary, nvme_bytes, state_bytes).
function M.initialize(opts, above)
  above = above or {}
  local estimator = above.estimate
  api.initialize(opts)
  local model = assert(opts.model, "initialize: model is required")
  check_modules(model)
  local s = settings(opts.config)
  local comm = opts.comm or require("luazero.comm")
  local W, rank = comm.size(), comm.rank()
  local optimizer = optim.new(s.optimizer)
  local device = opts.device or "cpu"
  local ok, P = pcall(function()
    return M.plan_of(s, device, optimizer.states, optimizer.state_formats,
                     optimizer.master_format,
                     Placement.moe_of(model.routers, s.moe_gather, s.routed_only))
  end)
  if not ok then error("initialize: " .. tostring(P):gsub("^plan: ", ""), 0) end
  if device ~= "cpu" then lz.device_init(device) end
  model.ctx.device = device
  -- the run's seed keys the generators the model draws from in training
  -- (nn/moe.lua's router jitter)
  model.ctx.seed = opts.seed or 0
  -- The learning rate without a schedule: the optimizer's own (the
  -- config's optimizer.params.lr, else its type's default).
  s.lr = optimizer.lr
  local self = setmetatable({
    model = model, s = s, comm = comm, world = W, rank = rank, P = P, stage = P.stage,
    dev = device, seed = opts.seed or 0, above = above,
    dtype = s.dtype, wdt = P.dtype, gdt = P.grad_dtype,
    lr = opts.lr and api.lr(opts.lr) or function() return s.lr end,
    micro = 0, stepped_at = 0, optimizer_steps = 0, global_steps = 0, skipped_steps = 0,
    loss_sum = 0, loss_count = 0,
    scratches = {},         -- device -> fp32 scratch for half gradients (allocate)
  }, Engine)
  -- Expert parallelism (config/moe.lua): every rank joins its
  -- expert-parallel and its expert-data-parallel group.
  if s.ep_size > 1 then
    if W % s.ep_size ~= 0 then
      error(("initialize: moe.ep_size %d does not divide the world size %d"):format(s.ep_size, W), 0)
    end
    local ep, edp = moe_config.groups(s.ep_size, W, rank)
    self.ep_group, self.edp_group = comm.group(ep), comm.group(edp)
    -- the MoE blocks exchange tokens in it (nn/moe_experts.lua)
    model.ctx.ep_group = self.ep_group
  end
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
  local frozen_entries = {}
  for _, e in ipairs(model.param_table) do
    if e.frozen then frozen_entries[#frozen_entries + 1] = e end
  end
  if #self.ptable == 0 then
    error("initialize: every parameter is frozen (model:freeze); leave some to train", 0)
  end
  -- Block-scaled states (8-bit AdamW): each tensor starts on a block and
  -- shards are cut on blocks (zero/layout.lua); tensors under the
  -- optimizer's block_min_numel keep f32 states.
  local block = formats.block_of(P.optimizer.formats)
  self.block = block
  self.L = experts.world_layout(self, block)
  experts.place(self) -- (the plan's experts "edp": only this rank's)
  self.small_below = block and optimizer.block_min_numel or nil
  self.pool = Pool.new(device)
  -- Host staging for gradients copied off the device (host-tier optimizer).
  self.hpool = Pool.new(device == "cpu" and "cpu" or "pinned")
  self.scaler = Scaler.new(s.dtype == "fp16" and s.fp16 or nil)
  self:find_users()
  local ok, err = pcall(function()
    self:allocate(frozen_entries)
    -- draw_weights false: the weights are loaded next (--init): nothing is
    -- drawn, and no whole-model buffer is made.
    if opts.draw_weights == false then
      self.model_states:zero_weights()
    else
      self.model_states:init_weights(opts.seed or 0)
    end
    self.model_states:build_calls()
    self:norm_parts()
    self:install_hooks()
    if opts.checkpoint_activations then
      model:checkpoint_activations((opts.config or {}).activation_checkpointing or true)
    end
    if opts.batch then self:prepare(opts.batch[1], opts.batch[2]) end
  end)
  if not ok then error(estimator and estimator.allocation_error(self, opts.batch, err) or err, 0) end
  model.zero_engine = self -- (once built: a failed initialize leaves the model free)
  return self
end

-- The group a segment's collectives run over (zero/experts.lua).
function Engine:comm_of(seg) return experts.comm_of(self, seg) end

-- The placement plan: print(engine:plan()) shows what lives where.
function Engine:plan() return self.P end

-- What tools/estimate figures for this engine, beside what it holds
-- (estimate/live.lua); print() shows it.
function Engine:estimate(opts)
  assert(self.above.estimate, "engine:estimate: make the engine with luazero.zero.initialize")
  return self.above.estimate.estimate(self, opts)
end

-- What the engine says about itself (zero/report.lua): the start-up lines,
-- the bytes its swap files moved, its own model-state bytes.
local function report(self, what)
  assert(self.above.report, "engine:" .. what .. ": make the engine with luazero.zero.initialize")
  return self.above.report[what](self)
end
function Engine:describe() return report(self, "describe") end
function Engine:offload_summary() return report(self, "offload_summary") end
function Engine:nvme_bytes() return report(self, "nvme_bytes") end
function Engine:state_bytes() return report(self, "state_bytes") end

-- Where the weights were loaded from (--init), kept for the checkpoint's
-- manifest: an absolute path (a relative one is taken from $PWD), and the
-- xxh64 of its files where a resume must find the same base (LoRA).
function Engine:set_init_path(path, xxh64)
  self.init_path = require("luazero.io.fs").absolute(path)
  self.init_xxh64 = xxh64
end

-- engine:save(dir, extra, opts) and engine:load(path): luazero/checkpoint.lua,
-- which reads and fills the engine through state_parts and restore_parts.
function Engine:save(dir, extra, opts)
  assert(self.above.checkpoint, "engine:save: make the engine with luazero.zero.initialize")
  return self.above.checkpoint.save(self, dir, extra, opts)
end
function Engine:load(path)
  assert(self.above.checkpoint, "engine:load: make the engine with luazero.zero.initialize")
  return self.above.checkpoint.load(self, path)
end

------------------------------------------------------------- state contract

-- The engine's state as a checkpoint sees it, piece by piece (checkpoint/
-- reads an engine through this alone): who holds it, the model it trains,
-- the shard of optimizer elements (its states in order, how to visit them
-- and where they lie in canonical coordinates), the step counters, the
-- learning rate, the loss scaler, where the weights came from.
function Engine:state_parts()
  local states = { "master" }
  for _, name in ipairs(self.optimizer.states) do states[#states + 1] = name end
  local P, steps, ms = self.P, self.optimizer_steps, self.model_states
  local replicated = ms:replicated()
  local parts = {
    comm = self.comm, rank = self.rank, world = self.world, stage = self.stage,
    -- (every parameter, the experts other ranks hold included)
    dtype = self.dtype, model = self.model, params = self.ptable,
    numel = self.L.numel + self.L.elsewhere,
    optimizer = self.optimizer.name,
    -- the manifest's record of the optimizer (type, hyperparameters), and
    -- whether a recorded type names this run's optimizer
    optimizer_record = self.optimizer:record(),
    optimizer_accepts = function(type_name) return self.optimizer:accepts(type_name) end,
    shard = {
      states = states, numel = ms:numel(), replicated = replicated,
      -- (states in swap files: a snapshot would hold them whole in memory)
      swapped = P:swapped("optimizer") or P:swapped("master"),
      layout = function() return ms:layout() end,
      -- {offset, canonical, numel} runs of rank r's shard
      runs_of = function(r)
        if r == self.rank then return ms:layout().runs end
        local L = self.place_of and layout.new(self.ptable, self.world, nil, self.block,
                                               self.place_of(r))
                  or self.L
        return layout.canonical_runs(L, not replicated and r or nil)
      end,
      -- visit(writing, fn): fn(offset, master, state...) over the shard
      visit = function(writing, fn) return ms:visit(writing, fn) end,
    },
    steps = { optimizer = steps, global = self.global_steps, skipped = self.skipped_steps },
    -- the schedule where it stands (called when a manifest is written)
    lr = function()
      return { optimizer_steps = steps, lr = self.lr(math.max(steps, 1)), base_lr = self.s.lr }
    end,
    loss_scaler = self.scaler:state(),
    init = { path = self.init_path, xxh64 = self.init_xxh64 },
    resumed_from = self.resumed_from,
  }
  -- (a replicated optimizer with the experts in their groups: each rank
  -- saves its slices)
  if replicated and self.Lw then parts.shard = experts.save_view(self, parts.shard) end
  return parts
end

-- After a checkpoint filled the shard (state_parts().shard.visit(true, ...)):
-- the working copy from the master and the gathers after it, then the
-- saved counters, the loss scaler (fp16 from fp16), and where the run
-- resumed from. saved: { steps = {optimizer, global, skipped}, dtype (the
-- saved run's), loss_scaler, resumed_from = {dir, step} }.
function Engine:restore_parts(saved)
  self:after_load()
  local steps = saved.steps
  self.optimizer_steps, self.global_steps = steps.optimizer, steps.global
  self.skipped_steps = steps.skipped
  if saved.dtype == "fp16" and self.dtype == "fp16" then self.scaler:restore(saved.loss_scaler) end
  self.resumed_from = saved.resumed_from
end

-- The model states' calls the engine's users make (zero/states.lua):
-- this rank's optimizer elements, visited in order (checkpoints, the HF
-- loader, inference, the REPL), and the fp32 master whole or as a checksum.
function Engine:state_numel() return self.model_states:numel() end
function Engine:state_layout() return self.model_states:layout() end
function Engine:visit_states(write_back, fn) return self.model_states:visit(write_back, fn) end
function Engine:master_params() return self.model_states:master_params() end
function Engine:params_checksum() return self.model_states:checksum() end

-- After the master was written (a load): the working copy from it, then
-- what the plan gathers after a step, and no gradients.
function Engine:after_load()
  self.model_states:after_load()
  self:gather_params()
  self:zero_grad()
end

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
    seg.in_use = 0 -- the modules running now that hold its gathered parameters
    self.segs_of[seg.module] = self.segs_of[seg.module] or {}
    table.insert(self.segs_of[seg.module], seg) -- (a block's experts: a segment per owner)
    -- This rank's slice of the segment, as a run (layout.shard_runs).
    seg.mine = { full_offset = seg.full_offset + layout.slice_of(L, seg, self.rank) * seg.slice,
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
  reduce.mark_writes(L)
end

-- Elements of a buffer of this extent on this rank.
function Engine:numel(extent)
  if extent == "full" then return self.L.full_numel end
  if extent == "shard" then return self.L.shard_numel end
  return 0
end

-- A buffer of n elements for a state the plan puts on `tier`, allocated by
-- the tier's store kind (zero/store/): device memory under the state's
-- ledger category, host memory (pinned beside an accelerator) under offload.
function Engine:buffer(n, dtype, name, tier)
  return store.get(tier).allocate({ n }, dtype, name, self.dev)
end

-- One buffer per state the plan keeps in memory: the working parameters
-- (self.work), the gradients (self.grads), the optimizer's fp32 master and
-- states (self.states: zero/offload.lua, resident or swapped to NVMe).
function Engine:allocate(frozen_entries)
  local L, P, s = self.L, self.P, self.s
  local pp = P.params
  -- Frozen parameters: a component of their own (zero/frozen.lua), whose
  -- stage-3 segments join the parameter groups.
  self.frozen = Frozen.new{ entries = frozen_entries, P = P, s = s, world = self.world,
                            rank = self.rank, dev = self.dev, model = self.model,
                            segs_of = self.segs_of }
  self.LF = self.frozen.LF
  if P:swapped("params") then
    local op = s.offload_param
    self.pshard = offload.param_shard{ n = self:numel(pp.extent), dtype = pp.dtype, tier = pp.tier,
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
  -- Where a gather reads this rank's slices (zero/gather.lua; frozen
  -- segments have a store of their own).
  self.tstore = { work = self.work, pshard = self.pshard, upload = pp.upload }
  for _, seg in ipairs(L.segments) do seg.store = self.tstore end
  for _, seg in ipairs(L.segments) do
    if pp.extent == "full" then
      layout.bind("p", seg, self.work:view(seg.full_offset, { seg.padded }))
    elseif seg.numel <= s.persistence then
      seg.persistent = lz.tensor({ seg.padded }, pp.persistent.dtype, "params", self.dev)
      layout.bind("p", seg, seg.persistent)
    end
  end
  -- The fp32 master (the working buffer itself where the plan says so) and
  -- the optimizer's states, where offload_optimizer puts them.
  local oo = s.offload_opt
  self.states = offload.states{
    n = self:numel(P.optimizer.extent), master = not P.master.alias, master_dtype = P.master.dtype,
    names = self.optimizer.states,
    formats = P.optimizer.formats,
    tier = P.optimizer.tier, nvme_path = oo.nvme_path, aio = s.aio, sub_group_size = s.sub_group,
    buffer_count = oo.buffer_count, pipeline_read = oo.pipeline_read,
    pipeline_write = oo.pipeline_write, params = self.pshard, work_dtype = pp.dtype,
    compute = self.dev, grads = P:swapped("opt_grads"),
    small = States.small_numel(L, P, self.rank, self.world, self.small_below),
    signed = self.optimizer.state_signed,
  }
  if P.master.alias then self.master = self.work else self.master = self.states.master end
  -- The gradients (none on the device when stages 2-3 reduce straight into
  -- the optimizer's host shard), and what the optimizer reads: the same
  -- buffer, or a shard of its own in host memory.
  local G, OG = P.grads, P.opt_grads
  if G.extent ~= "none" then
    -- (zeros from the start: padding and fresh segments rely on it)
    self.grads = self:buffer(self:numel(G.extent), G.dtype, "grads", G.tier):zero()
  end
  if OG.alias then
    self.ograds = self.grads
  elseif P:swapped("opt_grads") then
    local st = self.states
    local buffers = {}
    for i, b in ipairs(st.buffers) do buffers[i] = b.grad end
    self.spill = spill.new{ groups = st.groups, G = st.G, tier = OG.tier,
                            nvme_path = oo.nvme_path,
                            aio = offload.swap_opts(s.aio), buffers = buffers,
                            make_buffer = function() return offload.staging(st.G, "f32", self.dev) end }
    st.spill = self.spill
  else
    self.ograds = self:buffer(self:numel(OG.extent), OG.dtype, "grads", OG.tier):zero()
  end
  -- Device memory holds the comm buffers live at once, plus idle ones up
  -- to that: the prefetch window beside the largest module gathered, and
  -- reduce_bucket_size of gradients beside the largest module's.
  -- The pool keeps idle buffers up to the working set (the prefetch window
  -- and the largest module gathered, the reduce bucket and the largest
  -- module's gradients), what tools/estimate counts as comm.
  local largest = 0
  for _, seg in ipairs(L.segments) do largest = math.max(largest, seg.padded) end
  for _, seg in ipairs(self.LF and self.LF.segments or {}) do
    largest = math.max(largest, seg.padded)
  end
  self.pool:set_cap((s.prefetch + 2 * largest) * Placement.esize[self.wdt] +
                    (s.reduce_bucket + largest) * Placement.esize.f32)
  -- The buffer reductions add into (P.reduce.dst).
  self.rgrads = P.reduce.dst == "grads" and self.grads or self.ograds
  -- Half gradients pass through an fp32 scratch of 2 x CHUNK elements on
  -- the device of the gradients the optimizer reads and of those the
  -- reductions add into; added into fp32 ones (the optimizer's host shard)
  -- they are rounded to gdt through round_scratch.
  if self.half_grads then
    for _, t in ipairs({ self.ograds or "cpu", self.rgrads or "cpu" }) do
      local d = t == "cpu" and t or t:device_name()
      if not self.scratches[d] then
        self.scratches[d] = lz.tensor({ 2 * layout.CHUNK }, "f32", "workspace", d)
      end
    end
  end
  if self.half_grads and P[P.reduce.dst].dtype == "f32" then
    self.round_scratch = lz.tensor({ layout.CHUNK }, self.gdt, "workspace")
  end
  -- The gathers' slices copied to the device on the copy stream: the
  -- gather waits for this event.
  if pp.upload and s.overlap then self.staged = lz.event() end
  -- A host optimizer whose working parameters live on the device writes
  -- the updated working shard to host staging, copied to the device after
  -- each sub-group (on the copy stream, overlapping the next group's update).
  if P.push_params then
    self.wstage = offload.host({ L.shard_numel }, pp.dtype, self.dev)
    self.pushed = lz.event()
  end
  if not P.reduce.buffered then
    for _, seg in ipairs(L.segments) do
      layout.bind("g", seg, self.grads:view(seg.full_offset, { seg.padded }))
    end
  end
  -- The model states as numbers: weights, the optimizer's calls, what
  -- checkpoints visit (zero/states.lua).
  self.matrices = Matrices.new{
    L = L, P = P, rank = self.rank, world = self.world, comm = self.comm, ring = self.states,
    model = self.model, optimizer = self.optimizer, budget = s.allgather_bucket,
    comm_of = function(seg) return self:comm_of(seg) end,
  }
  self.model_states = States.new{
    P = P, L = L, rank = self.rank, world = self.world, comm = self.comm, model = self.model,
    ring = self.states, master = self.master, work = self.work, wstage = self.wstage,
    ograds = self.ograds, half_grads = self.half_grads, scratches = self.scratches,
    frozen = self.frozen, overlap = s.overlap, matrices = self.matrices, seed = self.seed,
    small_below = self.small_below,
    Lw = self.Lw, comm_of = function(seg) return self:comm_of(seg) end,
    owner = self.Lw and function(wseg) return self.owner(wseg.entries[1].entry) end,
  }
  -- Gradient reduction: a component over these buffers (zero/reduce.lua).
  self.reducer = reduce.new{
    P = P, s = s, comm = self.comm, rank = self.rank, L = L, pool = self.pool,
    hpool = self.hpool, half_grads = self.half_grads, gdt = self.gdt, grads = self.grads,
    ograds = self.ograds, rgrads = self.rgrads, spill = self.spill, scratches = self.scratches,
    round_scratch = self.round_scratch,
    boundary = function() return self:is_gradient_accumulation_boundary() end,
    comm_of = function(seg) return self:comm_of(seg) end,
    norm_slice = function(seg)
      return not self.norm_slots and self.grad_slices and self.grad_slices[seg.index]
    end,
  }
  -- Parameter gathers and the module hooks: a component over the
  -- parameter groups (segs_of) and the working copy (zero/gather.lua).
  self.gatherer = gather.new{
    P = P, s = s, comm = self.comm, rank = self.rank, pool = self.pool, wdt = self.wdt, L = L,
    LF = self.LF, work = self.work, staged = self.staged, segs_of = self.segs_of,
    reducer = self.reducer, comm_of = function(seg) return self:comm_of(seg) end,
  }
end

-- The gatherer's calls the engine's step, its parts and users make.
function Engine:gather_params() self.gatherer:gather_params() end
-- Expert bytes this rank's gathers read since the last call, and what
-- gathering every expert would have read (zero/gather.lua).
function Engine:expert_bytes() return self.gatherer:take_expert_bytes() end
function Engine:shard_slice(seg) return self.gatherer:shard_slice(seg) end
function Engine:release_slice(stage) self.gatherer:release_slice(stage) end

-- The reducer's calls the engine's step, hooks and users make.
function Engine:zero_grad() self.reducer:zero_grad() end
-- The gradient buffers as numbers between steps (the REPL's norms): zeros
-- where the next backward would write.
function Engine:settle_grads() self.reducer:zero_fresh() end
function Engine:wait_all() self.reducer:wait_all() end
function Engine:pull_grads() self.reducer:pull_grads() end
function Engine:wait_copies(ev) self.reducer:wait_copies(ev) end
-- Seconds the host has waited so far for host<->device copies queued to
-- overlap with compute (overlap_comm): the part of their time not hidden.
function Engine:copy_wait_s() return self.reducer.copy_wait end

-- The frozen parameters' checksum and bytes in memory (tests, LoRA runs).
function Engine:frozen_checksum() return self.frozen:checksum(self.gatherer, self.comm) end
function Engine:frozen_bytes() return self.frozen:bytes() end

-- The norm's canonical partials: this rank's gradient slices, and the
-- buffers one all-gather exchanges them (and the loss) through.
function Engine:norm_parts()
  local L, P = self.L, self.P
  self.grad_slices = {}
  for i, seg in ipairs(L.segments) do
    if self.ograds then
      self.grad_slices[i] = self.ograds:view(Placement.offset(P.opt_grads.extent, seg.mine),
                                             { seg.slice })
    end
  end
  local K = #L.segments + 1 -- the loss, then one partial per segment
  if self.Lw then
    local k
    k, self.norm_slots, self.reducer.norm_of = experts.norm_slots(self)
    K = k + 1
  end
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

local function is_boundary(self) return self.micro % self.s.accum == 0 end

-- The model calls the engine around each module (zero/gather.lua).
function Engine:install_hooks()
  local model = self.model
  model:register_hook("pre_forward", function(m) self.gatherer:pre_forward(m) end)
  model:register_hook("post_forward", function(m) self.gatherer:post_forward(m) end)
  model:register_hook("pre_backward", function(m) self.gatherer:pre_backward(m) end)
  model:register_hook("post_backward", function(m) self.gatherer:post_backward(m) end)
  model:register_hook("pre_recompute", function(m) self.gatherer:pre_recompute(m) end)
  model:register_hook("post_recompute", function(m) self.gatherer:post_recompute(m) end)
  if self.P.moe and self.P.moe.routed_only then
    model.ctx.agree_routed = function(count, n) return self.gatherer:agree_routed(count, n) end
  end
end

------------------------------------------------------- forward, backward

-- extra: a batch's packed documents ({ pos =, seg = }), or nil. Returns
-- the first thing the model's forward returns (a CausalLM: the loss; its
-- logits are engine.model.logits): engine:backward(engine:forward(x, y)).
function Engine:forward(x, y, extra)
  local model = self.model
  if model.check_batch then model:check_batch(x, y) end
  if model.ctx.cast_arena then model.ctx.cast_arena:reset() end
  self.gatherer:begin_pass(false)
  local loss = model:forward(x, y, extra)
  self.gatherer:end_pass(false)
  self.forwarded = (y == nil and model.backward_needs_targets) and "logits" or true
  return loss
end

-- Backward of the last forward; the loss is scaled by 1/accumulation steps
-- and by the fp16 loss scale. What follows the loss goes to the model's
-- backward after that scale (a model of one's own: the gradient of its
-- output, say).
function Engine:backward(loss, ...)
  if self.forwarded ~= true then
    error(self.forwarded and "engine: backward after engine:forward(x) without targets, " ..
          "which computes the logits only: call engine:forward(x, y) before engine:backward" or
          "engine: backward without a forward before it (backward twice?): call " ..
          "engine:forward(x, y) before each engine:backward(loss)", 2)
  end
  self.forwarded = false
  self.micro = self.micro + 1
  local w = self.loss_weight -- (a micro-batch's share of its step's targets: zero/batches.lua)
  if loss then
    self.loss_sum = self.loss_sum + (w and loss * w or loss)
    self.loss_count = self.loss_count + 1
  end
  self.gatherer:begin_pass(true)
  if self.spill then self.spill:begin_micro((self.micro - 1) % self.s.accum == 0) end
  local scale = self.scaler.scale / self.s.accum
  self.model:backward(w and scale * w or scale, ...)
  self.gatherer:end_pass(true)
  if self.P.reduce.buffered or is_boundary(self) then self:wait_all() end
  if self.spill then self.spill:end_micro() end
end

function Engine:is_gradient_accumulation_boundary() return is_boundary(self) end

---------------------------------------------------------------- the step

local function inject_inf(self)
  local k = tonumber(os.getenv("LZ_INJECT_INF_STEP") or "")
  if k and k == self.global_steps + 1 and self.rank == 0 then
    if self.spill then self.reducer.spill_sq[1] = math.huge; return end
    local inf = lz.from_table({ math.huge }, { 1 }, self.grad_slices[1]:dtype_name())
    self.grad_slices[1]:view(0, { 1 }):copy(inf)
    self.reducer.norm_sq[1] = nil
    self.reducer:forget_norm_blocks()
    inf:free()
  end
end

-- Gathers every rank's loss and norm partials (as doubles) in one
-- all-gather; sums them in canonical order (segment, then slice).
function Engine:exchange(local_loss)
  local K, W = self.meta_k, self.world
  local send = ffi.cast("double *", self.meta_send.data)
  send[0] = local_loss
  if self.spill then
    local sq = self.reducer.spill_sq
    for i = 1, K - 1 do send[i] = sq[i] or 0 end
  elseif self.norm_slots then
    for i = 1, K - 1 do send[i] = 0 end
    for _, ns in ipairs(self.norm_slots) do send[ns.slot] = ns.g:sq_norm() end
  else
    -- (a partial the last micro-step's add took, else of block partials a
    -- backward took as it wrote them and a pass over the rest)
    local r, fused = self.reducer, self.reducer.norm_sq
    for i, g in ipairs(self.grad_slices) do send[i] = fused[i] or r:slice_sq_norm(i, g) end
    self.reducer.norm_sq = {}
  end
  self.comm.all_gather(self.meta_send, self.meta_recv)
  local all = ffi.cast("double *", self.meta_recv.data)
  local loss = 0
  for r = 0, W - 1 do loss = loss + all[r * K] end
  local sq = 0
  if self.norm_slots then
    for i = 1, K - 1 do
      local v = 0
      for r = 0, W - 1 do v = v + all[r * K + i] end
      sq = sq + v
    end
    return loss / W, sq
  end
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
  if self.micro == self.stepped_at then
    error("engine: step before backward: no gradients since the last step; call " ..
          "engine:forward(x, y) and engine:backward(loss) first (or engine:train_batch)", 2)
  end
  -- (before the accumulation boundary: nothing, and nil, as DeepSpeed's step)
  if not is_boundary(self) then return nil end
  self.stepped_at = self.micro
  if self.spill then self.spill:finish() end
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
  if self.P.push_params then self:wait_copies(self.pushed) end -- the last step's copies
  self.model_states:update(self.optimizer, self.optimizer_steps, lr, scale)
  if self.P.push_params then
    -- The device's kernels and collectives run after the new parameters landed.
    self.pushed:record("copy")
    self.pushed:wait_on("compute")
  end
  self:gather_params()
  self:zero_grad()
  return rec
end

local batches = require("luazero.zero.batches")
Engine.train_batch, Engine.evaluate = batches.train_batch, batches.evaluate

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
  for _, t in pairs(self.scratches) do t:free() end
  self.states:free()
  if self.pshard then self.pshard:free() end
  if self.ep_group then
    self.model.ctx.ep_group = nil
    self.edp_group:free()
    self.ep_group:free()
  end
  self.master = nil
  f(self.work)
  for _, seg in ipairs(self.L.segments) do f(seg.persistent) end
  f(self.meta_send); f(self.meta_recv); f(self.round_scratch)
  self.frozen:free()
  local ctx = self.model.ctx
  if ctx.cast_arena then ctx.cast_arena:free(); ctx.cast_arena = nil end
  self.model:release_arenas()
  self.model.zero_engine = nil
  setmetatable(self, api.freed(Engine))
end

M.Engine = Engine
return M
