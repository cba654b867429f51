-- monitor/tensorboard.lua — TensorBoard event files written directly: the
-- TFRecord framing (uint64 length, masked CRC-32C of the length, the data,
-- masked CRC-32C of the data) around Event protocol buffers encoded here:
-- first one with file_version "brain.Event:2", then one per step whose
-- Summary holds a simple_value for each scalar. TensorBoard (and its
-- EventAccumulator) reads them as PyTorch's SummaryWriter's.
--
--   local tb = tensorboard.open("runs/job")   -- runs/job/events.out.tfevents.<time>.<host>.<pid>
--   tb:scalars(step, { { "Train/Samples/lr", 1e-3 }, ... }, wall_time)
--   tb:close()
-- Each record is appended in one write when its step ends (luazero/jsonl.lua).
local ffi = require("ffi")
local bit = require("bit")
local jsonl = require("luazero.jsonl")
require("luazero.clock") -- declares clock_gettime and its timespec

pcall(ffi.cdef, "int gethostname(char *name, size_t len);")
pcall(ffi.cdef, "int getpid(void);")

local band, bxor, bor, rshift, lshift = bit.band, bit.bxor, bit.bor, bit.rshift, bit.lshift

local M = {}

------------------------------------------------------------------ CRC-32C

-- CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), table-driven.
local CRC_TABLE = {}
for i = 0, 255 do
  local c = i
  for _ = 1, 8 do
    if band(c, 1) ~= 0 then c = bxor(rshift(c, 1), 0x82F63B78) else c = rshift(c, 1) end
  end
  CRC_TABLE[i] = c
end

function M.crc32c(s)
  local c = 0xFFFFFFFF
  for i = 1, #s do
    c = bxor(CRC_TABLE[band(bxor(c, s:byte(i)), 0xFF)], rshift(c, 8))
  end
  return bxor(c, 0xFFFFFFFF) % 2 ^ 32
end

-- TFRecord's masked CRC: rotate right by 15, add 0xa282ead8 (mod 2^32).
function M.masked_crc(s)
  local c = M.crc32c(s)
  local rot = bor(rshift(c, 15), lshift(c, 17)) % 2 ^ 32
  return (rot + 0xa282ead8) % 2 ^ 32
end

------------------------------------------------------------------ encoding

local u32, u64 = ffi.new("uint32_t[1]"), ffi.new("uint64_t[1]")
local f32, f64 = ffi.new("float[1]"), ffi.new("double[1]")

local function le32(v) u32[0] = v; return ffi.string(u32, 4) end
local function le64(v) u64[0] = v; return ffi.string(u64, 8) end

local function varint(n)
  local out = {}
  repeat
    local b = n % 128
    n = math.floor(n / 128)
    out[#out + 1] = string.char(n > 0 and b + 128 or b)
  until n == 0
  return table.concat(out)
end

local function bytes_field(key, s) return string.char(key) .. varint(#s) .. s end

-- Event { double wall_time = 1; int64 step = 2; string file_version = 3;
--         Summary summary = 5; SessionLog session_log = 7 };
-- Summary { repeated Value value = 1 };
-- Value { string tag = 1; float simple_value = 2 };
-- SessionLog { SessionStatus status = 1 } (START = 1).
function M.event(wall_time, step, fields)
  f64[0] = wall_time
  local parts = { "\9", ffi.string(f64, 8), "\16", varint(step) }
  if fields.file_version then parts[#parts + 1] = bytes_field(0x1a, fields.file_version) end
  if fields.session_start then parts[#parts + 1] = bytes_field(0x3a, "\8\1") end
  if fields.scalars then
    local values = {}
    for i, sv in ipairs(fields.scalars) do
      f32[0] = sv[2]
      values[i] = bytes_field(0x0a, bytes_field(0x0a, sv[1]) .. "\21" .. ffi.string(f32, 4))
    end
    parts[#parts + 1] = bytes_field(0x2a, table.concat(values))
  end
  return table.concat(parts)
end

-- One TFRecord around `data`.
function M.record(data)
  local len = le64(#data)
  return len .. le32(M.masked_crc(len)) .. data .. le32(M.masked_crc(data))
end

------------------------------------------------------------------ the file

-- Seconds since the epoch, with the fraction (CLOCK_REALTIME).
local ts = ffi.new("lz_clock_timespec")
function M.wall_time()
  ffi.C.clock_gettime(0, ts)
  return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
end

local Writer = {}
Writer.__index = Writer

local function hostname()
  local buf = ffi.new("char[256]")
  if ffi.C.gethostname(buf, 255) ~= 0 then return "localhost" end
  return ffi.string(buf)
end

-- A new event file in dir (which must exist); nil and the reason when it
-- cannot be created.
function M.open(dir, wall_time)
  wall_time = wall_time or M.wall_time()
  local path = ("%s/events.out.tfevents.%d.%s.%d.0"):format(dir, math.floor(wall_time),
                                                           hostname(), tonumber(ffi.C.getpid()))
  local f, err = jsonl.open(path, { append = true })
  if not f then return nil, ("%s: %s"):format(path, err) end
  -- The file_version event goes out with the first scalars: a full disk
  -- then fails the step like --log does (exit 1), not the start.
  return setmetatable({ f = f, path = path,
                        head = M.record(M.event(wall_time, 0, { file_version = "brain.Event:2" })) },
                      Writer)
end

-- A failed first write removes the file this writer made: no empty
-- events file is left behind.
function Writer:put(data)
  local ok, err = self.f:write((self.head or "") .. M.record(data))
  if not ok then
    if self.f.size == 0 then self.f:discard() end
    return nil, ("%s: %s"):format(self.path, err)
  end
  self.head = nil
  return true
end

-- scalars: { {tag, value}, ... } of one step, in one event.
function Writer:scalars(step, scalars, wall_time)
  return self:put(M.event(wall_time or M.wall_time(), step, { scalars = scalars }))
end

-- A run that continues (a resume, a restart) from `step` on: a SessionLog
-- START there, after which TensorBoard drops the earlier files' points at
-- that step and later (what torch's SummaryWriter(purge_step=) writes), so
-- the steps trained again are not shown twice.
function Writer:purge_from(step)
  return self:put(M.event(M.wall_time(), step, { session_start = true }))
end

-- A run without a step still leaves a valid events file (its header).
function Writer:close()
  if self.head and self.f:write(self.head) then self.head = nil end
  if self.head then self.f:discard() else self.f:close() end
end

return M
