-- zero/offload.lua — where the optimizer states live (DeepSpeed's
-- offload_optimizer) and, at stage 3, the parameter shard (offload_param):
-- on the compute device ("none"), in host memory ("cpu"), or in swap files
-- on NVMe ("nvme", libaio with O_DIRECT through lz.swap).
--
-- Where the bytes live is a store kind (zero/store/): this file asks the
-- kind whether they are memory to update in place or a file to stage
-- through, and lets it allocate, open, read and write.
--
-- The optimizer elements of a rank, [0, n), are cut into sub-groups of
-- zero_optimization.sub_group_size elements. The optimizer step visits them
-- in order through a ring of buffer_count staging buffers: on NVMe, the next
-- sub-groups are read while the current one is updated and the previous one
-- is written back (pipeline_read / pipeline_write). With the parameter shard
-- on NVMe, each sub-group's updated working copy goes to the parameter swap
-- file from a staging buffer of the same ring.
--
-- On a CPU rank the host is the compute device, so "cpu" changes where the
-- ledger counts the bytes (offload), not how many there are; a rank on an
-- accelerator (sim, cuda) puts the same buffers in pinned host memory, and
-- "none" puts the states in device memory.
--
--   local st = offload.states{ n = n, master = true, tier = "nvme", ... }
--   st:each_group(write_back, function(k, lo, len, v) ... v.master, v.s (the states), v.work end [, fresh])
--   (v.scales: a block-scaled state's f32 scales, one per block of the group)
--   local ps = offload.param_shard{ n = shard_numel, dtype = "bf16", device = "nvme", ... }
--   local view, stage = ps:slice(offset, len) ... ps:release(stage)
local lz = require("luazero")
local store = require("luazero.zero.store")
local optimizers = require("luazero.optim.registry")
local formats = require("luazero.optim.formats")

local M = {}

-- Group boundaries are multiples of GRAIN elements: every file offset is
-- then a multiple of 4096 bytes in f32, bf16 and f16 (O_DIRECT).
M.GRAIN = 2048
local PAGE = 4096

local function round_up(n, m) return math.ceil(n / m) * m end
local esize = require("luazero.zero.plan").esize

-- Staging buffers: at least 2 MiB, so the ledger hands out 2 MiB-aligned
-- memory on huge pages (O_DIRECT needs 4 KiB alignment).
function M.staging(n, dtype, compute)
  local min = math.ceil(2 ^ 21 / esize[dtype])
  return M.host({ math.max(n, min) }, dtype, compute)
end
local staging = M.staging

-- A host buffer counted as offload: pinned beside an accelerator.
local host = store.get("host")
function M.host(shape, dtype, compute) return host.allocate(shape, dtype, "offload", compute) end

function M.swap_opts(aio)
  aio = aio or {}
  return { block_size = aio.block_size, queue_depth = aio.queue_depth,
           thread_count = aio.thread_count, single_submit = aio.single_submit,
           overlap_events = aio.overlap_events }
end
local swap_opts = M.swap_opts

------------------------------------------------------------ optimizer states

local States = {}
States.__index = States

-- opts: n (optimizer elements of this rank), master (true: keep a master
-- copy here; false: the working copy is the master), master_dtype (the
-- copy's: f32, or bf16 for a bf16 master; f32), names
-- (the optimizer's per-element states, in order; the default
-- optimizer's: AdamW's m, v), formats (name -> format: f32, bf16 or u8;
-- f32 when absent; a block-scaled format keeps one f32 scale per block
-- beside the elements, in the same tier), small (elements whose states a
-- block-scaled optimizer keeps in f32 instead, a tensor under its minimum
-- size: f32 arrays `small` of that many elements, in memory on every tier,
-- as small is a few kilobytes a tensor), signed (name -> true: a
-- block-scaled state in the signed map),
-- tier (the plan's tier of the states: a store kind's name), nvme_path
-- (where a kind that is not resident opens its file), aio (the config's aio block),
-- sub_group_size, buffer_count, pipeline_read, pipeline_write,
-- params (a param_shard on NVMe whose working copy the groups write back),
-- work_dtype (the working copy's dtype when params is given), compute
-- (the rank's compute device: "cpu", "sim" or "cuda"; "none" states live
-- in its memory), grads (true: each staging buffer also holds a group's
-- gradients, read from the gradient file, zero/spill.lua, set as .spill).
function M.states(opts)
  local n, kind = opts.n, store.get(opts.tier or "device")
  local names = opts.names or optimizers.default.states
  -- Each state's element dtype (its format's: optim/formats.lua), and the
  -- block of a block-scaled one (nil: none).
  local dts, blocks = {}, {}
  for i, name in ipairs(names) do
    local f = formats.get((opts.formats or {})[name] or formats.default)
    dts[i], blocks[i] = f.dtype, f.block
  end
  local mdt = opts.master_dtype or "f32"
  local self = setmetatable({ n = n, kind = kind, has_master = opts.master, names = names,
                              dtypes = dts, blocks = blocks, signed = {}, master_dtype = mdt,
                              params = opts.params, wdt = opts.work_dtype,
                              compute = opts.compute or "cpu",
                              pipeline_read = opts.pipeline_read,
                              pipeline_write = opts.pipeline_write }, States)
  local on_disk = not kind.resident
  local G = n
  if on_disk or opts.params then
    G = round_up(math.max(1, math.min(opts.sub_group_size or n, n)), M.GRAIN)
  end
  self.G = G
  self.groups = {}
  for lo = 0, math.max(n - 1, 0), G do
    self.groups[#self.groups + 1] = { lo = lo, n = math.min(G, n - lo) }
  end
  if n == 0 then self.groups = {} end
  self.s, self.scales, self.small = {}, {}, {}
  if not on_disk then
    local function new(shape, dt) return kind.allocate(shape, dt, "optimizer", self.compute) end
    if opts.master then self.master = new({ n }, mdt) end
    for i = 1, #names do
      self.s[i] = new({ n }, dts[i]):zero()
      if blocks[i] then self.scales[i] = new({ math.max(1, math.ceil(n / blocks[i])) }, "f32"):zero() end
    end
  end
  for i, name in ipairs(names) do self.signed[i] = (opts.signed or {})[name] == true end
  local small = opts.small or 0
  if small > 0 then
    local mem = kind.resident and kind or host
    for i = 1, #names do
      if blocks[i] then
        self.small[i] = mem.allocate({ small }, "f32", "optimizer", self.compute):zero()
      end
    end
  end
  -- A master of the parameter file's dtype (bf16 over bf16) is the working
  -- copy bit for bit (its rounding into that dtype is itself): each group's
  -- master is then read from and written to the parameter file, and the
  -- state file holds the optimizer's states only, which saves writing the
  -- master twice a step.
  self.master_in_params = opts.master and on_disk and opts.params ~= nil and mdt == opts.work_dtype
  -- A group's region of the swap file: the master, then each state (and
  -- its scales), at byte offsets on pages.
  self.part_at, self.scale_at = {}, {}
  self.region = (opts.master and not self.master_in_params) and G * esize[mdt] or 0
  for i = 1, #names do
    self.part_at[i] = self.region
    self.region = self.region + round_up(G * esize[dts[i]], PAGE)
    if blocks[i] then
      self.scale_at[i] = self.region
      self.region = self.region + round_up(G / blocks[i] * esize.f32, PAGE)
    end
  end
  -- The ring of staging buffers (NVMe states, or an NVMe parameter shard).
  self.nb, self.buffers = 0, {}
  if on_disk or opts.params then
    self.nb = math.max(2, opts.buffer_count or 4)
    self.nb = math.min(self.nb, #self.groups)
    for b = 1, self.nb do
      local buf = {}
      if on_disk then buf.state = staging(self.region / esize.f32, "f32", self.compute) end
      if opts.params then buf.work = staging(G, self.wdt, self.compute) end
      if opts.grads then buf.grad = staging(G, "f32", self.compute) end
      self.buffers[b] = buf
    end
  end
  if on_disk then
    self.swap = kind.open(opts.nvme_path, math.max(PAGE, #self.groups * self.region),
                          "optimizer", swap_opts(opts.aio))
  end
  self.views = {}
  for k, g in ipairs(self.groups) do self.views[k] = self:make_views(k, g) end
  return self
end

function States:buffer(k) return self.buffers[(k - 1) % self.nb + 1] end

-- n elements of dtype at byte offset `at` of an f32 staging buffer (a bf16
-- state beside the f32 master in one region).
local function typed_view(st, at, dtype, n)
  if dtype == "f32" then return st:view(at / esize.f32, { n }) end
  return st:view_bytes(at, dtype, { n })
end

-- Views of group k: master (if kept here), s (the states, in order), and
-- work (the staging of its working copy when the parameter shard is on
-- NVMe). Stable per group.
function States:make_views(k, g)
  local v = { s = {} }
  if self.swap then
    local st = self:buffer(k).state
    if self.master_in_params then
      v.master = self:buffer(k).work:view(0, { g.n })
    elseif self.has_master then
      v.master = typed_view(st, 0, self.master_dtype, g.n)
    end
    for j = 1, #self.names do v.s[j] = typed_view(st, self.part_at[j], self.dtypes[j], g.n) end
    for j, at in pairs(self.scale_at) do
      v.scales = v.scales or {}
      v.scales[j] = typed_view(st, at, "f32", math.ceil(g.n / self.blocks[j]))
    end
  else
    if self.master then v.master = self.master:view(g.lo, { g.n }) end
    for j, t in ipairs(self.s) do v.s[j] = t:view(g.lo, { g.n }) end
    for j, t in pairs(self.scales) do
      v.scales = v.scales or {}
      v.scales[j] = t:view(g.lo / self.blocks[j], { math.ceil(g.n / self.blocks[j]) })
    end
  end
  if self.master_in_params then
    v.work = v.master
  elseif self.params then
    v.work = self:buffer(k).work:view(0, { g.n })
  end
  local b = self.nb > 0 and self:buffer(k)
  if b and b.grad then v.g = b.grad:view(0, { g.n }) end
  return v
end

local function wait(req) if req then req:wait() end end

-- Calls fn(k, lo, len, views) for every group in order. The store kind
-- reads the group's states before fn (unless fresh: fn writes all of them)
-- and (write_back) writes them after it: nothing to move for a resident
-- kind, a region of the swap file for NVMe; with an NVMe parameter shard,
-- views.work is written to it after fn when write_back. with_grads: views.g
-- holds the group's gradients, read from the gradient file.
function States:each_group(write_back, fn, fresh, with_grads)
  local groups, kind = self.groups, self.kind
  if self.nb == 0 then
    local read, write = kind.read_group, kind.write_group
    for k, g in ipairs(groups) do
      if not fresh then read(self, k) end
      fn(k, g.lo, g.n, self.views[k])
      if write_back then write(self, k) end
    end
    return
  end
  -- (one group, one buffer: read before its update, as without pipelining;
  -- nb - 1 = 0 would issue no read and re-read the region after writing it)
  local ahead = (self.swap and self.pipeline_read) and math.max(1, self.nb - 1) or 1
  local function issue_read(j)
    local b = self:buffer(j)
    wait(b.write_state); wait(b.write_work)
    b.write_state, b.write_work = nil, nil
    if not fresh then
      b.read = kind.read_group(self, j, b.state)
      if self.master_in_params then b.mread = self.params:read_group(groups[j].lo, b.work, groups[j].n) end
    end
    if with_grads and self.spill then b.gread = self.spill:read(j, b.grad) end
  end
  local ok, err = pcall(function()
    for j = 1, math.min(ahead, #groups) do issue_read(j) end
    for k, g in ipairs(groups) do
      local b = self:buffer(k) -- its read was issued `ahead` groups earlier
      wait(b.read); wait(b.gread); wait(b.mread)
      b.read, b.gread, b.mread = nil, nil, nil
      fn(k, g.lo, g.n, self.views[k])
      if write_back then
        b.write_state = kind.write_group(self, k, b.state)
        if self.params then b.write_work = self.params:write_group(g.lo, b.work, g.n) end
        if not self.pipeline_write then
          wait(b.write_state); wait(b.write_work)
          b.write_state, b.write_work = nil, nil
        end
      end
      if k + ahead <= #groups then issue_read(k + ahead) end
    end
  end)
  -- Every request finishes before the buffers are touched again, error or not.
  for _, b in ipairs(self.buffers) do
    for _, key in ipairs({ "read", "gread", "mread", "write_state", "write_work" }) do
      if b[key] then pcall(b[key].wait, b[key]); b[key] = nil end
    end
  end
  if not ok then error(err, 0) end
end

-- Bytes of the staging ring (host memory, ledger category offload).
function States:staging_bytes()
  local n = 0
  for _, b in ipairs(self.buffers) do
    if b.state then n = n + b.state:bytes() end
    if b.work then n = n + b.work:bytes() end
    if b.grad then n = n + b.grad:bytes() end
  end
  if self.spill then n = n + self.spill:staging_bytes() end
  return n
end

-- Bytes this rank's optimizer states hold on NVMe, read and written so far.
function States:io_bytes()
  local r, w = 0, 0
  if self.swap then
    local s = self.swap:stats()
    r, w = r + s.bytes_read, w + s.bytes_written
  end
  if self.params then
    local s = self.params.swap:stats()
    r, w = r + s.bytes_read, w + s.bytes_written
  end
  if self.spill then
    local sr, sw = self.spill:io_bytes()
    r, w = r + sr, w + sw
  end
  return r, w
end

function States:free()
  -- The gradient file's writes in flight may still read the ring's buffers.
  if self.spill then self.spill:free(); self.spill = nil end
  for _, b in ipairs(self.buffers) do
    if b.state then b.state:free() end
    if b.work then b.work:free() end
    if b.grad then b.grad:free() end
  end
  self.buffers = {}
  if self.swap then self.swap:close(); self.swap = nil end
  if self.master then self.master:free(); self.master = nil end
  for _, t in ipairs(self.s) do t:free() end
  for _, t in pairs(self.scales) do t:free() end
  for _, t in pairs(self.small) do t:free() end
  self.s, self.scales, self.small = {}, {}, {}
end

------------------------------------------------------------ parameter shard

local Params = {}
Params.__index = Params

-- The stage-3 working shard of n elements of dtype in a store kind that is
-- not resident (NVMe): a file in shard order. opts: n, dtype, tier (the
-- kind's name; "nvme"), nvme_path, aio, buffer_count (slices staged at once
-- ahead of use: stage-3 prefetching stops there).
function M.param_shard(opts)
  local self = setmetatable({ n = opts.n, dtype = opts.dtype, es = esize[opts.dtype],
                              compute = opts.compute or "cpu",
                              buffer_count = opts.buffer_count or 5, outstanding = 0,
                              free_stages = {}, all_stages = {} }, Params)
  self.swap = store.get(opts.tier).open(opts.nvme_path,
                                                  round_up(self.n * self.es, PAGE) + PAGE,
                                                  "params", swap_opts(opts.aio))
  return self
end

-- An async write of the first len elements of buf (a 4096-aligned staging
-- tensor) at element offset lo (a multiple of GRAIN). Returns the request.
function Params:write_group(lo, buf, len)
  return self.swap:write(lo * self.es, buf, round_up(len * self.es, PAGE), true)
end

-- An async read of len elements at element offset lo into buf (as
-- write_group writes them). Returns the request.
function Params:read_group(lo, buf, len)
  return self.swap:read(lo * self.es, buf, round_up(len * self.es, PAGE), true)
end

-- Blocking write of a whole shard held in memory (initialisation).
function Params:write_all(t)
  self.swap:write(0, t, round_up(self.n * self.es, PAGE), false)
end

-- Elements [off, off + len) read into a staging buffer; returns a view of
-- them and the staging buffer (give it back with release). async: the read
-- is left in flight as stage.req (wait on it before reading the view), so
-- a prefetch overlaps the disk with the compute before its use.
function Params:slice(off, len, async)
  local a = math.floor(off * self.es / PAGE) * PAGE
  local b = round_up((off + len) * self.es, PAGE)
  local elems = (b - a) / self.es
  local list = self.free_stages[elems]
  local st = list and table.remove(list)
  if not st then
    st = staging(elems, self.dtype, self.compute)
    self.all_stages[#self.all_stages + 1] = st
  end
  local req = self.swap:read(a, st, b - a, async == true)
  self.outstanding = self.outstanding + 1
  return st:view(off - a / self.es, { len }), { t = st, elems = elems, owner = self, req = req }
end

-- Whether another slice may be staged ahead of use (buffer_count).
function Params:can_prefetch() return self.outstanding < self.buffer_count end

function Params:release(stage)
  if not stage then return end
  -- (a read still in flight would land in the buffer's next use)
  if stage.req then stage.req:wait(); stage.req = nil end
  self.outstanding = self.outstanding - 1
  local list = self.free_stages[stage.elems] or {}
  self.free_stages[stage.elems] = list
  list[#list + 1] = stage.t
end

function Params:free()
  for _, t in ipairs(self.all_stages) do t:free() end
  self.all_stages, self.free_stages = {}, {}
  if self.swap then self.swap:close(); self.swap = nil end
end

return M
