-- zero/frozen.lua — frozen parameters (LoRA's base, model:freeze) as ZeRO
-- citizens: no gradients and no optimizer states, placed as the plan's
-- `frozen` entry says. Below stage 3 one whole buffer in the working dtype
-- on every rank. At stage 3 they are partitioned like the trained ones (a
-- layout of their own: each module's segment padded and cut in `world`
-- slices), this rank's slices kept where offload_param puts the working
-- shard (device, host or NVMe), gathered per module before it runs and
-- released after; small modules are kept whole (persistent). A frozen
-- weight a LoRA wrapper adapts is gathered with the wrapper, which reads it
-- before its Linear runs. A component of the engine (engine.frozen), with
-- its own state — the whole buffer (below stage 3) or the frozen layout,
-- its store and where each weight lies in it, the staging window that
-- streams weights to NVMe — made from the entries, the plan and the
-- settings it is handed.
--
-- Weights arrive in canonical order (a draw, or --init) through write,
-- each rank keeping its part; done ends the stream.
--
--   local frozen = Frozen.new{ entries = es, P = P, s = s, ... }
--   frozen:write(e, a, t); frozen:done(); frozen:checksum(gatherer, comm)
local lz = require("luazero")
local layout = require("luazero.zero.layout")
local offload = require("luazero.zero.offload")
local esize = require("luazero.zero.plan").esize
local store = require("luazero.zero.store")

local M = {}
local Frozen = {}
Frozen.__index = Frozen

local PAGE = 4096
-- Elements of the staging that streams weights into an NVMe frozen shard.
local WINDOW = 2 ^ 23

local function round_up(n, m) return math.ceil(n / m) * m end

-- parts: entries (the model's frozen parameter entries, in canonical
-- order), P (the plan), s (the engine's settings), world, rank, dev (the
-- compute device), model, segs_of (module -> the segments its hooks
-- gather: the frozen segments are added to it at stage 3).
-- Fields others read: entries, LF (the frozen layout at stage 3, else nil).
function M.new(parts)
  local self = setmetatable({ entries = parts.entries, P = parts.P, s = parts.s,
                              world = parts.world, rank = parts.rank, dev = parts.dev },
                            Frozen)
  local entries, F = self.entries, self.P.frozen
  if #entries == 0 then return self end
  local wdt = F.dtype
  if F.extent == "full" then
    local nf = 0
    for _, e in ipairs(entries) do nf = nf + e.numel end
    self.whole = lz.tensor({ nf }, wdt, "params", self.dev)
    local off = 0
    for _, e in ipairs(entries) do
      e.frozen_offset = off
      e.module.p[e.key] = self.whole:view(off, e.shape)
      e.module.g[e.key] = nil
      off = off + e.numel
    end
    return self
  end
  local s = self.s
  local LF = layout.new(entries, self.world)
  self.LF = LF
  local fstore = { upload = not self.P:store("frozen").on_device and self.dev ~= "cpu" }
  if self.P:swapped("frozen") then
    local op = s.offload_param
    fstore.pshard = offload.param_shard{ n = LF.shard_numel, dtype = wdt, tier = F.tier,
                                         nvme_path = op.nvme_path,
                                         aio = s.aio, buffer_count = op.buffer_count,
                                         compute = self.dev }
  else
    fstore.work = store.get(F.tier).allocate({ LF.shard_numel }, wdt, "params", self.dev)
  end
  self.store = fstore
  self.where = {}
  for _, seg in ipairs(LF.segments) do
    seg.frozen, seg.store, seg.in_use = true, fstore, 0
    seg.mine = { full_offset = seg.full_offset + self.rank * seg.slice,
                 shard_offset = seg.shard_offset, numel = seg.slice }
    for _, se in ipairs(seg.entries) do
      se.entry.module.g[se.entry.key] = nil
      se.entry.module.p[se.entry.key] = nil
      self.where[se.entry.name] = { seg = seg, at = se.seg_offset }
    end
    if seg.numel <= s.persistence then
      seg.persistent = lz.tensor({ seg.padded }, wdt, "params", self.dev):zero()
      layout.bind("p", seg, seg.persistent)
    end
  end
  -- Which module's hooks gather each segment: its own, or the LoRA
  -- wrapper's around it; and tied modules that read a frozen table.
  local model, segs_of, holder = parts.model, parts.segs_of, {}
  model:walk(function(m)
    if m.base and LF.by_module[m.base] then holder[m.base] = m end
  end)
  local function attach(m, seg)
    local list = segs_of[m] or {}
    segs_of[m] = list
    list[#list + 1] = seg
  end
  for _, seg in ipairs(LF.segments) do attach(holder[seg.module] or seg.module, seg) end
  model:walk(function(m)
    if m.tied then
      for _, name in pairs(m.tied) do
        local w = self.where[name]
        if w then attach(m, w.seg) end
      end
    end
  end)
  return self
end

-- The parts of frozen parameter e this rank keeps, as element ranges
-- { {a, n}, ... } (a reader fetches only these).
function Frozen:ranges(e)
  local w = self.where and self.where[e.name]
  if not w or w.seg.persistent then return { { 0, e.numel } } end
  local seg = w.seg
  local lo = math.max(0, self.rank * seg.slice - w.at)
  local hi = math.min(e.numel, (self.rank + 1) * seg.slice - w.at)
  if hi <= lo then return {} end
  return { { lo, hi - lo } }
end

-- Writes dst <- src (converted), freeing both views.
local function put(dst, src)
  dst:convert(src)
  dst:free()
  src:free()
end

-- Elements [a, a + n) of frozen parameter e in fp32 (host tensor t) into
-- this rank's part of the frozen store, in the working dtype.
function Frozen:write(e, a, t)
  local n = t:numel()
  if self.whole then return put(self.whole:view(e.frozen_offset + a, { n }), t:view(0, { n })) end
  local w = self.where[e.name]
  local seg, p0 = w.seg, w.at + a -- padded-segment position of t[0]
  if seg.persistent then put(seg.persistent:view(p0, { n }), t:view(0, { n })) end
  local lo = math.max(p0, self.rank * seg.slice)
  local hi = math.min(p0 + n, (self.rank + 1) * seg.slice)
  if hi <= lo then return end
  local at = seg.shard_offset + lo - self.rank * seg.slice -- shard position
  local src = t:view(lo - p0, { hi - lo })
  if self.store.work then return put(self.store.work:view(at, { hi - lo }), src) end
  self:stream(at, src)
end

-- NVMe: weights arrive in shard order; a window of staging collects them
-- and is written whole when the next ones fall past it (padding stays zero).
function Frozen:stream(at, src)
  local ps, n = self.store.pshard, src:numel()
  local wd = self.window
  if not wd then
    wd = { buf = offload.staging(WINDOW, ps.dtype, self.dev), lo = nil }
    self.window = wd
  end
  local off = 0
  while off < n do
    local pos = at + off
    if wd.lo and (pos < wd.lo or pos >= wd.lo + WINDOW) then self:flush() end
    if not wd.lo then
      wd.lo = math.floor(pos / offload.GRAIN) * offload.GRAIN
      wd.hi = wd.lo
      wd.buf:zero()
    end
    local k = math.min(n - off, wd.lo + WINDOW - pos)
    put(wd.buf:view(pos - wd.lo, { k }), src:view(off, { k }))
    wd.hi = math.max(wd.hi, pos + k)
    off = off + k
  end
  src:free()
end

function Frozen:flush()
  local wd = self.window
  if not wd or not wd.lo then return end
  local ps = self.store.pshard
  local bytes = round_up((wd.hi - wd.lo) * ps.es, PAGE)
  ps.swap:write(wd.lo * ps.es, wd.buf, bytes, false)
  wd.lo = nil
end

-- Every frozen weight has been written: the staging goes.
function Frozen:done()
  if not self.window then return end
  self:flush()
  self.window.buf:free()
  self.window = nil
end

-- xxh64 (hex) of the frozen parameters' values in canonical order, in the
-- working dtype: the same on every rank, stage and world size holding the
-- same numbers. At stage 3 each module's slices are gathered in turn
-- (gatherer: where a gather reads this rank's slices; comm: the ranks').
function Frozen:checksum(gatherer, comm)
  local h = lz.hasher(0)
  local function hash(t, n)
    local host = t:device_name() ~= "cpu" and t:to("cpu")
    h:update((host or t).data, n * esize[t:dtype_name()])
    if host then host:free() end
  end
  if self.whole then
    hash(self.whole, self.whole:numel())
  elseif self.LF then
    for _, seg in ipairs(self.LF.segments) do
      if seg.persistent then
        hash(seg.persistent, seg.numel)
      else
        local full = lz.tensor({ seg.padded }, self.P.frozen.dtype, "workspace", self.dev)
        local send, stage = gatherer:shard_slice(seg)
        comm.all_gather(send, full)
        gatherer:release_slice(stage)
        hash(full, seg.numel)
        full:free()
      end
    end
  end
  local hex = require("bit").tohex(h:digest(), 16)
  h:free()
  return hex
end

-- The frozen parameters' NVMe parameter file (an offload.param_shard), or
-- nil where they are in memory.
function Frozen:pshard() return self.store and self.store.pshard end

-- Bytes of frozen parameters this rank holds in memory (device or host).
function Frozen:bytes()
  if self.whole then return self.whole:bytes() end
  if not self.LF then return 0 end
  local n = self.store.work and self.store.work:bytes() or 0
  for _, seg in ipairs(self.LF.segments) do
    if seg.persistent then n = n + seg.persistent:bytes() end
  end
  return n
end

function Frozen:free()
  if self.whole then self.whole:free(); self.whole = nil end
  if self.window then self.window.buf:free(); self.window = nil end
  local fstore = self.store
  if not fstore then return end
  if fstore.work then fstore.work:free() end
  if fstore.pshard then fstore.pshard:free() end
  for _, seg in ipairs(self.LF.segments) do
    if seg.persistent then seg.persistent:free(); seg.persistent = nil end
  end
  self.store = nil
end

return M
