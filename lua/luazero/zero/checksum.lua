-- zero/checksum.lua — params_checksum: xxh64 of the full fp32 master
-- parameters in canonical order, the same bits whatever the stage, world
-- size or tier (the unpadded bytes of each parameter, segment by segment),
-- streamed a chunk at a time so that it needs no gathered copy of a whole
-- segment (a model's token table would double the run's peak at its end).
local ffi = require("ffi")
local lz = require("luazero")
local Placement = require("luazero.zero.plan")

local M = {}

-- The pieces: CHUNK fp32 values at a time.
local CHUNK = 2 ^ 20

-- Hashes into h the parameters' bytes of segment seg that lie in its
-- padded elements [a, a + n), held by chunk (fp32, from element a), and
-- returns the index of the first entry not yet hashed whole, from j.
local function hash_range(h, seg, j, chunk, a, n)
  local es, b = Placement.esize.f32, a + n
  local entries = seg.entries
  while j <= #entries do
    local e = entries[j]
    if e.seg_offset >= b then break end
    local lo, hi = math.max(a, e.seg_offset), math.min(b, e.seg_offset + e.numel)
    if hi > lo then h:update(ffi.cast("char *", chunk.data) + (lo - a) * es, (hi - lo) * es) end
    if e.seg_offset + e.numel > b then break end
    j = j + 1
  end
  return j
end

-- fn(t) with t an fp32 host tensor of view v's values (v itself where it
-- is one), freed after; widened(v): an fp32 copy of a bf16 view, and
-- whether it is one (zero/states.lua's).
local function as_host_f32(v, on_device, widened, fn)
  local host = on_device and v:to("cpu")
  local wide, own = widened(host or v)
  local r = fn(wide)
  if own then wide:free() end
  if host then host:free() end
  return r
end

-- States S's checksum (hex): a resident full master read in place, a
-- sharded one broadcast from each rank's slice in turn, CHUNK values a time.
function M.of(S, widened)
  local h = lz.hasher(0)
  local es = Placement.esize.f32
  local P = S.P
  local on_device = P:on_device("master")
  if S.Lw then -- (the experts in their groups: whole segments)
    S:full_master_segments(function(seg, full)
      for _, e in ipairs(seg.entries) do
        h:update(ffi.cast("char *", full.data) + e.seg_offset * es, e.numel * es)
      end
    end)
  elseif not P:swapped("master") and P.master.extent == "full" then
    for _, seg in ipairs(S.L.segments) do
      local j = 1
      for a = 0, seg.extent - 1, CHUNK do
        local n = math.min(CHUNK, seg.extent - a)
        local v = S.master:view(seg.full_offset + a, { n })
        j = as_host_f32(v, on_device, widened, function(t)
          return hash_range(h, seg, j, t, a, n)
        end)
        v:free()
      end
    end
  elseif P:swapped("master") and S.world == 1 then
    -- One rank reading its master from NVMe: hashed in the sub-groups'
    -- buffers as they come (a segment may span several)
    local at, j = nil, 1
    S:swapped_master_pieces(function(seg, a, b, master, lo)
      if seg ~= at then at, j = seg, 1 end
      for c = a, b - 1, CHUNK do
        local m = math.min(CHUNK, b - c)
        local view = master:view(c - lo, { m })
        j = as_host_f32(view, on_device, widened, function(t)
          return hash_range(h, seg, j, t, c - seg.shard_offset, m)
        end)
        view:free()
      end
    end)
  else
    local buf = lz.tensor({ CHUNK }, "f32", "workspace")
    S:master_slices(function(seg, slice)
      local j = 1
      for r = 0, S.world - 1 do
        for a = 0, seg.slice - 1, CHUNK do
          local n = math.min(CHUNK, seg.slice - a)
          local out = buf:view(0, { n })
          if r == S.rank then
            local v = slice:view(a, { n })
            as_host_f32(v, on_device, widened, function(t) out:copy(t) end)
            v:free()
          end
          S.comm.broadcast(out, r)
          j = hash_range(h, seg, j, out, r * seg.slice + a, n)
          out:free()
        end
      end
    end)
    buf:free()
  end
  local hex = require("bit").tohex(h:digest(), 16)
  h:free()
  return hex
end

return M
