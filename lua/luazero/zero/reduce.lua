-- zero/reduce.lua — the engine's gradient reduction, as the plan says
-- (P.reduce): each module's gradients into a pooled staging buffer reduced
-- as soon as they are complete and added into the gradients every
-- micro-step (buffered), or the full gradient buffer reduced once per step
-- in buckets; the reduced gradients copied off the device where the
-- optimizer reads them from host memory; half gradients added through an
-- fp32 scratch. A component of the engine (engine.reducer), with its own
-- state — the reductions in flight, the copies landing, the open bucket,
-- the host's wait for copies, the gradient file's norm partials — and the
-- engine's buffers and settings it was made with.
--
--   local reducer = reduce.new{ P = P, s = s, comm = comm, ... }
--   reducer:stage_grads(segs); reducer:grads_ready(seg); reducer:wait_all()
local ffi = require("ffi")
local lz = require("luazero")
local layout = require("luazero.zero.layout")
local Placement = require("luazero.zero.plan")
local clock = require("luazero.clock")

local ops = lz.ops
local at = Placement.offset
local CHUNK = layout.CHUNK

local M = {}
local Reducer = {}
Reducer.__index = Reducer

-- parts: P (the plan), s (the engine's settings), comm, rank, L (the
-- layout), pool (device comm buffers), hpool (host staging), half_grads,
-- gdt, grads, ograds, rgrads (the buffers: the gradients, the optimizer's,
-- the one reductions add into), spill (the gradient file, or nil),
-- scratches (device -> fp32 scratch), round_scratch, boundary (a function:
-- whether this micro-step ends the accumulation), comm_of (optional: seg ->
-- the group its gradients reduce over, nil for the world), norm_slice
-- (optional: seg -> the slice the gradient norm's partial reads, or nil).
function M.new(parts)
  local self = setmetatable({
    inflight = {}, inflight_elems = 0, -- reductions in flight, and their elements
    landing = {},                      -- gradients being copied off the device
    bucket = false,                    -- the open all-reduce bucket (false: none)
    copy_wait = 0,                     -- seconds the host waited for overlapped copies
    spill_sq = {},                     -- segment -> its slice's squared norm (spill)
    cycle = 0,                         -- accumulation cycles begun (zero_grad counts them)
    fresh = {},                        -- segment -> true: its gradients hold no sum yet
    added = {},                        -- segment -> its range of rgrads no reduction added into yet
    norm_sq = {},                      -- segment index -> its slice's squared norm, from the last add
    norm_blocks = {},                  -- segment index -> its slice's block partials (norm_blocks_for)
  }, Reducer)
  for _, k in ipairs({ "P", "s", "comm", "rank", "L", "pool", "hpool", "half_grads", "gdt",
                       "grads", "ograds", "rgrads", "spill", "scratches", "round_scratch",
                       "boundary", "comm_of", "norm_slice" }) do
    self[k] = parts[k]
  end
  return self
end

-- seg.writes for each segment its module's backward writes whole
-- (Module:writes_grads: one kernel call, the module's only segment, no
-- gaps, no other module adding into it: seg.users, counted by the engine):
-- it needs no zeros before the first micro-step of an accumulation.
function M.mark_writes(L)
  local count = {}
  for _, seg in ipairs(L.segments) do count[seg.module] = (count[seg.module] or 0) + 1 end
  for _, seg in ipairs(L.segments) do
    seg.writes = seg.users == 1 and count[seg.module] == 1 and seg.numel == seg.extent and
                 seg.module:writes_grads()
  end
end

local function bind_grads(seg, buf) layout.bind("g", seg, buf) end

-- A module m's backward is about to run: its segments' gradients get a
-- staging buffer (buffered), and every segment counts the modules still to
-- write into it. A segment m writes whole (seg.writes) is not zeroed first:
-- m writes it (m.grads_write), in a new staging buffer (buffered, its
-- padding zeroed) or where zero_grad left it unzeroed (fresh).
function Reducer:stage_grads(segs, m)
  local buffered = self.P.reduce.buffered
  for _, seg in ipairs(segs) do
    if seg.frozen then -- (no gradients)
    elseif buffered and not seg.gbuf then
      self:make_room(seg.padded)
      seg.gbuf = self.pool:get(seg.padded, "f32")
      if m and seg.writes and seg.module == m then
        if seg.padded > seg.numel then
          seg.gbuf:view(seg.numel, { seg.padded - seg.numel }):zero()
        end
        m.grads_write = true
      else
        seg.gbuf:zero()
      end
      bind_grads(seg, seg.gbuf)
      seg.pending = seg.users
    elseif not buffered and seg.pending == nil then
      seg.pending = seg.users
      if self.fresh[seg] and seg.module == m then
        self.fresh[seg] = nil
        m.grads_write = true
      end
      if m and m.takes_norm_blocks and seg.module == m then
        m.norm_blocks = self:norm_blocks_for(seg)
      end
    end
  end
end

-- The gradient norm's block partials of seg's slice, for a module whose
-- backward can take them as it writes the gradients (m.takes_norm_blocks:
-- a Linear's dW and the experts' grouped dW, while what they wrote is in
-- the cache): { blocks = one double per 4,096 elements of the slice, NaN
-- where not taken (ptr: as a double *); n = the slice's elements; base =
-- its data; at(t) = the element of the slice where tensor t starts, nil
-- where t does not lie in it }, or nil where the norm will not read the
-- values that backward leaves: more than one rank (a reduction follows),
-- not the accumulation's last micro-step, another module adding into seg,
-- half or staged or spilled gradients, or a slice that is not seg's
-- gradients on the cpu. Engine:exchange reads them (sq_norm_blocks), which
-- sets them back to NaN; zero_grad forgets any not read, and so does a
-- second backward before the step (its tasks need not take the same
-- blocks).
function Reducer:norm_blocks_for(seg)
  local old = self.norm_blocks[seg.index]
  if old and old.handed then self:forget_norm_blocks(old) end
  local R = self.P.reduce
  if self.comm.size() ~= 1 or R.buffered or R.to_host or self.spill or self.half_grads or
     not seg.writes or not self.boundary() or not self.grads then
    return nil
  end
  local g = self.norm_slice and self.norm_slice(seg)
  if not g or g:dtype_name() ~= "f32" or g:device_name() ~= "cpu" or g:numel() ~= seg.padded or
     ffi.cast("char *", g.data) ~= ffi.cast("char *", self.grads.data) + 4 * seg.full_offset then
    return nil
  end
  local nb = self.norm_blocks[seg.index]
  if not nb or nb.base ~= g.data or nb.n ~= g:numel() then
    local n, base = g:numel(), ffi.cast("char *", g.data)
    local count = math.ceil(n / lz.SQ_NORM_BLOCK)
    local blocks = ffi.new("double[?]", count)
    nb = { blocks = blocks, ptr = ffi.cast("double *", blocks), n = n, base = g.data,
           count = count }
    nb.at = function(t)
      local at = tonumber(ffi.cast("char *", t.data) - base) / 4
      if at >= 0 and at + t:numel() <= n then return at end
    end
    for k = 0, count - 1 do nb.blocks[k] = 0 / 0 end
    self.norm_blocks[seg.index] = nb
  end
  nb.handed = true
  return nb
end

-- The squared norm of segment i's slice g: its block partials taken where
-- a backward left them (the same bits as g:sq_norm()), else g:sq_norm().
function Reducer:slice_sq_norm(i, g)
  local nb = self.norm_blocks[i]
  if not nb or not nb.handed then return g:sq_norm() end
  nb.handed = false
  local out = ffi.new("double[1]")
  ops.sq_norm_blocks(g, nb.ptr, ffi.cast("double *", out))
  return out[0]
end

-- Block partials handed out and not read (a step that did not come, or
-- values changed since): forgotten, those of one segment (only) or all.
function Reducer:forget_norm_blocks(only)
  for _, nb in pairs(only and { only } or self.norm_blocks) do
    if nb.handed then
      for k = 0, nb.count - 1 do nb.blocks[k] = 0 / 0 end
      nb.handed = false
    end
  end
end

-- The communicator a segment's gradients are reduced over and the
-- average's divisor: an expert's gradients come from its owners alone (the
-- other ranks' are zeros), so its expert-data-parallel group sums them and
-- divides by the world size before the one rounding, the world's average
-- bit for bit (in every dtype; on a device, inside the collective); every
-- other segment's, the world's own average.
function Reducer:comm_for(seg)
  local group = self.comm_of and self.comm_of(seg)
  return group or self.comm.world(), group and self.comm.size()
end

-- A segment's gradients are complete for this micro-step: reduced as the
-- plan says (P.reduce).
function Reducer:grads_ready(seg)
  local async, R = self.s.overlap, self.P.reduce
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
    local group_or_world, over = self:comm_for(seg)
    if R.op == "all_reduce" then
      recv = seg.gbuf
      dst = self.rgrads:view(seg.full_offset, { seg.padded })
      w = group_or_world:all_reduce(seg.gbuf, "avg", async, over)
    else
      recv = seg.gbuf:view(seg.mine.full_offset - seg.full_offset, { seg.slice })
      -- Into the gradient shard, or (none on the device) the optimizer's,
      -- or (on NVMe) the gradient file's staging.
      dst = self.rgrads and self.rgrads:view(at(R.into, seg.mine), { seg.slice })
      w = group_or_world:reduce_scatter(seg.gbuf, recv, "avg", async, over)
    end
    local item = { seg = seg, recv = recv, dst = dst, elems = seg.padded }
    if async then
      item.work = w
      self.inflight[#self.inflight + 1] = item
      self.inflight_elems = self.inflight_elems + seg.padded
    else
      self:finish_reduce(item)
    end
    bind_grads(seg, nil)
    return
  end
  if not self.boundary() then return end
  if R.op == "reduce_scatter" then
    -- In place, in the full gradient buffer: this rank's slice is reduced.
    local full = self.grads:view(seg.full_offset, { seg.padded })
    local recv = self.grads:view(seg.mine.full_offset, { seg.slice })
    local group_or_world, over = self:comm_for(seg)
    local w = group_or_world:reduce_scatter(full, recv, "avg", async, over)
    if async then self.inflight[#self.inflight + 1] = { work = w } end
    return
  end
  -- All-reduce, neighbouring segments batched into buckets of
  -- reduce_bucket_size elements (backward visits them back to front); a
  -- bucket holds segments of one group (the world, or an expert's
  -- expert-data-parallel group: averaged over the world, as above).
  local b = self.bucket
  local group_or_world, over = self:comm_for(seg)
  if b and seg.full_offset + seg.padded == b.lo and b.comm == group_or_world then
    b.lo = seg.full_offset
  else
    self:flush_bucket()
    b = { lo = seg.full_offset, hi = seg.full_offset + seg.padded, comm = group_or_world,
          over = over }
    self.bucket = b
  end
  if b.hi - b.lo >= self.s.reduce_bucket then self:flush_bucket() end
end

function Reducer:flush_bucket()
  local b = self.bucket
  if not b then return end
  self.bucket = false
  local t, w = self.grads:view(b.lo, { b.hi - b.lo })
  w = b.comm:all_reduce(t, "avg", self.s.overlap, b.over)
  if self.s.overlap then self.inflight[#self.inflight + 1] = { work = w } end
end

-- Staged gradients: adds a reduced staging buffer (all-reduce) or slice
-- (reduce-scatter) into the gradients the optimizer reads.
function Reducer:finish_reduce(item)
  if item.work then item.work:wait() end
  local seg = item.seg
  if seg then
    if item.work then self.inflight_elems = self.inflight_elems - item.elems end
    if self.P.reduce.to_host then
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
    self:add_reduced(item, item.recv)
    self.pool:put(seg.gbuf)
    seg.gbuf = nil
  end
end

-- A reduced slice src (where the add runs) into the gradients the optimizer
-- reads: item.dst, or the gradient file's staging (zero/spill.lua), taking
-- the norm's partial of the slice on the last micro-step.
function Reducer:add_reduced(item, src)
  if not self.spill then
    -- The first add of the accumulation copies (rgrads were not zeroed).
    local seg, dst = item.seg, item.dst
    local first = self.added[seg] ~= nil
    self.added[seg] = nil
    -- The last one reads the slice the norm's partial reads: the partial
    -- comes from the add (sq_norm's blocks on the final values: its bits).
    local g = self.boundary() and self.norm_slice and self.norm_slice(seg)
    if g and not self.half_grads and g.data == dst.data and g:numel() == dst:numel() then
      local out = ffi.new("double[1]")
      ops.add_sq_norm(dst, src, first and 1 or 0, ffi.cast("double *", out))
      self.norm_sq[seg.index] = out[0]
      return
    end
    if first then return dst:copy(src) end
    return self:accumulate(dst, src)
  end
  local seg, sp = item.seg, self.spill
  local add = function(d, s) self:accumulate(d, s) end
  if not self.boundary() then
    return sp:add(seg.shard_offset, src, add)
  end
  -- The norm's partial over the slice's final values. Without
  -- accumulation they are 0 + src, whose squares are src's: its own norm.
  -- Else of the one piece, or of the pieces copied together (sq_norm's
  -- blocks follow the slice). With the experts in their groups
  -- (norm_of: zero/experts.lua's slots), one partial per world slice the
  -- slice holds, keyed by its slot.
  local lo, n = seg.shard_offset, src:numel()
  local slots = self.norm_of and self.norm_of[seg.index]
  local function partials(t)
    if not slots then self.spill_sq[seg.index] = t:sq_norm(); return end
    for _, s in ipairs(slots) do
      local v = t:view(s.at, { s.n })
      self.spill_sq[s.slot] = v:sq_norm()
      v:free()
    end
  end
  if sp.first then
    partials(src)
    return sp:add(lo, src, add)
  end
  if sp:group_of(lo) == sp:group_of(lo + n - 1) then
    return sp:add(lo, src, add, partials)
  end
  local whole = lz.tensor({ n }, "f32", "workspace")
  sp:add(lo, src, add, function(d, off)
    local part = whole:view(off, { d:numel() })
    part:copy(d)
    part:free() -- (a view keeps the storage until freed)
  end)
  partials(whole)
  whole:free()
end

-- dst += a reduced micro-step gradient src (both where the add runs).
function Reducer:accumulate(dst, src)
  if self.half_grads then self:add_half(dst, src) else ops.axpy(dst, 1.0, src) end
end

-- A reduced gradient copied off the device is added into the host's
-- gradients once its copy has landed; its buffers go back to their pools.
function Reducer:land(item)
  if item.landed then
    self:wait_copies(item.landed)
    item.landed:free()
  end
  self:add_reduced(item, item.host)
  self.hpool:put(item.host)
  self.pool:put(item.gbuf)
end

-- Waits for copies queued to overlap (up to event ev), counting the host's
-- wait: the part of their time that was not hidden (copy_wait_s).
function Reducer:wait_copies(ev)
  local t0 = clock.now()
  ev:synchronize()
  self.copy_wait = self.copy_wait + (clock.now() - t0)
end

-- Lands the copies in flight, in order (all, or those already done).
function Reducer:land_all(done_only)
  local landing = self.landing
  while #landing > 0 and (not done_only or landing[1].landed:query()) do
    self:land(table.remove(landing, 1))
  end
end

-- Half gradients: the fp32 scratch of 2 x CHUNK elements beside a tensor
-- (on its device, made by allocate), for the optimizer's view of the
-- gradients and for accumulating into them.
function Reducer:scratch_by(t) return self.scratches[t:device_name()] end

-- dst += src for gdt tensors: both converted to fp32, added, dst rounded
-- back (nearest even), CHUNK elements at a time. Elementwise, so every
-- plan gets the same bits.
--
-- An fp32 dst (the optimizer's host gradients) holds gdt values: the sum
-- is rounded to gdt and widened back (through round_scratch), the same
-- numbers a gdt dst holds.
function Reducer:add_half(dst, src)
  local n, scratch = dst:numel(), self:scratch_by(dst)
  local round = dst.dtype ~= src.dtype
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
function Reducer:make_room(n)
  self:land_all(true)
  while #self.inflight > 0 and self.inflight_elems + n > self.s.reduce_bucket do
    self:finish_reduce(table.remove(self.inflight, 1))
  end
  -- Gradient buffers whose copies are in flight count against the bucket too.
  while #self.landing > 0 and self.inflight_elems + self:landing_elems() + n >
        self.s.reduce_bucket do
    self:land(table.remove(self.landing, 1))
  end
end

function Reducer:landing_elems()
  local n = 0
  for _, item in ipairs(self.landing) do n = n + item.elems end
  return n
end

function Reducer:wait_all()
  if self.boundary() then self:zero_fresh() end -- (modules no backward reached)
  self:flush_bucket()
  while #self.inflight > 0 do self:finish_reduce(table.remove(self.inflight, 1)) end
  self.inflight_elems = 0
  self:land_all()
  -- (after the first micro-step: what no reduction copied into is zeroed
  -- before a later one adds into it)
  self:zero_unadded()
end

-- A host optimizer's gradients when the device keeps whole ones (stage 1,
-- or accumulation before stage 2): this rank's slices, copied off the
-- device once per step.
function Reducer:pull_grads()
  local P = self.P
  if P.opt_grads.alias or P.grads.extent == "none" then return end
  for _, seg in ipairs(self.L.segments) do
    self.ograds:view(at(P.opt_grads.extent, seg.mine), { seg.slice })
        :copy(self.grads:view(at(P.grads.extent, seg.mine), { seg.slice }))
  end
end

-- Zeros the gradients the next backward does not write: a segment whose
-- module writes it whole is left as it is, fresh, until its module's
-- backward writes it or the accumulation's end finds it unwritten
-- (zero_fresh); its padding keeps the zeros it was allocated with. Where
-- reductions add micro-steps into the gradients (buffered) they are
-- zeroed whole.
function Reducer:zero_grad()
  local P = self.P
  self.cycle = self.cycle + 1
  -- Reductions add into rgrads (buffered, no gradient file): the first
  -- micro-step's copy instead, so they are not zeroed (added).
  local copied = P.reduce.buffered and not self.spill and self.rgrads
  if copied then self:mark_unadded() end
  self.norm_sq = {}
  self:forget_norm_blocks()
  if P.grads.extent == "full" and not P.reduce.buffered then
    self:zero_unwritten()
  elseif P.grads.extent ~= "none" and copied ~= self.grads then
    self.grads:zero()
  end
  if self.spill then self.spill_sq = {}
  elseif not P.opt_grads.alias and copied ~= self.ograds then self.ograds:zero() end
end

-- Every segment's range of rgrads, where its reduced micro-step gradient
-- lands (P.reduce: this rank's slice, or all of it for an all-reduce).
function Reducer:mark_unadded()
  local R = self.P.reduce
  for _, seg in ipairs(self.L.segments) do
    if R.op == "all_reduce" then
      self.added[seg] = { seg.full_offset, seg.padded }
    else
      self.added[seg] = { at(R.into, seg.mine), seg.slice }
    end
  end
end

-- The ranges no reduction copied into (segments the first micro-step's
-- backward did not reach), zeroed.
function Reducer:zero_unadded()
  for seg, r in pairs(self.added) do
    self.rgrads:view(r[1], { r[2] }):zero()
    self.added[seg] = nil
  end
end

-- zero_grad's zeros in the full gradient buffer: the runs of segments no
-- module writes whole, each run one call; the others become fresh.
function Reducer:zero_unwritten()
  local lo, hi = nil, nil
  local function flush()
    if lo then self.grads:view(lo, { hi - lo }):zero() end
    lo = nil
  end
  for _, seg in ipairs(self.L.segments) do
    if seg.writes then
      self.fresh[seg] = true
      flush()
    else
      if not lo or hi ~= seg.full_offset then flush(); lo = seg.full_offset end
      hi = seg.full_offset + seg.padded
    end
  end
  flush()
end

-- The fresh segments (no backward wrote them since zero_grad) and the
-- ranges no reduction copied into yet, zeroed.
function Reducer:zero_fresh()
  for seg in pairs(self.fresh) do
    self.grads:view(seg.full_offset, { seg.padded }):zero()
    self.fresh[seg] = nil
  end
  self:zero_unadded()
end

return M
