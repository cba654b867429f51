-- checkpoint/reader.lua — a checkpoint read without an engine (tools/ckpt,
-- the REPL): its summary, shard table, per-tensor norms, one tensor whole,
-- and the consolidated fp32 master; a progress bar for long reads.
local bit = require("bit")
local ffi = require("ffi")
local lz = require("luazero")
local clock = require("luazero.clock")
local disk = require("luazero.checkpoint.disk")
local manifest_io = require("luazero.checkpoint.manifest")
local atomic = require("luazero.io.atomic")

local fail = disk.fail
local SB = disk.SB
local states_of = disk.states_of

local M = {}

-- A progress bar on stderr, drawn only once the work has taken over 1 s.
local function progress(label, total)
  local t0, last, drawn = clock.now(), 0, false
  local p = {}
  function p.update(done)
    local now = clock.now()
    if now - t0 < 1 or now - last < 0.1 then return end
    last, drawn = now, true
    local frac = total > 0 and math.min(done / total, 1) or 1
    local w = 30
    local fill = math.floor(frac * w + 0.5)
    io.stderr:write(("\r%s [%s%s] %3d%% %.0f MB/s"):format(label, ("#"):rep(fill),
                    (" "):rep(w - fill), math.floor(frac * 100),
                    done / (now - t0) / 1e6))
    io.stderr:flush()
  end
  function p.finish()
    if drawn then
      p.update(total)
      io.stderr:write("\n")
    end
  end
  return p
end
M.progress = progress

-- Reading a checkpoint without an engine (tools/ckpt, the REPL).
local Checkpoint = {}
Checkpoint.__index = Checkpoint

function M.open(path)
  local dir = disk.resolve(path)
  local m = disk.read_manifest(dir)
  local by_name = {}
  for i, p in ipairs(m.params) do by_name[p.name] = i end
  return setmetatable({ dir = dir, manifest = m, by_name = by_name }, Checkpoint)
end

-- The saved states in words, each with its format where it is not f32 (the
-- master's from the record's master_format): "master (bf16), m (u8), v (u8)".
local function states_text(states, optimizer)
  local rec = type(optimizer) == "table" and optimizer or {}
  local fmts = type(rec.state_formats) == "table" and rec.state_formats or {}
  local out = {}
  for i, name in ipairs(states) do
    local f = name == "master" and rec.master_format or fmts[name]
    out[i] = (f and f ~= "f32") and ("%s (%s)"):format(name, f) or name
  end
  return table.concat(out, ", ")
end

-- A one-table summary: step counters, world, stage, dtypes, sizes, the
-- optimizer (its record { type, params }, and where it came from:
-- checkpoint/manifest.lua's optimizer_of) and the states it saved (states,
-- and states_text with their formats).
function Checkpoint:summary()
  local m = self.manifest
  local raw, comp = 0, 0
  for _, s in ipairs(m.shards) do raw, comp = raw + s.raw_bytes, comp + s.compressed_bytes end
  local optimizer, optimizer_from = manifest_io.optimizer_of(m)
  return {
    dir = self.dir, model = m.model and m.model.name, world_size = m.world_size,
    stage = m.stage, dtype = m.dtype, params = #m.params, numel = m.numel,
    optimizer_steps = m.optimizer_steps, global_steps = m.global_steps,
    skipped_steps = m.skipped_steps, loss_scale = m.loss_scaler and m.loss_scaler.scale,
    shards = #m.shards, raw_bytes = raw, compressed_bytes = comp,
    ratio = comp > 0 and raw / comp or 0, created = m.created,
    optimizer = optimizer, optimizer_from = optimizer_from, states = states_of(m),
    states_text = states_text(states_of(m), optimizer),
  }
end

-- Per shard: file, rank, elems, raw and compressed bytes, canonical ranges.
function Checkpoint:shard_table()
  local t = {}
  for i, s in ipairs(self.manifest.shards) do
    local ranges = {}
    for j, r in ipairs(s.runs) do ranges[j] = { r[2], r[2] + r[3] } end
    t[i] = { file = s.file, rank = s.rank, elems = s.elems, raw_bytes = s.raw_bytes,
             compressed_bytes = s.compressed_bytes, ranges = ranges }
  end
  return t
end

-- Calls fn(state, canonical, ptr, n) over every shard (see stream_shard),
-- with a progress bar labelled `label` on long runs.
function Checkpoint:stream(fn, label)
  local m, total = self.manifest, 0
  for _, s in ipairs(m.shards) do total = total + s.raw_bytes end
  local bar, done = progress(label or "reading", total), 0
  for _, s in ipairs(m.shards) do
    disk.stream_shard(self.dir, s, m.block_elems, fn, function(b)
      done = done + b
      bar.update(done)
    end, #states_of(m))
  end
  bar.finish()
end

-- The index of the tensor holding canonical element c (binary search).
local function tensor_at(params, c)
  local lo, hi = 1, #params
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    if params[mid].offset <= c then lo = mid else hi = mid - 1 end
  end
  return lo
end

-- { {name, shape, numel, norm (L2 of the fp32 master)}, ... } in canonical order.
function Checkpoint:norms()
  local params = self.manifest.params
  local sq = {}
  for i = 1, #params do sq[i] = 0 end
  self:stream(function(state, canon, p, n)
    if state ~= 1 then return end
    local i, k = tensor_at(params, canon), 0
    while k < n do
      local e = params[i]
      local stop = math.min(n, e.offset + e.numel - canon)
      local s = 0
      for j = k, stop - 1 do s = s + p[j] * p[j] end
      sq[i] = sq[i] + s
      k, i = stop, i + 1
    end
  end, "norms")
  local out = {}
  for i, e in ipairs(params) do
    out[i] = { name = e.name, shape = e.shape, numel = e.numel, norm = math.sqrt(sq[i]) }
  end
  return out
end

-- One tensor's fp32 master values, whole, as an f32 tensor of its shape.
-- state: "master" (default) or one of the optimizer's ("m", "v" for AdamW).
-- Reads only the shards holding it.
function Checkpoint:tensor(name, state)
  if type(name) ~= "string" then
    fail("tensor: give a tensor's name, e.g. %q (its :norms() lists them)",
         self.manifest.params[1] and self.manifest.params[1].name or "")
  end
  local i = self.by_name[name]
  if not i then
    -- (or the end of one name, after a dot: "wte.weight" for "transformer.wte.weight")
    local hits = {}
    for k, e in ipairs(self.manifest.params) do
      if e.name:sub(-#name - 1) == "." .. name then hits[#hits + 1] = k end
    end
    if #hits > 1 then
      fail("%s: %q ends %d tensors' names (%s, ...); give more of the name", self.dir, name,
           #hits, self.manifest.params[hits[1]].name)
    end
    i = hits[1]
  end
  if not i then
    fail("%s has no tensor %q (the checkpoint's :norms() lists them, e.g. %q)", self.dir, name,
         self.manifest.params[1] and self.manifest.params[1].name or "")
  end
  local names = states_of(self.manifest)
  local which
  for k, n in ipairs(names) do if n == (state or "master") then which = k end end
  if not which then
    fail("state %q is not one this checkpoint holds (%s)", tostring(state), table.concat(names, ", "))
  end
  local e = self.manifest.params[i]
  local t = lz.tensor(e.shape, "f32", "workspace")
  local out = ffi.cast("float *", t.data)
  local lo, hi = e.offset, e.offset + e.numel
  for _, s in ipairs(self.manifest.shards) do
    local needed = false
    for _, r in ipairs(s.runs) do
      if r[2] < hi and r[2] + r[3] > lo then needed = true end
    end
    if needed then
      disk.stream_shard(self.dir, s, self.manifest.block_elems, function(state_, canon, p, n)
        if state_ ~= which then return end
        local a, b = math.max(canon, lo), math.min(canon + n, hi)
        if b > a then ffi.copy(out + (a - lo), p + (a - canon), (b - a) * SB) end
      end, nil, #names)
    end
  end
  return t
end

-- Writes the fp32 master weights in canonical order to `out`: a 256-int32
-- header (magic 20240521, version 1, tensor count, element count low and
-- high 32 bits) then the floats; complete or not at all (io/atomic.lua).
-- Memory: one block per shard read.
M.CONSOLIDATED_MAGIC = 20240521
function Checkpoint:consolidate(out)
  local m = self.manifest
  atomic.build_file(out, 1024 + m.numel * SB, function(w)
    local header = ffi.new("int32_t[256]")
    header[0], header[1], header[2] = M.CONSOLIDATED_MAGIC, 1, #m.params
    -- (the low word's bits: an int32 field takes 2^31 and above as they
    -- wrap, which bit.tobit gives; a plain assignment would saturate)
    header[3], header[4] = bit.tobit(m.numel % 2 ^ 32), math.floor(m.numel / 2 ^ 32)
    w:write(header, 1024)
    self:stream(function(state, canon, p, n)
      if state == 1 then w:pwrite(p, n * SB, 1024 + canon * SB) end
    end, "consolidate")
  end)
  return m.numel
end

return M
