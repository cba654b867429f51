-- zero/layout.lua — how a model's parameters lie in the ZeRO engine's flat,
-- partitioned buffers. A pure function of the parameter table and the world
-- size, so every stage at one world size uses the same layout (and gets the
-- same bits), and tests can recompute the expected bytes.
--
-- The canonical parameter order is cut into segments: the parameters one
-- module owns (a Linear's weight and bias, a LayerNorm's pair, the
-- embedding's two tables). Each segment is padded to a multiple of
-- world * ALIGN elements and split into `world` equal slices; rank r owns
-- slice r of every segment (DeepSpeed's stage 3 partitions each parameter
-- the same way). A rank's shard is contiguous in its own memory: its slices
-- of all segments, one after another. The full ("gathered") buffer holds the
-- segments one after another, each padded.
--
-- With a block (an optimizer whose states are block-scaled: 8-bit AdamW's
-- 256), every parameter starts on a multiple of it within its segment and
-- slices are multiples of it, so each block lies in one parameter and on
-- one rank, counted from the parameter's start as a whole-tensor
-- optimizer counts it; the gaps are padding.
--
--   local L = layout.new(param_table, world [, align [, block]])
--   L.segments[i] = { index, module, entries, numel, extent, padded,
--                     full_offset, slice, shard_offset }
--   (numel: its parameters' elements; extent: where its last one ends,
--   gaps included; the two differ only with a block)
--   L.full_numel, L.shard_numel, L.numel (unpadded)
local M = {}

-- Elements per slice are a multiple of this: 64 bytes of f32.
M.ALIGN = 16

local function round_up(n, m) return math.ceil(n / m) * m end
M.round_up = round_up

-- Elements per piece where half gradients pass through an fp32 scratch
-- (the optimizer's reads, the micro-step adds).
M.CHUNK = 65536

-- Binds module.p (or .g, field) views of one segment onto `buf` (its
-- padded full extent), or unbinds them (nil).
function M.bind(field, seg, buf)
  for _, e in ipairs(seg.entries) do
    e.entry.module[field][e.entry.key] = buf and buf:view(e.seg_offset, e.shape) or nil
  end
end

function M.new(param_table, world, align, block)
  align = align or M.ALIGN
  if block then align = math.max(align, block) end
  local L = { world = world, segments = {}, by_module = {}, numel = 0, block = block }
  local full, shard = 0, 0
  local seg
  for _, e in ipairs(param_table) do
    if not seg or seg.module ~= e.module then
      seg = { index = #L.segments + 1, module = e.module, entries = {}, numel = 0, extent = 0 }
      L.segments[#L.segments + 1] = seg
      L.by_module[e.module] = seg
    end
    local at = block and round_up(seg.extent, block) or seg.extent
    seg.entries[#seg.entries + 1] = {
      entry = e, seg_offset = at, numel = e.numel, shape = e.shape, decay = e.decay,
      offset = e.offset,
    }
    seg.numel, seg.extent = seg.numel + e.numel, at + e.numel
    L.numel = L.numel + e.numel
  end
  for _, s in ipairs(L.segments) do
    s.padded = round_up(s.extent, world * align)
    s.slice = s.padded / world
    s.full_offset, s.shard_offset = full, shard
    full, shard = full + s.padded, shard + s.slice
  end
  L.full_numel, L.shard_numel = full, shard
  return L
end

-- Runs {full_offset, shard_offset, numel, decay, matrix} over this rank's
-- slices: the pieces of each slice that one decay setting covers (padding
-- counts as no decay; it stays zero either way). Offsets in elements.
-- matrix_of (optional): entry -> a table for a parameter the optimizer
-- updates as a whole matrix, or nil; its pieces are runs of their own,
-- with run.matrix that table. by_segment: runs never span two segments,
-- and run.canonical is the canonical index of a run's first element (its
-- parameter's offset plus its place in it; past the parameters, padding
-- continues the count of the segment's first). kind_of (optional): entry ->
-- a value runs must share to merge (run.kind); padding then has kind "pad"
-- and merges with nothing else.
function M.shard_runs(L, rank, matrix_of, by_segment, kind_of)
  local runs = {}
  local seg_now
  local function add(full_off, shard_off, n, decay, matrix, e)
    if n <= 0 then return end
    local kind = kind_of and (e and kind_of(e.entry) or "pad") or nil
    local last = runs[#runs]
    if last and last.decay == decay and last.matrix == matrix and last.kind == kind and
       (not by_segment or last.seg == seg_now) and
       last.full_offset + last.numel == full_off and
       last.shard_offset + last.numel == shard_off then
      last.numel = last.numel + n
    else
      runs[#runs + 1] = { full_offset = full_off, shard_offset = shard_off, numel = n,
                          decay = decay, matrix = matrix, kind = kind }
      if by_segment then
        local run, at = runs[#runs], full_off - seg_now.full_offset
        run.seg = seg_now
        run.canonical = e and e.offset + (at - e.seg_offset) or seg_now.entries[1].offset + at
      end
    end
  end
  for _, s in ipairs(L.segments) do
    seg_now = s
    local lo, hi = rank * s.slice, (rank + 1) * s.slice -- within the segment
    local pos = lo
    for _, e in ipairs(s.entries) do
      local a, b = math.max(lo, e.seg_offset), math.min(hi, e.seg_offset + e.numel)
      if b > a then
        add(s.full_offset + pos, s.shard_offset + pos - lo, a - pos, false) -- gap (none)
        add(s.full_offset + a, s.shard_offset + a - lo, b - a, e.decay,
            matrix_of and matrix_of(e.entry) or nil, e)
        pos = b
      end
    end
    add(s.full_offset + pos, s.shard_offset + pos - lo, hi - pos, false) -- padding
  end
  return runs
end

-- Where optimizer elements lie in canonical coordinates: runs {offset,
-- canonical, numel} over the unpadded parameters, in increasing offset
-- (and canonical) order; padding is in no run. rank nil: the full padded
-- layout (stage 0's optimizer); else `rank`'s shard layout.
function M.canonical_runs(L, rank)
  local runs = {}
  local function add(off, canon, n)
    local last = runs[#runs]
    if last and last.offset + last.numel == off and last.canonical + last.numel == canon then
      last.numel = last.numel + n
    else
      runs[#runs + 1] = { offset = off, canonical = canon, numel = n }
    end
  end
  for _, s in ipairs(L.segments) do
    local lo, hi = 0, s.padded
    if rank then lo, hi = rank * s.slice, (rank + 1) * s.slice end
    local base = rank and (s.shard_offset - lo) or s.full_offset
    for _, e in ipairs(s.entries) do
      local a, b = math.max(lo, e.seg_offset), math.min(hi, e.seg_offset + e.numel)
      if b > a then add(base + a, e.offset + a - e.seg_offset, b - a) end
    end
  end
  return runs
end

return M
