-- estimate/rank.lua — a rank's whole story: beside the model states
-- (luazero/estimate.lua), what the engine allocates per rank for every
-- placement (the staging of zero/offload.lua and zero/spill.lua, frozen
-- parameters, comm buffers), its NVMe swap files and the bytes they move
-- per optimizer step, the time the disk needs for them, and stage "auto"'s
-- fall-back on NVMe. luazero.estimate re-exports every function here.
--
--   local estimate = require("luazero.estimate")
--   local r = estimate.rank(estimate.counts(model, world), { stage = 3, offload = "nvme" })
--   r.device.total, r.host.total, r.nvme.total, r.traffic.read, r.disk_s
local Placement = require("luazero.zero.plan")
local store = require("luazero.zero.store")
local formats = require("luazero.optim.formats")
local Matrices = require("luazero.zero.matrices")
local States = require("luazero.zero.states")
local moe_config = require("luazero.config.moe")
local Disk = require("luazero.estimate.disk")

local M = {}

local esize = Placement.esize
-- The model-state half (placements, dtypes, formatting): luazero.estimate,
-- which hands itself over (M.bind) as it loads this half, so neither
-- requires the other in a circle.
local E
function M.bind(model_half) E = model_half end

-- What the engine holds per rank beyond the model states, and what the
-- NVMe tier moves: the staging zero/offload.lua allocates (its ring of
-- optimizer sub-groups, the parameter shard's read buffers), the gradient
-- spill's group buffers, the working set of gathered modules and gradient
-- staging (comm), frozen parameters, the swap files' sizes and the bytes
-- read and written per optimizer step. M.rank takes the element counts of
-- M.counts (a model) or M.counts_of_params (a bare count).

local GRAIN, PAGE, STAGING_MIN = 2048, 4096, 2 ^ 21 -- offload.lua's
local function round_up(n, m) return math.ceil(n / m) * m end

-- The engine's element counts for a model (declared; LoRA applied or not)
-- at world size `world`: the trainable layout (zero/layout.lua over
-- model:trainable_table()): full, shard, numel, persistent (padded elements
-- of the modules of at most `threshold` elements), segments ({padded,
-- slice, shard_offset, numel, users: the modules that gather it, persistent}),
-- largest (padded elements of the largest module); frozen ({numel, full,
-- shard, largest}: the frozen parameters, laid out as the trainable ones);
-- L (the layout); hidden (the hidden layers' modules, zero/matrices.lua's).
-- block: an optimizer's block-scaled states' block (formats.block_of),
-- which the trainable layout aligns each tensor to.
-- ep_size (moe.ep_size; 1): the trainable layout cut where the experts'
-- owner changes, as the engine cuts it (zero/experts.lua's world_layout),
-- and beside it edp: the same counts for the layout that keeps only one
-- rank's experts, sliced over its expert-data-parallel group (every rank
-- holds as many: E / ep_size experts of each block), which M.rank takes
-- where the plan places the experts so. A segment gathered per expert
-- says its block's experts and top_k (expert = { n, k }) for the reads of
-- moe.routed_only.
function M.counts(model, world, threshold, block, ep_size)
  threshold = threshold or 100000
  ep_size = ep_size or 1
  local layout = require("luazero.zero.layout")
  local trainable, frozen = model:trainable_table(), {}
  for _, e in ipairs(model.param_table) do
    if e.frozen then frozen[#frozen + 1] = e end
  end
  local place
  if ep_size > 1 then
    place = { rank = 0, ep_size = ep_size, owner = layout.expert_owner(ep_size), everywhere = true }
  end
  local L = layout.new(trainable, world, nil, block, place)
  local F = #frozen > 0 and layout.new(frozen, world)
  -- (the experts gathered one by one: each unit's block)
  local expert_of = {}
  for _, b in ipairs(model.routers or {}) do
    if b.n_experts % ep_size ~= 0 then
      error(("estimate: expert parallelism places the %d experts on the %d ranks of an " ..
             "expert-parallel group, as many each: set moe.ep_size to a divisor of %d")
            :format(b.n_experts, ep_size, b.n_experts), 0)
    end
    for _, u in ipairs(b.experts.units or {}) do
      if u.module ~= b.experts then expert_of[u.module] = { n = b.n_experts, k = b.top_k } end
    end
  end
  -- Modules that gather each segment: its own (or the LoRA wrapper around
  -- it), and those that read a tied table.
  local by_name = {}
  for _, e in ipairs(model.param_table) do by_name[e.name] = e end
  local users = {}
  for _, seg in ipairs(L.segments) do users[seg] = 1 end
  for _, seg in ipairs(F and F.segments or {}) do users[seg] = 1 end
  model:walk(function(m)
    for _, name in pairs(m.tied or {}) do
      local e = by_name[name]
      local seg = e and (L.by_module[e.module] or F and F.by_module[e.module])
      if seg then users[seg] = users[seg] + 1 end
    end
  end)
  local function segments_of(layout_)
    local list = {}
    for _, seg in ipairs(layout_.segments) do
      list[#list + 1] = { padded = seg.padded, slice = seg.slice, numel = seg.numel,
                          shard_offset = seg.shard_offset, users = users[seg] or 1,
                          persistent = seg.numel <= threshold, expert = expert_of[seg.module] }
    end
    return list
  end
  local function trained(layout_)
    local c = { world = world, threshold = threshold, full = layout_.full_numel,
                shard = layout_.shard_numel, numel = layout_.numel, persistent = 0, largest = 0,
                segments = segments_of(layout_), L = layout_, ep_size = ep_size }
    for _, seg in ipairs(c.segments) do
      if seg.persistent then c.persistent = c.persistent + seg.padded end
      c.largest = math.max(c.largest, seg.padded)
    end
    return c
  end
  local c = trained(L)
  -- (the hidden layers' modules: which weights an optimizer of whole
  -- matrices updates so, zero/matrices.lua)
  c.hidden = Matrices.hidden_modules(model)
  if place then
    local edp = layout.new(trainable, world, nil, block, { rank = 0, ep_size = ep_size,
                                                           owner = place.owner })
    if edp.elsewhere > 0 then
      for _, seg in ipairs(edp.segments) do users[seg] = users[L.by_module[seg.module]] end
      c.edp = trained(edp)
      c.edp.elsewhere = edp.elsewhere
    end
  end
  c.frozen = { numel = 0, full = 0, shard = 0, largest = 0, persistent = 0, segments = {} }
  if F then
    c.frozen = { numel = F.numel, full = F.full_numel, shard = F.shard_numel, largest = 0,
                 persistent = 0, segments = segments_of(F) }
    for _, seg in ipairs(c.frozen.segments) do
      c.frozen.largest = math.max(c.frozen.largest, seg.padded)
      if seg.persistent then c.frozen.persistent = c.frozen.persistent + seg.padded end
    end
  end
  if c.edp then c.edp.frozen, c.edp.hidden = c.frozen, c.hidden end
  return c
end

-- Counts for a bare parameter count: padded as one tensor, no segments
-- (the parameter shard's staging and reads are then figured from the
-- shard and offload_param.buffer_size), persistent P, largest module
-- `largest` (default: none known).
function M.counts_of_params(params, world, persistent, largest)
  local shard = math.ceil(params / world)
  return { world = world, full = params, shard = shard, numel = params,
           persistent = persistent or 0, largest = largest or 0,
           frozen = { numel = 0, full = 0, shard = 0, largest = 0, persistent = 0 } }
end

-- The engine's settings a rank's bytes depend on, with the config's
-- defaults (luazero.config): from a normalised DeepSpeed config, or a
-- partial table. Returns opts for M.rank.
function M.settings_of(cfg, device)
  return M.settings_from(require("luazero.zero.engine").settings(cfg), device)
end

-- What the estimate reads of an optimizer (optim.new's), into t (returned):
-- its name, states and their formats, master format, whether it updates
-- whole matrices (whole_matrices: its name; matrix_optimizer: the optimizer,
-- whose orthogonalize_scratch the estimate counts) and the size below
-- which a block-scaled optimizer keeps f32 states (small_below).
function M.optimizer_settings(o, t)
  t = t or {}
  t.optimizer, t.master_format = o.name, o.master_format
  t.states, t.formats = o.states, o.state_formats
  t.whole_matrices, t.matrix_optimizer = o.matrix and o.name or nil, o.matrix and o or nil
  t.small_below = o.block_min_numel
  return t
end

-- The same from the engine's settings (zero/engine.lua's settings(cfg));
-- states: the optimizer's per-element states, formats their formats
-- (default: its config's); the rest of the optimizer's from its config
-- (M.optimizer_settings).
function M.settings_from(s, device, states, formats)
  local opt = s.offload_opt or {}
  local par = s.offload_param or {}
  local t = M.optimizer_settings(require("luazero.optim").new(s.optimizer), {
    stage = s.stage, dtype = s.dtype, grads = s.grad_dtype ~= "fp32" and "working" or "fp32",
    device = device, offload = E.placement_name(opt.device or "none", par.device or "none"),
    opt = opt.device or "none", param = par.device or "none",
    sub_group_size = s.sub_group, opt_buffer_count = opt.buffer_count,
    param_buffer_count = par.buffer_count, param_buffer_size = par.buffer_size,
    accum = s.accum, overlap = s.overlap,
    prefetch = s.prefetch,
    reduce_bucket = s.reduce_bucket, allgather_bucket = s.allgather_bucket,
    ep_size = s.ep_size, routed_only = s.routed_only, expert_placement = s.expert_placement,
    moe_gather = s.moe_gather,
  })
  t.states, t.formats = states or t.states, formats or t.formats
  return t
end

local config_defaults = nil
local function defaults()
  if not config_defaults then
    local config = require("luazero.config")
    config_defaults = { z = config.zero_defaults, opt = config.offload_optimizer_defaults,
                        par = config.offload_param_defaults }
  end
  return config_defaults
end

-- A staging buffer of n elements of dtype as offload.lua makes it: at least
-- 2 MiB (huge pages, O_DIRECT alignment).
local function staging_bytes(n, dtype)
  local es = esize[dtype]
  return math.max(n, math.ceil(STAGING_MIN / es)) * es
end

-- The bytes a parameter-shard read stages for a slice (whole 4 KiB pages).
local function span_elems(off, len, es)
  local a = math.floor(off * es / PAGE) * PAGE
  local b = round_up((off + len) * es, PAGE)
  return (b - a) / es
end

-- The distinct slice sizes of the modules (a set).
local function slice_sizes(counts)
  local set = {}
  for _, seg in ipairs(counts.segments) do set[seg.slice] = true end
  return set
end

-- Reads of a parameter store on NVMe (zero/offload.lua's param_shard): each
-- gathered module's slice, in whole pages, in forward and backward of every
-- micro-step (once per module that gathers it); with after_step, the
-- persistent modules' slices after the step. Staging buffers are kept per
-- span size: as many of a size as are read at once (a module's own slice
-- is released before the next ones are read ahead: up to buffer_count of
-- the next modules' with overlap_comm; every persistent module's after the
-- step). routed (moe.routed_only): { tokens = N * W }, N tokens a
-- micro-batch on each of W ranks: an expert gathered on its own is read
-- only where some rank routed to it, its reads counted at the share
-- uniform routing leaves routed (estimate/moe.lua's). Returns the bytes
-- read per step and the staging bytes.
local function slice_reads(segments, wb, wdt, accum, overlap, par_nb, after_step, routed)
  local read, stage_bytes = 0, 0
  local seq, after_need = {}, {}
  for _, seg in ipairs(segments) do
    local e = span_elems(seg.shard_offset, seg.slice, wb)
    if not seg.persistent then
      local share = 1
      if routed and seg.expert then
        share = 1 - (1 - seg.expert.k / seg.expert.n) ^ routed.tokens
      end
      read = read + 2 * accum * seg.users * e * wb * share
      seq[#seq + 1] = e
    elseif after_step then
      read = read + e * wb
      after_need[e] = (after_need[e] or 0) + 1
    end
  end
  -- The slices held at once: a window of the gather order (module order,
  -- backward the reverse), as many of each size as one window holds.
  local ahead = overlap and math.max(1, math.min(par_nb, #seq - 1)) or 1
  local keys = {}
  for i = 1, #seq do
    local in_window = {}
    for j = i, math.min(#seq, i + ahead - 1) do
      local e = seq[j]
      in_window[e] = (in_window[e] or 0) + 1
      keys[e] = math.max(keys[e] or 0, in_window[e])
    end
  end
  for e, n in pairs(after_need) do keys[e] = math.max(keys[e] or 0, overlap and n or 1) end
  for e, n in pairs(keys) do stage_bytes = stage_bytes + n * staging_bytes(e, wdt) end
  return read, stage_bytes
end

local function add(t, name, bytes)
  if bytes == 0 then return end
  t[name] = (t[name] or 0) + bytes
  t.total = t.total + bytes
end

-- Per-rank bytes of one placement, the whole story. counts: M.counts or
-- M.counts_of_params. opts: stage (0..3), dtype (bf16), grads (fp32 |
-- working), device ("cuda": an accelerator, its memory apart; "sim": the
-- same, placed as the engine places it on sim; "cpu": one memory, all of
-- it host), offload (a placement name: E.placements) or opt
-- and param (offload devices), sub_group_size, opt_buffer_count,
-- param_buffer_count, param_buffer_size, states ({ "m", "v" }), accum (1),
-- overlap (overlap_comm; stage 3's default), prefetch, reduce_bucket
-- (the config's defaults), read_gbps, write_gbps (the disk: 1.9 / 1.1).
-- ep_size (moe.ep_size; 1): where the plan keeps the experts in their
-- expert-data-parallel group (its experts "edp"), the counts' edp layout
-- is the rank's (an optimizer of whole matrices too: each expert's owned
-- by a rank of its group, zero/matrices.lua); routed_only and tokens (moe.routed_only;
-- tokens a micro-batch on one rank): stage 3's reads of experts gathered
-- one by one at the share uniform routing leaves routed.
-- Returns nil where the placement needs another stage; else { device,
-- host, nvme (each { total, <part> = bytes }), traffic = { read, written,
-- parts = { [name] = {read, written} } }, disk_s (the step time the disk
-- alone allows), groups, G, plan, placement, stage, experts ("edp" or
-- "world" under expert parallelism) }.
function M.rank(counts, opts)
  local D = defaults()
  local stage = opts.stage or 0
  local dtype = opts.dtype or "bf16"
  E.check_dtype(dtype)
  local opt, param = opts.opt, opts.param
  if opts.offload then
    local pl = E.placement_of[opts.offload]
    if not pl then
      error(("estimate: offload must be %s (got %s)"):format(E.placement_list(),
            tostring(opts.offload)), 0)
    end
    opt, param = pl.opt, pl.param
  end
  opt, param = opt or "none", param or "none"
  if (Placement.offloaded(opt) and not Placement.stage_allows("offload_optimizer", stage)) or
     (Placement.offloaded(param) and not Placement.stage_allows("offload_param", stage)) then
    return nil
  end
  local device = opts.device or "cuda"
  if not Placement.placement_allowed(device, opt, param) then return nil end
  local accum = opts.accum or 1
  local P = Placement.new{ stage = stage, dtype = dtype,
                           grad_dtype = opts.grads == "working" and dtype or "fp32",
                           offload_optimizer = opt, offload_param = param,
                           device = (device == "cpu" or device == "sim") and device or "cuda",
                           accum = accum,
                           optimizer_states = opts.states, optimizer_formats = opts.formats,
                           master_format = opts.master_format, ep_size = opts.ep_size,
                           expert_placement = opts.expert_placement }
  -- What the engine refuses for this optimizer here (its whole matrices
  -- in swap files): no row, and the reason.
  local refused = opts.whole_matrices and Matrices.refusal(P, opts.whole_matrices)
  if refused then return nil, refused end
  -- The experts in their group where the engine keeps them there
  -- (zero/experts.lua's place).
  local experts = P.ep_size > 1 and "world" or nil
  if P.experts == "edp" and counts.edp then
    counts, experts = counts.edp, "edp"
  end
  local routed = opts.routed_only and opts.tokens and { tokens = opts.tokens * counts.world }
  local wdt, wb = P.dtype, esize[P.dtype]
  local overlap = opts.overlap
  if overlap == nil then overlap = stage == 3 end
  local sub_group = opts.sub_group_size or D.z.sub_group_size
  local prefetch = opts.prefetch or D.z.stage3_prefetch_bucket_size
  local reduce_bucket = opts.reduce_bucket or D.z.reduce_bucket_size
  local opt_nb = opts.opt_buffer_count or D.opt.buffer_count
  local par_nb = opts.param_buffer_count or D.par.buffer_count
  local par_bs = opts.param_buffer_size or D.par.buffer_size
  local r = { stage = stage, placement = E.placement_name(opt, param) or (opt .. "/" .. param),
              opt = opt, param = param, dtype = dtype, device_kind = device, plan = P,
              experts = experts,
              device = { total = 0 }, host = { total = 0 }, nvme = { total = 0 },
              traffic = { read = 0, written = 0, parts = {} } }
  -- On a cpu device the device is the host: one memory, counted as host.
  local mem = { device = device == "cpu" and r.host or r.device, host = r.host, nvme = r.nvme }
  local function io(name, read, written)
    if read == 0 and written == 0 then return end
    r.traffic.parts[name] = { read = read, written = written }
    r.traffic.read = r.traffic.read + read
    r.traffic.written = r.traffic.written + written
  end

  -- The model states, where the plan puts them (swap files: their sizes below).
  local by = P:bytes{ full = counts.full, shard = counts.shard, persistent = counts.persistent }
  r.states = by
  for _, tier in ipairs({ "device", "host" }) do
    for _, cat in ipairs({ "params", "grads", "optimizer" }) do add(mem[tier], cat, by[tier][cat]) end
  end
  local n_opt = P.optimizer.extent == "full" and counts.full or counts.shard
  -- Tensors under a block-scaled optimizer's minimum (small_below) keep f32
  -- states beside the block-scaled arrays (zero/states.lua's small runs):
  -- in the optimizer's memory, or host memory beside states on NVMe.
  local block = formats.block_of(P.optimizer.formats)
  if block and opts.small_below and counts.L then
    local small = States.small_numel(counts.L, P, 0, counts.world, opts.small_below)
    local kind = P:store("optimizer")
    for _, name in ipairs(P.optimizer.states) do
      if formats.get(P.optimizer.formats[name]).block then
        add(mem[kind.resident and kind.memory or "host"], "optimizer", small * esize.f32)
      end
    end
  end

  -- An optimizer of whole matrices (zero/matrices.lua): each step gathers
  -- them (sharded) and orthogonalises those this rank owns, in workspace
  -- beside its states, made and freed in the step: this rank's (rank 0,
  -- which owns the largest matrix) peak, apart from what the engine keeps.
  if opts.matrix_optimizer and counts.L then
    local ep_ranks = P.ep_size > 1 and select(2, moe_config.groups(P.ep_size, counts.world, 0))
    local placed = Matrices.placement(counts.L, counts.hidden, opts.matrix_optimizer,
                                      counts.world, function(seg)
      return seg.group == "edp" and ep_ranks or nil
    end)
    add(mem[P:store("optimizer").memory or "host"], "optimizer scratch",
        Matrices.scratch_bytes(placed, opts.matrix_optimizer, 0, P.optimizer.extent == "full",
                               opts.allgather_bucket or D.z.allgather_bucket_size))
  end

  -- Frozen parameters (LoRA's base): where the plan puts them, else (an
  -- engine without p.frozen) whole on the device in the working dtype.
  -- (Whole: unpadded, one buffer; sharded: the frozen layout's shard.)
  local F = P.frozen or { extent = "full", dtype = wdt, tier = "device" }
  local fc = counts.frozen
  local frozen_n = F.extent == "shard" and fc.shard or fc.numel
  if F.extent == "none" or fc.numel == 0 then frozen_n = 0 end
  local frozen_bytes = frozen_n * esize[F.dtype]
  local frozen_kind = store.get(F.tier)
  if frozen_kind.resident then add(mem[frozen_kind.memory], "frozen", frozen_bytes) end
  -- Sharded frozen parameters whose small modules the plan keeps whole.
  if F.extent == "shard" and F.persistent then
    add(mem[store.get(F.persistent.tier or "device").memory], "frozen",
        (fc.persistent or 0) * esize[F.dtype])
  end

  -- The optimizer's sub-groups: one group of every element unless a state
  -- lives on NVMe (then sub_group_size, in multiples of 2048 elements).
  local on_disk = P:swapped("optimizer")
  local grads_on_disk = P:swapped("opt_grads") and not P.opt_grads.alias
  local params_on_disk = P:swapped("params")
  local G, groups = n_opt, 1
  if on_disk or params_on_disk or grads_on_disk then
    G = round_up(math.max(1, math.min(sub_group, n_opt)), GRAIN)
    groups = math.ceil(n_opt / G)
  end
  r.G, r.groups = G, groups
  -- A sub-group's region of the state file: the master (where the tier
  -- keeps one, unless it is the parameter file's working copy itself: a
  -- master of its dtype, zero/offload.lua), then each state in its
  -- format's dtype.
  local master_in_params = not P.master.alias and on_disk and params_on_disk
                           and P.master.dtype == wdt
  local region = (P.master.alias or master_in_params) and 0 or G * esize[P.master.dtype]
  for _, name in ipairs(P.optimizer.states) do
    -- (each state, and its scales, on whole pages: zero/offload.lua)
    local f = formats.get(P.optimizer.formats[name])
    region = region + round_up(G * esize[f.dtype], PAGE)
    if f.block then region = region + round_up(G / f.block * esize.f32, PAGE) end
  end
  -- The ring of staging buffers (offload.lua's States).
  local nb = math.min(math.max(2, opt_nb), groups)
  if on_disk or params_on_disk then
    if on_disk then add(r.host, "optimizer staging", nb * staging_bytes(region / 4, "f32")) end
    if params_on_disk then add(r.host, "update staging", nb * staging_bytes(G, wdt)) end
  end
  if on_disk then
    add(r.nvme, "optimizer", round_up(math.max(PAGE, groups * region), PAGE))
    io("optimizer states", P:store("optimizer").bytes_per_step(groups * region))
  end
  -- The fp32 gradient shard on NVMe (zero/spill.lua): added per sub-group
  -- in the ring's gradient buffers (a sub-group each), written in shard
  -- order, read back for the next micro-step's add and by the optimizer.
  if grads_on_disk then
    add(r.host, "gradient staging", nb * staging_bytes(G, "f32"))
    -- Under accumulation the norm's partial of a slice that spans
    -- sub-groups is taken over a copy of it (the largest, at its peak).
    if accum > 1 then add(r.host, "norm scratch", math.ceil(counts.largest / counts.world) * 4) end
    add(r.nvme, "gradients", round_up(math.max(PAGE, groups * G * 4), PAGE))
    io("gradients", accum * groups * G * 4, accum * groups * G * 4)
  end
  -- The working parameter shard on NVMe (stage 3): a swap file in shard
  -- order, read slice by slice for each module's gather (forward and
  -- backward of every micro-step; the persistent modules' after the step),
  -- each slice into a staging buffer of whole pages; written once a step.
  if params_on_disk then
    add(r.nvme, "params", round_up(round_up(counts.shard * wb, PAGE) + PAGE, PAGE))
    local written = 0
    for k = 1, groups do
      local len = math.min(G, n_opt - (k - 1) * G)
      written = written + round_up(len * wb, PAGE)
    end
    local read, stage_bytes
    if counts.segments then
      read, stage_bytes = slice_reads(counts.segments, wb, wdt, accum, overlap, par_nb, true,
                                      routed)
    else
      read = 2 * accum * counts.shard * wb
      stage_bytes = par_nb * staging_bytes(math.min(par_bs, counts.shard), wdt)
    end
    -- (the master read with each sub-group's states, as it is written)
    if master_in_params then read = read + written end
    add(r.host, "parameter staging", stage_bytes)
    io("parameters", read, written)
  end
  -- Frozen parameters on NVMe (stage 3): a file of their own, read per
  -- gather through staging of their own, never written.
  if not frozen_kind.resident and fc.numel > 0 then
    add(r.nvme, "frozen", round_up(round_up(frozen_bytes, PAGE) + PAGE, PAGE))
    local read, stage_bytes
    if fc.segments then
      read, stage_bytes = slice_reads(fc.segments, wb, wdt, accum, overlap, par_nb, false, routed)
    else
      read = 2 * accum * frozen_bytes
      stage_bytes = par_nb * staging_bytes(math.min(par_bs, fc.shard), wdt)
    end
    add(r.host, "parameter staging", stage_bytes)
    io("frozen parameters", read, 0)
  end
  -- Beside an accelerator: the updated working shard pushed from the host
  -- (pinned), and the reduced gradient slices copied off the device.
  if device ~= "cpu" then
    if P.push_params then add(r.host, "update staging", counts.shard * wb) end
    if P.reduce.to_host then
      -- Pooled by size: without overlap_comm one of each slice size (the
      -- modules known), with it reduce_bucket_size in flight.
      local gb = esize[P.grad_dtype]
      local n
      if counts.segments and not overlap then
        n = 0
        for size in pairs(slice_sizes(counts)) do n = n + size end
      else
        n = overlap and math.ceil(reduce_bucket / counts.world) + counts.largest or counts.largest
      end
      add(r.host, "gradient copies", math.min(counts.shard, n) * gb)
    end
  end
  -- The working set (comm): gathered modules at stage 3 (the largest one
  -- and the prefetch window), the gradient staging of the modules being
  -- reduced (the largest, and reduce_bucket_size in flight).
  -- Pooled buffers are kept per size: with the modules known, one of each
  -- size the step uses (the pool's high-water mark without overlap_comm);
  -- beside an accelerator the pool's cap bounds it.
  local largest = counts.largest
  if F.extent == "shard" then largest = math.max(largest, fc.largest) end
  local comm = 0
  local half = P.grad_dtype ~= "f32"
  if counts.segments and not overlap then
    -- Gathered modules (trained and frozen), slices read from host memory
    -- or NVMe on their way to the device, and the gradients reduced.
    local gsizes, usizes, rsizes = {}, {}, {}
    local frozen_up = F.extent == "shard" and not frozen_kind.on_device and device ~= "cpu"
    for _, seg in ipairs(counts.segments) do
      if P.params.gather and not seg.persistent then gsizes[seg.padded] = true end
      if P.params.upload then usizes[seg.slice] = true end
      rsizes[seg.padded] = true
    end
    for _, seg in ipairs(F.extent == "shard" and fc.segments or {}) do
      if not seg.persistent then
        gsizes[seg.padded] = true
        if frozen_up then usizes[seg.slice] = true end
      end
    end
    for n in pairs(gsizes) do comm = comm + n * wb end
    for n in pairs(usizes) do comm = comm + n * wb end
    if P.reduce.buffered then
      for n in pairs(rsizes) do comm = comm + n * (4 + (half and wb or 0)) end
    end
  else
    if P.params.gather then
      -- (the prefetch window holds frozen modules as well as trained ones)
      local gathered = counts.full + (F.extent == "shard" and fc.full or 0)
      comm = comm + (largest + (overlap and math.min(prefetch, gathered) or 0)) * wb
    end
    if P.reduce.buffered then
      comm = comm + (counts.largest + (overlap and math.min(reduce_bucket, counts.full) or 0)) *
                    (4 + (half and wb or 0))
    end
  end
  comm = math.min(comm, (prefetch + 2 * largest) * wb + (reduce_bucket + largest) * 4)
  add(mem.device, "comm", comm)

  local rg, wg = opts.read_gbps or Disk.disk.read_gbps, opts.write_gbps or Disk.disk.write_gbps
  r.disk_s = r.traffic.read / (rg * 1e9) + r.traffic.written / (wg * 1e9)
  return r
end

-- Every placement at every stage it works at, as M.rank rows; rows.refused
-- lists those the engine refuses for this optimizer ({ placement, why }, one
-- per placement).
function M.rank_rows(counts, opts)
  local rows = { refused = {} }
  for _, pl in ipairs(E.placements) do
    local said = false
    for stage = 0, 3 do
      local o = {}
      for k, v in pairs(opts) do o[k] = v end
      o.stage, o.offload, o.opt, o.param = stage, pl.name, nil, nil
      local r, why = M.rank(counts, o)
      if r then rows[#rows + 1] = r end
      if why and not said then
        rows.refused[#rows.refused + 1] = { placement = pl.name, why = why }
        said = true
      end
    end
  end
  return rows
end

-- The model states only (what the ledger's params, grads, optimizer and
-- offload categories hold, staging included), the host total less the
-- working set and the optimizer's scratch: what the engine keeps whatever
-- its batch.
function M.kept(r, tier)
  local t = r[tier]
  return t.total - (t.comm or 0) - (t["optimizer scratch"] or 0)
end

------------------------------------------------------------------ formatting

-- The order a tier's parts print in.
local part_order = { "params", "grads", "optimizer", "frozen", "optimizer staging",
                     "gradient staging", "norm scratch", "parameter staging", "update staging", "gradient copies",
                     "optimizer scratch", "comm", "gradients" }

local function parts_line(t)
  local out = {}
  for _, name in ipairs(part_order) do
    if t[name] then out[#out + 1] = ("%s %s"):format(name, E.format_bytes(t[name])) end
  end
  return table.concat(out, " + ")
end

-- One row of M.rank as lines: the totals and the NVMe traffic, then each
-- tier part by part (what engine:estimate() prints).
function M.rank_lines(r)
  local fb = E.format_bytes
  local lines = {
    ("ZeRO stage %d, %s, per rank: device %s, host %s, nvme %s"):format(r.stage, r.placement,
      fb(r.device.total), fb(r.host.total), fb(r.nvme.total)),
  }
  for _, tier in ipairs({ "device", "host", "nvme" }) do
    if r[tier].total > 0 then
      local names = {}
      for name in pairs(r[tier]) do if name ~= "total" then names[#names + 1] = name end end
      table.sort(names)
      local parts = {}
      for _, name in ipairs(names) do parts[#parts + 1] = ("%s %s"):format(name, fb(r[tier][name])) end
      lines[#lines + 1] = ("  %-6s %s"):format(tier, table.concat(parts, ", "))
    end
  end
  if r.traffic.read + r.traffic.written > 0 then
    lines[#lines + 1] = ("  nvme per optimizer step: %s read, %s written; the disk alone " ..
                         "allows a step every %.3f s"):format(fb(r.traffic.read),
                         fb(r.traffic.written), r.disk_s)
  end
  return lines
end

-- The per-rank table of M.rank_rows: device, host and NVMe bytes, the NVMe
-- bytes read and written per optimizer step and the seconds the disk needs
-- for them; then where each row's host bytes go. Lines, to print.
function M.rank_table(rows, counts, disk, device)
  local lines = {
    "per rank, all the engine allocates for the model (states, frozen parameters, staging, " ..
    "comm buffers; activations apart) and the NVMe tier's traffic per optimizer step:",
    ("  %-5s %-15s %11s %11s %11s %11s %11s %9s"):format("stage", "placement", "device", "host",
      "nvme", "nvme read", "nvme write", "disk s"),
  }
  local fb = E.format_bytes
  for _, r in ipairs(rows) do
    lines[#lines + 1] = ("  %-5d %-15s %11s %11s %11s %11s %11s %9s"):format(r.stage, r.placement,
      fb(r.device.total), fb(r.host.total), fb(r.nvme.total), fb(r.traffic.read),
      fb(r.traffic.written), r.disk_s > 0 and ("%.3f"):format(r.disk_s) or "-")
  end
  lines[#lines + 1] = ""
  lines[#lines + 1] = "host memory per rank, part by part:"
  for _, r in ipairs(rows) do
    if r.host.total > 0 then
      lines[#lines + 1] = ("  %d %-15s %s"):format(r.stage, r.placement, parts_line(r.host))
    end
  end
  local notes = {}
  if counts.frozen.numel > 0 then
    notes[#notes + 1] = ("frozen: %s parameters with no gradients or optimizer states, in the " ..
                         "working dtype"):format(E.thousands(counts.frozen.numel))
  end
  notes[#notes + 1] = ("disk: %.2f GB/s read, %.2f GB/s write%s; disk s: the step time the " ..
    "disk alone allows (reads and writes one after another)"):format(disk.read_gbps,
    disk.write_gbps, disk.assumed and " (assumed: fio on the development machines; give " ..
    "--measure-disk DIR, or --read-gbps and --write-gbps from bench/bench-aio)" or
    disk.measured and (" (measured in %s)"):format(disk.measured) or "")
  if device == "cpu" then
    notes[#notes + 1] = "device and host are one memory here (--device cpu): all of it under host"
  end
  if (counts.ep_size or 1) > 1 then
    local edp = {}
    for _, r in ipairs(rows) do
      if r.experts == "edp" then edp[#edp + 1] = ("%d %s"):format(r.stage, r.placement) end
    end
    if #edp == #rows then
      notes[#notes + 1] = ("experts: ep_size %d; in every row the experts' parameters under " ..
        "ZeRO over their expert-data-parallel group (a rank holds 1/%d of them)")
        :format(counts.ep_size, counts.ep_size)
    elseif #edp > 0 then
      notes[#notes + 1] = ("experts: ep_size %d; in rows %s, the experts' parameters under " ..
        "ZeRO over their expert-data-parallel group (a rank holds 1/%d of them); the other " ..
        "rows over all ranks, where the engine keeps them"):format(counts.ep_size,
        table.concat(edp, ", "), counts.ep_size)
    else
      notes[#notes + 1] = ("experts: ep_size %d; in every row under ZeRO over all ranks " ..
        "(moe.placement \"world\"; docs/moe.md)"):format(counts.ep_size)
    end
  end
  local refused, why = {}, nil
  for _, x in ipairs(rows.refused or {}) do refused[#refused + 1] = x.placement; why = x.why end
  if #refused > 0 then
    notes[#notes + 1] = ("not offered: %s (%s)"):format(table.concat(refused, ", "), why)
  end
  if not counts.segments then
    notes[#notes + 1] = "without --model: no modules known; comm buffers and the parameter " ..
                        "shard's staging are figured from its size"
  end
  for _, n in ipairs(notes) do lines[#lines + 1] = n end
  return lines
end

-- The figures of tools/estimate as one JSON object (t: what, world, dtype,
-- grads, device, counts, rows, disk, auto, budget).
function M.json(t)
  local cjson = require("cjson")
  local rows = {}
  for _, r in ipairs(t.rows) do
    local parts = {}
    for name, v in pairs(r.traffic.parts) do parts[name] = { read = v.read, written = v.written } end
    rows[#rows + 1] = {
      stage = r.stage, placement = r.placement, offload_optimizer = r.opt, offload_param = r.param,
      device = r.device, host = r.host, nvme = r.nvme, sub_groups = r.groups,
      sub_group_elements = r.G,
      model_states = { device = r.states.device.total, host = r.states.host.total,
                       nvme = r.states.nvme.total },
      nvme_read = r.traffic.read, nvme_written = r.traffic.written, nvme_parts = parts,
      disk_s = r.disk_s,
    }
  end
  local c = t.counts
  return cjson.encode{
    model = t.what, world = t.world, dtype = t.dtype, grads = t.grads, device = t.device,
    params = { trainable = c.numel, full = c.full, shard = c.shard, persistent = c.persistent,
               largest_module = c.largest, frozen = c.frozen.numel, frozen_shard = c.frozen.shard },
    disk = t.disk, stage_auto = t.auto, budget = t.budget, rows = rows,
    not_offered = #(t.rows.refused or {}) > 0 and t.rows.refused or nil,
    optimizer = t.optimizer,
  }
end

------------------------------------------------------------------ stage "auto" on NVMe

-- What a rank keeps on the device and the host (M.kept) at `stage` with
-- `placement` (estimate.placements' name), the run's settings (the
-- optimizer's states and formats, ep_size, ...) on top: the bytes, or nil
-- and why M.rank refuses the placement. all: everything the engine
-- allocates for the model, its comm buffers and the optimizer's scratch
-- too (what a budget the run holds sees at its first step).
function M.need_at(counts, settings, stage, placement, dtype, grads, device, all)
  local o = {}
  for k, v in pairs(settings or {}) do o[k] = v end
  o.stage, o.offload, o.opt, o.param = stage, placement, nil, nil
  o.dtype, o.grads, o.device = dtype, grads, device
  local r, why = M.rank(counts, o)
  if not r then return nil, why end
  if all then return r.device.total + r.host.total end
  return M.kept(r, "device") + M.kept(r, "host")
end

-- The NVMe placement stage "auto" falls back on when no stage fits in
-- memory: stage 3 with the optimizer states on NVMe, else with the
-- parameter shard there too, the first whose memory per rank (model states
-- and staging, device and host together, as the stages' rows count it)
-- fits budget_bytes. (Offload to the CPU moves bytes between device and
-- host, not their sum: no such row fits where stage 3 does not.) opts: as
-- pick_stage's, and counts (M.counts; else figured from params, layout and
-- persistent), device ("cpu" | "cuda"),
-- settings (M.settings_of's: sub_group_size, buffer counts, ...). Returns
-- the placement name or nil, what it puts on NVMe, and the bytes it needs
-- (the last tried when none fits).
function M.pick_nvme(params, world, budget_bytes, dtype, opts)
  local counts = opts.counts
  if not counts then
    counts = M.counts_of_params(params, world, opts.persistent)
    if opts.layout then counts.full, counts.shard = opts.layout.full, opts.layout.shard end
  end
  local device = opts.device or "cuda"
  -- The placements with the optimizer's states in swap files, alone and
  -- with the parameter shard beside them.
  local tries, what = {}, {}
  for _, p in ipairs(E.placements) do
    local opt = store.of_config(p.opt)
    if not opt.resident and (p.param == p.opt or store.of_config(p.param).on_device) then
      tries[#tries + 1] = p.name
      what[p.name] = p.param == p.opt and "the optimizer states and the parameter shard on NVMe"
                     or "the optimizer states on NVMe"
    end
  end
  local need, name, refused
  for _, pl in ipairs(tries) do
    local bytes, why = M.need_at(counts, opts.settings, 3, pl, dtype, opts.grads, device,
                                 opts.all)
    if bytes then
      need, name = bytes, pl
      if need <= budget_bytes then return pl, what[pl], need end
    end
    refused = refused or why
  end
  -- (need nil: the engine refuses every NVMe placement for this optimizer)
  if not need then return nil, refused, nil end
  return nil, what[name], need
end

return M
