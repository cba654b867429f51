-- zero/gather.lua — the engine's parameter gathers: where the plan shards
-- the working parameters (stage 3), each module's segments are all-gathered
-- into pooled buffers before it runs and released after, prefetched along
-- the order the first pass recorded; and what the plan gathers after each
-- optimizer step. A component of the engine (engine.gatherer), with its
-- own state — the elements gathered now, the orders the first passes
-- recorded and how far the current ones are, the segments each replay
-- gathers — and the engine's parameter groups, buffers and settings it was
-- made with.
--
--   local gatherer = gather.new{ P = P, s = s, comm = comm, ... }
--   gatherer:pre_forward(m); gatherer:post_forward(m); gatherer:gather_params()
local ffi = require("ffi")
local lz = require("luazero")
local layout = require("luazero.zero.layout")
local esize = require("luazero.zero.plan").esize

local M = {}
local Gatherer = {}
Gatherer.__index = Gatherer

-- parts: P (the plan), s (the engine's settings), comm, rank, pool, wdt,
-- L, LF (the trained and frozen layouts; LF nil without frozen segments),
-- work (the full working copy, below stage 3), staged (the event uploads
-- record, or nil), segs_of (module -> the segments it uses: the parameter
-- groups), reducer (whose grads hooks the backward hooks call), comm_of
-- (optional: seg -> the group its slices are gathered over, nil: the world).
function M.new(parts)
  local self = setmetatable({
    live = 0,               -- elements of the gathered parameters held now
    -- Passes: the segment orders the first forward and backward recorded
    -- (prefetching follows them), and how far the current pass is.
    fwd_order = {}, bwd_order = {}, fwd_pass = { k = 0 }, bwd_pass = { k = 0 },
    recompute_segs_of = {}, -- module -> the segments its replay gathers
    -- Experts' slices gathered since take_expert_bytes, in bytes, and
    -- those an unrouted expert's skipped gathers would have read.
    expert_read = 0, expert_skipped = 0,
  }, Gatherer)
  for _, k in ipairs({ "P", "s", "comm", "rank", "pool", "wdt", "L", "LF", "work", "staged",
                       "segs_of", "reducer", "comm_of" }) do
    self[k] = parts[k]
  end
  return self
end

-- A forward (or backward) pass begins: its position goes back to the start.
function Gatherer:begin_pass(backward)
  if backward then self.bwd_pass = { k = 0 } else self.fwd_pass = { k = 0 } end
end

-- A pass has ended: its order is recorded (once), and gathers prefetched
-- but not used are dropped.
function Gatherer:end_pass(backward)
  local order = backward and self.bwd_order or self.fwd_order
  if #order > 0 then order.done = true end
  self:drop_prefetched()
end

local function bind_params(seg, buf) layout.bind("p", seg, buf) end

-- All-gathers seg's slices over its group (an expert's: the ranks that
-- hold it), or the world.
function Gatherer:all_gather(seg, send, recv, async)
  local group_or_world = self.comm_of and self.comm_of(seg) or self.comm.world()
  return group_or_world:all_gather(send, recv, async)
end

-- Parameters gathered per module: a segment's, into a pooled buffer.
function Gatherer:gather(seg, async)
  if seg.persistent or seg.pbuf then return end
  if seg.module.is_expert_unit then
    self.expert_read = self.expert_read + seg.slice * esize[self.wdt]
  end
  seg.pbuf = self.pool:get(seg.padded, self.wdt)
  self.live = self.live + seg.padded
  local send
  send, seg.pslot = self:shard_slice(seg, async)
  if seg.pslot and seg.pslot.req then
    -- Its slice is still being read from NVMe: the all-gather waits for the
    -- read where the gather is needed (gathered), in the same order on
    -- every rank.
    seg.psend = send
  else
    seg.pwork = self:all_gather(seg, send, seg.pbuf, async)
  end
  if not async then seg.pwork = nil; self:gathered(seg) end
end

-- This rank's working slice of a segment (a sharded working copy), where
-- the gather reads it: a view of the shard, or, read from the NVMe
-- parameter file or copied from host memory to the device, a staging
-- buffer (returned second, for release_slice once the gather has read it).
-- async: a read from NVMe may be left in flight (stage.req) where nothing
-- copies the slice at once.
function Gatherer:shard_slice(seg, async)
  local v, stage
  local store = seg.store
  if store.pshard then
    v, stage = store.pshard:slice(seg.shard_offset, seg.slice, async and not store.upload)
  else
    v = store.work:view(seg.shard_offset, { seg.slice })
  end
  if not store.upload then return v, stage end
  local d = self.pool:get(seg.slice, self.wdt)
  if self.s.overlap then
    -- On the copy stream; the device's work after this (the gather) waits
    -- for it, the host does not.
    lz.copy_async(d, v, "copy")
    self.staged:record("copy")
    self.staged:wait_on("compute")
  else
    d:copy(v)
  end
  return d, { pooled = d, read = stage }
end

function Gatherer:release_slice(stage)
  if not stage then return end
  if stage.pooled then
    self.pool:put(stage.pooled)
    stage = stage.read
  end
  if stage then stage.owner:release(stage) end
end

-- A gather of seg has completed: its staging can go.
function Gatherer:gathered(seg)
  if seg.psend then
    local send, req = seg.psend, seg.pslot.req
    seg.psend, seg.pslot.req = nil, nil
    req:wait()
    self:all_gather(seg, send, seg.pbuf, false)
  end
  if seg.pwork then seg.pwork:wait() end
  seg.pwork = nil
  if seg.pslot then self:release_slice(seg.pslot); seg.pslot = nil end
end

function Gatherer:ensure(seg)
  if seg.persistent then return end
  if not seg.pbuf then self:gather(seg, false) end
  if seg.pwork or seg.psend then self:gathered(seg) end
  seg.in_use = seg.in_use + 1
  if seg.in_use == 1 then bind_params(seg, seg.pbuf) end
end

function Gatherer:release(seg)
  if seg.persistent then return end
  seg.in_use = seg.in_use - 1
  if seg.in_use > 0 then return end
  bind_params(seg, nil)
  self.pool:put(seg.pbuf)
  self.live = self.live - seg.padded
  seg.pbuf = nil
end

-- Prefetch along the order recorded on the first pass: segments of the
-- next modules, up to stage3_prefetch_bucket_size elements ahead (those
-- gathered by an earlier prefetch count: the window slides, it does not
-- grow by a bucket at every module) and stage3_max_live_parameters
-- gathered at once.
function Gatherer:prefetch(order, k)
  if not (self.s.overlap and order.done) then return end
  local budget, s = self.s.prefetch, self.s
  for i = k + 1, #order do
    local seg = order[i]
    if not seg.persistent and not seg.module.unrouted then
      if budget < seg.padded then break end
      if not seg.pbuf then
        if self.live + seg.padded > s.max_live then break end
        local ps = seg.store.pshard
        if ps and not ps:can_prefetch() then break end
        self:gather(seg, true)
      end
      budget = budget - seg.padded
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
function Gatherer:gather_for(m, order, pass)
  for _, seg in ipairs(self.segs_of[m]) do
    local k = record(order, seg, pass)
    self:ensure(seg)
    self:prefetch(order, k)
  end
end

-- Gathers that were prefetched but not used (a pass that ended early).
function Gatherer:drop_prefetched()
  if not self.P.params.gather then return end
  for _, L in ipairs({ self.L, self.LF }) do
    for _, seg in ipairs(L.segments) do
      if seg.pbuf and seg.in_use == 0 then
        self:gathered(seg)
        seg.in_use = 1
        self:release(seg)
      end
    end
  end
end

---------------------------------------------------------- routed experts

-- The plan's moe.routed_only: the experts any rank routed to in this
-- block's micro-batch, agreed by one all-reduce (max) of a 0/1 mask of
-- this rank's counts (count[0..n-1]). Returns the agreed mask (routed[e]
-- nonzero: some rank routed to expert e). Every rank calls it once per
-- block forward (the replay of activation checkpointing reuses the
-- forward's), so the collective never depends on the routing.
function Gatherer:agree_routed(count, n)
  local t = lz.tensor({ n }, "f32", "workspace")
  local p = ffi.cast("float *", t.data)
  for e = 0, n - 1 do p[e] = count[e] > 0 and 1 or 0 end
  self.comm.all_reduce(t, "max")
  local routed = ffi.new("uint8_t[?]", n)
  for e = 0, n - 1 do routed[e] = p[e] > 0 and 1 or 0 end
  t:free()
  return routed
end

-- Expert bytes read since the last call, and what gathering every expert
-- at the same points would have read; both counts start again.
function Gatherer:take_expert_bytes()
  local read, full = self.expert_read, self.expert_read + self.expert_skipped
  self.expert_read, self.expert_skipped = 0, 0
  return read, full
end

-- A gather an unrouted expert skips: its place in the pass is kept (the
-- recorded order and the prefetch along it stay aligned on every rank),
-- and the bytes it would have read counted. A gather prefetched before the
-- ranks agreed (the prefetch follows the last pass's marks) is dropped.
function Gatherer:skip_for(m, order, pass, counted)
  for _, seg in ipairs(self.segs_of[m]) do
    record(order, seg, pass)
    if seg.pbuf and seg.in_use == 0 then
      self:gathered(seg)
      seg.in_use = 1
      self:release(seg)
    elseif not counted and not seg.persistent and not seg.pbuf then
      self.expert_skipped = self.expert_skipped + seg.slice * esize[self.wdt]
    end
  end
end

-- Whether an unrouted expert's backward skips its gradients' reduction:
-- unless an earlier micro-step of this accumulation reduced them (then its
-- zeros are reduced and added as the gather-all path adds them, so the
-- gradients hold the same bits, signed zeros included).
function Gatherer:skips_reduce(m)
  return m.unrouted and m.reduced_cycle ~= self.reducer.cycle
end

------------------------------------------------------------------- hooks

function Gatherer:pre_forward(m)
  if not self.segs_of[m] or not self.P.params.gather then return end
  if m.unrouted then return self:skip_for(m, self.fwd_order, self.fwd_pass) end
  self:gather_for(m, self.fwd_order, self.fwd_pass)
end

function Gatherer:post_forward(m)
  local segs = self.segs_of[m]
  if not segs or not self.P.params.gather or m.unrouted then return end
  for _, seg in ipairs(segs) do self:release(seg) end
end

function Gatherer:pre_backward(m)
  local segs = self.segs_of[m]
  if not segs then return end
  if self.P.params.gather then
    if m.unrouted then
      self:skip_for(m, self.bwd_order, self.bwd_pass, m.replay_skipped)
    else
      self:gather_for(m, self.bwd_order, self.bwd_pass)
    end
  end
  m.skip_reduce = self:skips_reduce(m)
  if m.skip_reduce then return end
  m.reduced_cycle = self.reducer.cycle
  self.reducer:stage_grads(segs, m)
end

function Gatherer:post_backward(m)
  local segs = self.segs_of[m]
  if not segs then return end
  for _, seg in ipairs(segs) do
    if self.P.params.gather and not m.unrouted then self:release(seg) end
  end
  if m.skip_reduce then return end
  for _, seg in ipairs(segs) do
    if not seg.frozen then seg.pending = seg.pending - 1 end
    if seg.pending == 0 then
      seg.pending = nil
      self.reducer:grads_ready(seg)
    end
  end
end

-- Activation checkpointing with parameters gathered per module: a
-- checkpointed module's parameters (all its descendants' segments) are
-- gathered before its forward is replayed and held through its backward,
-- so one gather serves both. The replay runs no forward hooks: the
-- recorded prefetch orders and the gradient reductions see only the real
-- forward and backward.
-- An unrouted expert's segments are not gathered for the replay (its
-- module, found beside each segment, says so as its forward left it).
function Gatherer:recompute_segs(m)
  local list = self.recompute_segs_of[m]
  if list then return list end
  list = {}
  local seen = {}
  local function visit(x)
    for _, seg in ipairs(self.segs_of[x] or {}) do
      if not seen[seg] then seen[seg] = true; list[#list + 1] = { seg = seg, holder = x } end
    end
    for _, c in ipairs(x.children) do visit(c.module) end
  end
  visit(m)
  self.recompute_segs_of[m] = list
  return list
end

function Gatherer:pre_recompute(m)
  if not self.P.params.gather then return end
  for _, u in ipairs(self:recompute_segs(m)) do
    local h = u.holder
    if not h.unrouted then
      self:ensure(u.seg)
    elseif not h.replay_skipped then
      -- (counted here, once: the gather-all path gathers it here, and its
      -- backward finds it gathered)
      self.expert_skipped = self.expert_skipped + u.seg.slice * esize[self.wdt]
      h.replay_skipped = true
    end
  end
end

function Gatherer:post_recompute(m)
  if not self.P.params.gather then return end
  for _, u in ipairs(self:recompute_segs(m)) do
    if u.holder.unrouted then u.holder.replay_skipped = nil else self:release(u.seg) end
  end
end

------------------------------------------------------------ after the step

-- What the plan gathers after the step: every rank's updated slices into
-- every rank's full working copy, or the persistent parameters.
function Gatherer:gather_params()
  local after = self.P.after_step
  if after == "none" then return end
  local async, works, slots = self.s.overlap, {}, {}
  for _, seg in ipairs(self.L.segments) do
    local send, recv, stg
    if after == "gather_full" then
      recv = self.work:view(seg.full_offset, { seg.padded })
      send = recv:view(seg.mine.full_offset - seg.full_offset, { seg.slice })
    elseif seg.persistent then
      recv = seg.persistent
      send, stg = self:shard_slice(seg)
    end
    if recv then works[#works + 1] = self:all_gather(seg, send, recv, async) end
    if stg then
      if async then slots[#slots + 1] = stg else self:release_slice(stg) end
    end
  end
  if async then for _, w in ipairs(works) do w:wait() end end
  for _, stg in ipairs(slots) do self:release_slice(stg) end
end

return M
