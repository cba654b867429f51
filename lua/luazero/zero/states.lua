-- zero/states.lua — the engine's model states as numbers: the initial
-- weights placed where the plan keeps them, the optimizer's calls over its
-- master and states (sub-group by sub-group through the store's ring,
-- resident or on NVMe) and the update that runs them, and what checkpoints
-- and checksums read them through (visit, layout, after_load,
-- master_params, checksum). A component of the engine
-- (engine.model_states), with its own state — the optimizer's calls per
-- sub-group — and the plan, layout and buffers it was made with.
--
--   local ms = States.new{ P = P, L = L, ring = engine.states, master = m, ... }
--   ms:init_weights(seed); ms:build_calls(); ms:update(opt, t, lr, scale)
--   ms:visit(false, function(off, master, m, v) ... end); ms:checksum()
local ffi = require("ffi")
local lz = require("luazero")
local layout = require("luazero.zero.layout")
local Placement = require("luazero.zero.plan")

local at = Placement.offset
local CHUNK = layout.CHUNK
-- Elements a bf16 master's update widens at once (16 MiB of fp32 scratch):
-- each chunk is three kernel calls, whose dispatch costs milliseconds on a
-- loaded machine, so chunks of CHUNK would cost a 3B model minutes a step.
-- (The bits do not depend on it: every element is rounded by its own key.)
local SROUND_CHUNK = 2 ^ 22

local M = {}
local States = {}
States.__index = States

-- parts: P (the plan), L (the trained layout), rank, world, comm, model,
-- ring (the optimizer's states over their store: zero/offload.lua's
-- states, the engine's `states`), master (the fp32 master: the working
-- buffer where the plan aliases it, else the ring's), work (the working
-- copy; nil when it lives in an NVMe file), wstage (host staging of the
-- working shard where the plan pushes parameters, else nil), ograds (the
-- gradients the optimizer reads; nil when they are read from the gradient
-- file), half_grads and scratches (device -> fp32 scratch: the optimizer
-- reads half gradients through it), frozen (zero/frozen.lua: frozen weights
-- in a draw go there), overlap (overlap_comm: pushed parameters are
-- copied on the copy stream), matrices (zero/matrices.lua: the whole-matrix
-- placement of an optimizer that has one, else nil), seed (the run's: the
-- stochastic rounding of a bf16 master is keyed by it), small_below (an
-- optimizer with block-scaled states: tensors of fewer elements keep f32
-- states, the ring's `small` arrays; nil: none); with experts placed
-- in their groups (the plan's experts "edp"): Lw (the world layout),
-- comm_of (seg -> its expert-data-parallel group) and owner (world
-- segment -> the expert-parallel rank holding it, nil for every rank's).
function M.new(parts)
  local self = setmetatable({}, States)
  for _, k in ipairs({ "P", "L", "rank", "world", "comm", "model", "ring", "master", "work",
                       "wstage", "ograds", "half_grads", "scratches", "frozen", "overlap",
                       "matrices", "seed", "small_below", "Lw", "comm_of", "owner" }) do
    self[k] = parts[k]
  end
  return self
end

-- The ranks whose slices this rank's optimizer updates (plan P).
local function optimizer_ranks(P, rank, world)
  local ranks = {}
  if P.optimizer.ranks == "all" then
    for r = 0, world - 1 do ranks[#ranks + 1] = r end
  else
    ranks[1] = rank
  end
  return ranks
end

-- Runs kind by what their states are where the optimizer's are
-- block-scaled: "small" (a tensor under small_below: f32 states), "block"
-- (the block-scaled states) or "pad" (padding: never updated, it stays
-- zero); nil otherwise.
local function kinds(small_below)
  if not small_below then return nil end
  return function(e) return e.numel < small_below and "small" or "block" end
end

-- Elements of this rank's optimizer runs whose states are kept in f32 beside
-- block-scaled ones (the ring's `small` arrays): 0 without a small_below.
function M.small_numel(L, P, rank, world, small_below)
  local n, kind_of = 0, kinds(small_below)
  if not kind_of then return 0 end
  for _, r in ipairs(optimizer_ranks(P, rank, world)) do
    for _, run in ipairs(layout.shard_runs(L, r, nil, false, kind_of)) do
      if run.kind == "small" then n = n + run.numel end
    end
  end
  return n
end

-- Elements of a buffer of this extent on this rank.
local function numel(self, extent)
  if extent == "full" then return self.L.full_numel end
  if extent == "shard" then return self.L.shard_numel end
  return 0
end

------------------------------------------------------------ initial weights

-- Every rank draws the same initial weights (same seed, canonical order),
-- streamed (model:draw_stream): each segment is gathered whole in an fp32
-- temporary, placed where the plan keeps it (the working copy, persistent
-- parameters, a resident master), and, where sub-groups live on NVMe, kept
-- until the sub-groups it falls in are written. Frozen parameters go
-- straight to their own store. So start-up holds a segment or two, not the
-- model.
function States:init_weights(seed)
  local L, model, P = self.L, self.model, self.P
  local where = {}
  for _, seg in ipairs(L.segments) do
    for _, se in ipairs(seg.entries) do where[se.entry.name] = { seg = seg, at = se.seg_offset } end
  end
  local st = self.ring
  local grouped = st.nb > 0
  local own_master = not P.master.alias and not P:swapped("master")
  local full_of, drawing = {}, {}
  local frontier = 0 -- shard elements [0, frontier) drawn and placed
  -- A state's part of segment seg from its drawn fp32 values: the whole
  -- padded segment (full) or this rank's slice (shard).
  -- (Views are freed at once: each keeps its storage alive until freed.)
  local function copy(dst, src, how)
    dst[how](dst, src)
    dst:free()
    if src ~= nil then src:free() end
  end
  local function place(buf, extent, seg, full)
    if extent == "full" then
      copy(buf:view(seg.full_offset, { seg.padded }), full:view(0, { seg.padded }), "convert")
    else
      copy(buf:view(seg.shard_offset, { seg.slice }),
           full:view(seg.mine.full_offset - seg.full_offset, { seg.slice }), "convert")
    end
  end
  local function placed(seg, full)
    if not P:swapped("params") then place(self.work, P.params.extent, seg, full) end
    if seg.persistent then seg.persistent:convert(full) end
    if own_master then place(self.master, P.master.extent, seg, full) end
    frontier = seg.shard_offset + seg.slice
    if grouped then full_of[seg] = full else full:free() end
  end
  local function sink(e, a, t)
    if e.frozen then return self.frozen:write(e, a, t) end
    local w = where[e.name]
    if not w then return end -- (an expert another rank's layout holds)
    local seg = w.seg
    local d = drawing[seg]
    if not d then
      d = { full = lz.tensor({ seg.padded }, "f32", "workspace"):zero(), left = seg.numel }
      drawing[seg] = d
    end
    local v = d.full:view(w.at + a, { t:numel() })
    v:copy(t)
    v:free()
    d.left = d.left - t:numel()
    if d.left == 0 then
      drawing[seg] = nil
      placed(seg, d.full)
    end
  end
  local draw = coroutine.wrap(function()
    model:draw_stream(seed, function(e, a, t) coroutine.yield(e, a, t) end)
  end)
  local finished = false
  local function pump()
    if finished then return false end
    local e, a, t = draw()
    if not e then finished = true; return false end
    sink(e, a, t)
    return true
  end
  -- Sub-groups on NVMe: the master slices and zero states to the state
  -- file, the working copy (the master rounded) to the parameter file,
  -- each group as soon as the segments it covers are drawn.
  if grouped then
    st:each_group(true, function(_, lo, n, v)
      while frontier < lo + n and pump() do end
      if P:swapped("optimizer") then
        if not P.master.alias then
          self:shard_pieces(lo, n, function(seg, a, len)
            local from = seg.mine.full_offset - seg.full_offset + (a - seg.shard_offset)
            copy(v.master:view(a - lo, { len }), full_of[seg]:view(from, { len }), "copy")
          end)
        end
        for _, t in ipairs(v.s) do t:zero() end
        for _, t in pairs(v.scales or {}) do t:zero() end
      end
      if P:swapped("params") then v.work:copy(v.master) end
      for seg, full in pairs(full_of) do
        if seg.shard_offset + seg.slice <= lo + n then full:free(); full_of[seg] = nil end
      end
    end, true) -- fresh: every state is written here, nothing to read first
  end
  while pump() do end
  for _, full in pairs(full_of) do full:free() end
  self.frozen:done()
end


-- Zero weights everywhere the plan keeps them (the loader fills them next).
function States:zero_weights()
  local P = self.P
  if not P:swapped("params") then self.work:zero() end
  if not P.master.alias and not P:swapped("master") then self.master:zero() end
  for _, seg in ipairs(self.L.segments) do
    if seg.persistent then seg.persistent:zero() end
  end
  local st = self.ring
  if st.nb > 0 then
    st:each_group(true, function(_, _, _, v)
      if not P.master.alias then v.master:zero() end
      for _, t in ipairs(v.s) do t:zero() end
      for _, t in pairs(v.scales or {}) do t:zero() end
      if P:swapped("params") then v.work:zero() end
    end, true)
  end
end

-- Calls fn(seg, a, len) for the pieces of shard elements [lo, lo + n) that
-- fall in each segment's slice (a: the piece's shard offset), in order.
function States:shard_pieces(lo, n, fn)
  local hi = lo + n
  for _, seg in ipairs(self.L.segments) do
    local a = math.max(lo, seg.shard_offset)
    local b = math.min(hi, seg.shard_offset + seg.slice)
    if b > a then fn(seg, a, b - a) end
    if seg.shard_offset >= hi then break end
  end
end

------------------------------------------------------------ the optimizer's calls

-- The optimizer's calls: it updates every rank's slices where the plan
-- replicates it, this rank's otherwise. Each run is a piece of
-- one decay setting; the pieces that fall in each optimizer sub-group
-- (zero/offload.lua) become that group's calls, with views into the
-- group's master and states (resident or read from NVMe), the gradients and (bf16/
-- fp16, or an NVMe parameter shard) the working copy.
function States:build_calls()
  local L, P = self.L, self.P
  local ranks = optimizer_ranks(P, self.rank, self.world)
  -- The working copy the update rounds into (none when it is the master
  -- itself, or on NVMe: each sub-group's staging then).
  local rounds = P.dtype ~= "f32" and not P:swapped("params")
  -- A bf16 master: each call's update runs on an fp32 widening of it and
  -- rounds back stochastically (step_call); where it is the working copy
  -- itself there is nothing more to round into.
  local sround = P.master.dtype == "bf16"
  if sround and P.master.alias then rounds = false end
  self.sround_scratch = self.sround_scratch or {}
  local runs = {}
  local small_at = 0 -- the next small run's place in the ring's small arrays
  self.small_runs = {}
  for _, r in ipairs(ranks) do
    for _, run in ipairs(layout.shard_runs(L, r, self.matrices and self.matrices.matrix_of,
                                           sround, kinds(self.small_below))) do
      if run.kind == "pad" then goto next end
      local shape = { run.numel }
      local item = {
        decay = run.decay, matrix = run.matrix, numel = run.numel, canonical = run.canonical,
        kind = run.kind, small_at = run.kind == "small" and small_at or nil,
        opt_off = at(P.optimizer.extent, run),
        master_off = at(P.master.extent, run),
        -- (gradients on NVMe: the group's, read with its states)
        g = self.ograds and self.ograds:view(at(P.opt_grads.extent, run), shape),
        w = rounds and self.work:view(at(P.params.extent, run), shape) or nil,
      }
      if P.push_params then
        -- Host staging, then the device's working copy.
        item.w = self.wstage:view(run.shard_offset, shape)
        item.wdev = self.work:view(at(P.params.extent, run), shape)
      end
      if run.kind == "small" then
        small_at = small_at + run.numel
        self.small_runs[#self.small_runs + 1] = item
      end
      runs[#runs + 1] = item
      ::next::
    end
  end
  local small = self.ring.small
  local grouped_master = not P.master.alias
  -- (none apart from the master where the master is the working copy)
  local grouped_work = P:swapped("params") and not self.ring.master_in_params
  self.calls = {}
  for k, g in ipairs(self.ring.groups) do
    local gv, calls = self.ring.views[k], {}
    for _, run in ipairs(runs) do
      local a = math.max(run.opt_off, g.lo)
      local b = math.min(run.opt_off + run.numel, g.lo + g.n)
      if b > a then
        local d, len, rel = a - run.opt_off, b - a, a - g.lo
        local function piece(off, n)
          local st, sc = {}, nil
          if run.kind == "small" then
            for i, t in ipairs(gv.s) do
              st[i] = small[i] and small[i]:view(run.small_at + d + off, { n }) or t:view(rel + off, { n })
            end
          else
            for i, t in ipairs(gv.s) do st[i] = t:view(rel + off, { n }) end
            -- (a block run starts on a block, and groups and chunks are
            -- multiples of one: its scales start at its first block's)
            for i, t in pairs(gv.scales or {}) do
              local B = self.ring.blocks[i]
              sc = sc or {}
              sc[i] = t:view((rel + off) / B, { math.ceil(n / B) })
            end
          end
          return {
            decay = run.decay, matrix = run.matrix, s = st, scales = sc,
            canonical = run.canonical and run.canonical + d + off,
            p = grouped_master and gv.master:view(rel + off, { n })
                or self.master:view(run.master_off + d + off, { n }),
            g = run.g and run.g:view(d + off, { n }) or gv.g:view(rel + off, { n }),
            w = run.w and run.w:view(d + off, { n })
                or (grouped_work and gv.work:view(rel + off, { n }) or nil),
            wdev = run.wdev and run.wdev:view(d + off, { n }),
          }
        end
        if self.half_grads then
          -- The optimizer reads fp32 gradients: each chunk's gradients
          -- (half) are converted into the scratch just before its update.
          for off = 0, len - 1, CHUNK do
            local c = piece(off, math.min(CHUNK, len - off))
            c.half_g, c.g = c.g, self.scratches[c.g:device_name()]:view(0, { c.p:numel() })
            calls[#calls + 1] = c
          end
        else
          calls[#calls + 1] = piece(0, len)
        end
      end
    end
    self.calls[k] = calls
  end
end

-- The optimizer's step over every sub-group (t: the 1-based optimizer
-- step; scale: the loss scale's undo and clipping folded together); a host
-- optimizer beside a device working copy copies each group's new working
-- shard to the device after it (on the copy stream under overlap_comm).
function States:update(opt, t, lr, scale)
  if self.matrices then return self.matrices:update(self, opt, t, lr, scale) end
  local calls, push, overlap = self.calls, self.P.push_params, self.overlap
  self.ring:each_group(true, function(k)
    for _, c in ipairs(calls[k]) do
      if c.half_g then c.g:copy(c.half_g) end
      self:step_call(opt, c, t, lr, scale)
    end
    if push then
      for _, c in ipairs(calls[k]) do
        if overlap then lz.copy_async(c.wdev, c.w, "copy") else c.wdev:copy(c.w) end
      end
    end
  end, nil, true)
end

-- One call's step. Over a bf16 master (c.canonical set): chunk by chunk,
-- the master widened to fp32, the optimizer's step on that, and the result
-- rounded back stochastically with bits keyed by (seed, step, canonical
-- index), so every stage and world size rounds each element alike; a
-- working copy apart from the master takes its values.
function States:step_call(opt, c, t, lr, scale)
  if not c.canonical then return opt:update(c, t, lr, scale) end
  local n, dev = c.p:numel(), c.p:device_name()
  -- An optimizer that rounds in its own pass does it all in one (the same
  -- bits; a host master, and a working copy that is a bf16 copy of it).
  if opt.update_sround and dev == "cpu" and (not c.w or c.w:dtype_name() == "bf16") then
    return opt:update_sround(c, t, lr, scale, self.seed or 0, c.canonical)
  end
  local scratch = self.sround_scratch[dev]
  if not scratch then
    scratch = lz.tensor({ math.min(SROUND_CHUNK, math.max(self:numel(), 1)) }, "f32", "workspace", dev)
    self.sround_scratch[dev] = scratch
  end
  local chunk = scratch:numel()
  for off = 0, n - 1, chunk do
    local len = math.min(chunk, n - off)
    local sub = { decay = c.decay, matrix = c.matrix, s = {} }
    for i, st in ipairs(c.s) do sub.s[i] = st:view(off, { len }) end
    for i, sc in pairs(c.scales or {}) do
      local B = self.ring.blocks[i]
      sub.scales = sub.scales or {}
      sub.scales[i] = sc:view(off / B, { math.ceil(len / B) })
    end
    local master = c.p:view(off, { len })
    sub.p, sub.g = scratch:view(0, { len }), c.g:view(off, { len })
    sub.p:convert(master)
    opt:update(sub, t, lr, scale)
    lz.ops.bf16_round_stochastic(master, sub.p, self.seed or 0, t, c.canonical + off)
    if c.w then
      local w = c.w:view(off, { len })
      w:copy(master)
      w:free()
    end
    master:free(); sub.p:free(); sub.g:free()
    for _, st in ipairs(sub.s) do st:free() end
    for _, sc in pairs(sub.scales or {}) do sc:free() end
  end
end

-- The fp32 values of a master view: the view itself, or (a bf16 master) a
-- widened copy the caller frees.
local function widened(v)
  if v:dtype_name() == "f32" then return v, false end
  local out = lz.tensor({ v:numel() }, "f32", "workspace")
  out:convert(v)
  return out, true
end

-------------------------------------------- optimizer states (checkpoints)
-- The interface checkpoints use (luazero/checkpoint.lua); nothing else
-- reads the master and the optimizer's states for them. docs/checkpoints.md.

-- This rank's optimizer elements: the full padded layout where the plan
-- replicates the optimizer, its shard otherwise.
function States:numel() return numel(self, self.P.optimizer.extent) end

-- Calls fn(offset, master, state1, state2, ...) for chunks covering this
-- rank's optimizer elements [0, state_numel()) in order, with f32 views of
-- equal length (the optimizer's states in its `states` order: m, v for
-- AdamW): the optimizer's sub-groups (zero/offload.lua), read from NVMe
-- where they live there. write_back: fn modifies them (a load); on NVMe
-- they are written back, and an NVMe parameter shard gets the rounded
-- master with them.
-- fn(master) over a master view as fp32: a bf16 master widened, and
-- rounded back (to nearest) when written.
local function visit_master(view, write_back, fn)
  local m, own = widened(view)
  fn(m)
  if own then
    if write_back then view:convert(m) end
    m:free()
  end
end

function States:visit(write_back, fn)
  local P = self.P
  local narrow_states, blocks = false, next(self.ring.blocks) ~= nil
  for i, dt in ipairs(self.ring.dtypes or {}) do
    narrow_states = narrow_states or (dt ~= "f32" and not self.ring.blocks[i])
  end
  if narrow_states then
    -- States kept narrower (bf16 moments): checkpoints see them in f32,
    -- exactly, and a load's f32 values (saved from the same format) narrow
    -- back exactly.
    local narrow = fn
    fn = function(off, master, ...)
      local st, wide = { ... }, {}
      for i, t in ipairs(st) do
        wide[i] = t
        if t:dtype_name() ~= "f32" then
          wide[i] = lz.tensor(t:sizes(), "f32", "workspace"):copy(t)
        end
      end
      narrow(off, master, unpack(wide))
      for i, t in ipairs(st) do
        if wide[i] ~= t then
          if write_back then t:copy(wide[i]) end
          wide[i]:free()
        end
      end
    end
  end
  if P:on_device("optimizer") then
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
  self.ring:each_group(write_back, function(_, lo, n, v)
    -- (block-scaled states as their f32 values, set back after a load)
    local ring_views = v
    local states = blocks and self:widen(lo, n, v) or v.s
    v = { master = v.master, s = states, work = v.work }
    if not P.master.alias then
      visit_master(v.master, write_back, function(m) fn(lo, m, unpack(v.s)) end)
      if write_back and P:swapped("params") then v.work:copy(v.master) end
    elseif P.master.extent == P.optimizer.extent then
      visit_master(self.master:view(lo, { n }), write_back, function(m) fn(lo, m, unpack(v.s)) end)
    else
      -- The master is the full working buffer, the states a shard: this
      -- rank's slices of it, one chunk per segment.
      self:shard_pieces(lo, n, function(seg, a, len)
        local st = {}
        for i, t in ipairs(v.s) do st[i] = t:view(a - lo, { len }) end
        visit_master(self.master:view(seg.mine.full_offset + (a - seg.shard_offset), { len }),
                     write_back, function(m) fn(a, m, unpack(st)) end)
      end)
    end
    if blocks then self:narrow(write_back, lo, n, ring_views, states) end
  end)
end

-- Copies state i of the small tensors' runs within optimizer elements
-- [lo, lo + n) between their f32 arrays (ring.small[i]) and w, the group's
-- widened values (w[0] is element lo): into the arrays, or out of them.
function States:small_copy(lo, n, w, i, into_small)
  for _, r in ipairs(self.small_runs or {}) do
    local a, b = math.max(lo, r.opt_off), math.min(lo + n, r.opt_off + r.numel)
    if b > a then
      local wide = w:view(a - lo, { b - a })
      local small = self.ring.small[i]:view(r.small_at + (a - r.opt_off), { b - a })
      if into_small then small:copy(wide) else wide:copy(small) end
      wide:free(); small:free()
    end
  end
end

-- A host copy of t where it is on a device (the caller frees it), else t.
local function on_host(t)
  if t:device_name() == "cpu" then return t, false end
  return t:to("cpu"), true
end

-- The f32 values of group [lo, lo + n)'s states (views v): a block-scaled
-- state's dequantised (what the update reads for each element), the f32
-- states of the small tensors in their places; others as they are.
function States:widen(lo, n, v)
  local ring, out = self.ring, {}
  for i, t in ipairs(v.s) do
    if ring.blocks[i] then
      local w = lz.tensor({ n }, "f32", "workspace")
      local q, own_q = on_host(t)
      local sc, own_sc = on_host(v.scales[i])
      lz.check(lz.C.lz_adamw8bit_dequantize(q, sc, ring.signed[i] and 1 or 0, w))
      if own_q then q:free() end
      if own_sc then sc:free() end
      self:small_copy(lo, n, w, i, false)
      out[i] = w
    else
      out[i] = t
    end
  end
  return out
end

-- After fn saw widen's values: written back (a load), the small tensors'
-- f32 states and the requantised blocks (lz_adamw8bit_requantize: the same
-- bits as before the save where they came from one); then freed.
function States:narrow(write_back, lo, n, v, wide)
  local ring = self.ring
  for i, w in ipairs(wide) do
    if ring.blocks[i] then
      if write_back then
        self:small_copy(lo, n, w, i, true)
        local q, own_q = on_host(v.s[i])
        local sc, own_sc = on_host(v.scales[i])
        lz.check(lz.C.lz_adamw8bit_requantize(w, ring.signed[i] and 1 or 0, q, sc))
        if own_q then v.s[i]:copy(q); q:free() end
        if own_sc then v.scales[i]:copy(sc); sc:free() end
      end
      w:free()
    end
  end
end

-- How optimizer-element offsets map to canonical parameter coordinates:
-- { numel = state_numel(), runs = { {offset, canonical, numel}, ... } }.
function States:layout()
  return { numel = self:numel(),
           runs = layout.canonical_runs(self.L, self.P.optimizer.extent == "shard" and self.rank or nil) }
end

-- Whether every rank holds the same optimizer states (one writer is enough).
function States:replicated() return self.P.optimizer.extent == "full" end

-- After the master was written (a load): the working copy is its rounding
-- (the update writes round(master); init rounds the same way), then what
-- the plan gathers after a step is gathered again (the engine's part).
function States:after_load()
  local L, P = self.L, self.P
  -- (an NVMe shard got it in visit_states; a host master beside a device
  -- working copy is never the working copy itself)
  local resident = not P:swapped("master")
  if (P.dtype ~= "f32" or P.push_params) and not P:swapped("params") then
    local work = self.work
    if resident and P.params.extent == P.master.extent then
      work:convert(self.master)
    elseif resident then
      for _, seg in ipairs(L.segments) do
        work:view(seg.mine.full_offset, { seg.slice })
            :convert(self.master:view(seg.shard_offset, { seg.slice }))
      end
    else
      -- The master is on NVMe: one pass over its sub-groups.
      self.ring:each_group(false, function(_, lo, n, v)
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
end

---------------------------------------------------------- checkpoints

-- The full fp32 master parameters in canonical order (unpadded), as an f32
-- tensor (category workspace) on every rank.
function States:master_params()
  -- (with the experts in their groups the segments are the world's: this
  -- rank's parameters and the other groups' experts)
  local out = lz.tensor({ self.L.numel + self.L.elsewhere }, "f32", "workspace")
  self:full_master_segments(function(seg, full)
    -- (parameter by parameter: a block layout leaves gaps between them)
    for _, e in ipairs(seg.entries) do
      local dst, src = out:view(e.offset, { e.numel }), full:view(e.seg_offset, { e.numel })
      dst:copy(src)
      dst:free(); src:free()
    end
  end)
  return out
end

-- Calls fn(seg, full) for every segment in order with its whole fp32
-- master (padded), the same on every rank: a view of a resident full
-- master, or this rank's slices gathered into a temporary one segment at
-- a time.
function States:full_master_segments(fn)
  if self.Lw then return self:placed_master_segments(fn) end
  local P = self.P
  local on_device = P:on_device("master")
  if not P:swapped("master") and P.master.extent == "full" then
    for _, seg in ipairs(self.L.segments) do
      local view = self.master:view(seg.full_offset, { seg.padded })
      local full, own = widened(view)
      if own then
        view:free()
        fn(seg, full)
        full:free()
      elseif on_device then
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
    local host = on_device and slice:to("cpu")
    local wide, own = widened(host or slice)
    self.comm.all_gather(wide, full)
    if own then wide:free() end
    if host then host:free() end
    fn(seg, full)
    full:free()
  end)
end

-- full_master_segments with the experts in their groups: every world
-- segment in order, this rank's whole (gathered over its group where
-- sharded), an expert's broadcast by world rank q, which holds
-- expert-parallel rank q's experts. The segments travel in host memory, a
-- device master's copied off first. A sharded master's slices come from
-- master_slices (resident, or read sub-group by sub-group from NVMe),
-- taken in step with the world segments: this rank's segments are theirs
-- in the same order.
function States:placed_master_segments(fn)
  local P = self.P
  local on_device = P:on_device("master")
  local whole = P.master.extent == "full"
  local own = {}
  for _, seg in ipairs(self.L.segments) do own[seg.world_index] = seg end
  local next_slice = not whole and coroutine.wrap(function()
    self:master_slices(function(seg, slice) coroutine.yield(seg, slice) end)
  end)
  for i, wseg in ipairs(self.Lw.segments) do
    local seg = own[i]
    local full = lz.tensor({ wseg.padded }, "f32", "workspace")
    if seg then
      local view
      if whole then
        view = self.master:view(seg.full_offset, { seg.padded })
      else
        local from
        from, view = next_slice()
        assert(from == seg, "placed_master_segments: master slices out of step")
      end
      local host = on_device and view:to("cpu")
      if whole then
        full:convert(host or view)
      else
        local wide, widened_copy = widened(host or view)
        local group_or_world = self.comm_of(seg) or self.comm.world()
        group_or_world:all_gather(wide, full)
        if widened_copy then wide:free() end
      end
      if host then host:free() end
      if whole then view:free() end -- (master_slices frees its own)
    end
    local q = self.owner(wseg)
    if q ~= nil then self.comm.broadcast(full, q) end
    fn(wseg, full)
    full:free()
  end
  if next_slice then assert(next_slice() == nil, "placed_master_segments: master slices left") end
end

-- Calls fn(seg, slice) for every segment in order with this rank's fp32
-- master slice of it (a sharded master): a view of the resident master, or
-- assembled from the sub-groups read from NVMe. The slice is valid during
-- fn only: it is freed when fn returns (under a coroutine that yields in
-- fn, at the next resume).
function States:master_slices(fn)
  local segs = self.L.segments
  if not self.P:swapped("master") then
    for _, seg in ipairs(segs) do
      local slice = self.master:view(seg.shard_offset, { seg.slice })
      fn(seg, slice)
      slice:free()
    end
    return
  end
  local part
  self:swapped_master_pieces(function(seg, a, b, master, lo)
    local so, se = seg.shard_offset, seg.shard_offset + seg.slice
    if a == so and b == se then
      local slice = master:view(a - lo, { seg.slice })
      fn(seg, slice)
      slice:free()
    else
      part = part or lz.tensor({ seg.slice }, "f32", "workspace")
      local dst, src = part:view(a - so, { b - a }), master:view(a - lo, { b - a })
      dst:copy(src)
      dst:free() -- (a view keeps its storage until freed)
      src:free()
      if b == se then fn(seg, part); part:free(); part = nil end
    end
  end)
end

-- A master on NVMe read sub-group by sub-group: fn(seg, a, b, master, lo)
-- for each piece [a, b) (shard offsets) of each segment in order, in the
-- sub-group buffer `master` that holds shard elements from lo; a segment
-- spanning sub-groups comes in several pieces.
function States:swapped_master_pieces(fn)
  local segs, i = self.L.segments, 1
  self.ring:each_group(false, function(_, lo, n, v)
    local hi = lo + n
    while i <= #segs do
      local seg = segs[i]
      local so, se = seg.shard_offset, seg.shard_offset + seg.slice
      if so >= hi then break end
      fn(seg, math.max(so, lo), math.min(se, hi), v.master, lo)
      if se > hi then break end
      i = i + 1
    end
  end)
end

-- xxh64 of the full fp32 master parameters in canonical order (hex),
-- streamed a chunk at a time (zero/checksum.lua).
function States:checksum() return require("luazero.zero.checksum").of(self, widened) end

return M
