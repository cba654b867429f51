-- checkpoint/safetensors.lua — the safetensors format, read by ranges: a
-- file's header (8-byte little-endian length, then JSON: name -> dtype,
-- shape, data_offsets), checked against the file's size, and any range of
-- a tensor's elements read as fp32 (F32, BF16, F16) with pread, so a reader
-- holds only what it asked for. docs/formats.md.
--
--   local st = safetensors.open("model.safetensors")   -- errors name the file and tensor
--   local t = st.tensors["model.norm.weight"]          -- {dtype, shape, numel, begin, stop}
--   st:read(t, first, n, float_ptr)                    -- elements [first, first + n)
--   st:close()
local oneline = require("luazero.io.oneline")
local ffi = require("ffi")
local cjson = require("cjson")
-- What a refusal quotes of a header: JSON, but NaN and infinities (which a
-- damaged header may decode to) written as nan and inf instead of raising.
local quoted = cjson.new()
quoted.encode_invalid_numbers(true)

for _, decl in ipairs({ "int open(const char *path, int flags, int mode);",
                       "int64_t pread(int fd, void *buf, size_t n, int64_t offset);",
                       "int64_t lseek(int fd, int64_t offset, int whence);",
                       "int close(int fd);", "char *strerror(int errnum);" }) do
  pcall(ffi.cdef, decl) -- one at a time: another module may have declared some
end

local M = {}

M.DTYPES = { F32 = 4, BF16 = 2, F16 = 2 }
-- The format's other dtypes, by element size: a file may hold them (GPT-2's
-- causal-mask buffer in U8 or BOOL, a rotary inv_freq in I64) where they
-- are nothing a model reads; reading one is refused (File:read).
local OTHER_DTYPES = { F64 = 8, I64 = 8, U64 = 8, I32 = 4, U32 = 4, I16 = 2, U16 = 2, I8 = 1,
                       U8 = 1, BOOL = 1, F8_E4M3 = 1, F8_E5M2 = 1 }
-- A header longer than this is not one (the format's own limit is 100 MB).
local MAX_HEADER = 100000000
-- Elements converted per pread of a 2-byte dtype.
local STAGE = 2 ^ 20

local function fail(path, msg)
  error(oneline.of(("safetensors %s: %s"):format(path, msg)), 0)
end

local function why() return ffi.string(ffi.C.strerror(ffi.errno())) end

-- The fp32 bit pattern of every 16-bit pattern, for BF16 and F16: built on
-- first use. Bits, not numbers: a NaN read into a Lua number can carry a
-- payload the interpreter takes for another type ("cannot convert").
local lut = {}
local function table_of(dtype)
  if lut[dtype] then return lut[dtype] end
  local t = ffi.new("uint32_t[65536]")
  local f = ffi.new("float[1]")
  local fbits = ffi.cast("uint32_t *", f)
  for h = 0, 65535 do
    if dtype == "BF16" then
      t[h] = h * 65536
    else -- IEEE half: sign, 5-bit exponent (bias 15), 10-bit mantissa
      local sign = h >= 32768 and 0x80000000 or 0
      local e, m = math.floor(h / 1024) % 32, h % 1024
      if e == 31 then
        t[h] = sign + 0x7f800000 + m * 8192 -- inf, or NaN with its payload
      else
        f[0] = e == 0 and m * 2 ^ -24 or (1 + m / 1024) * 2 ^ (e - 15)
        t[h] = sign + fbits[0]
      end
    end
  end
  lut[dtype] = t
  return t
end

local File = {}
File.__index = File

local function shape_text(s) return "[" .. table.concat(s, ", ") .. "]" end
M.shape_text = shape_text

-- A JSON array as cjson decodes it: keys 1..#t only ({} and [] alike).
local function is_array(t)
  local n = 0
  for _ in pairs(t) do n = n + 1 end
  return n == #t
end

-- Valid UTF-8, as the format requires of the header.
local function valid_utf8(s) return require("luazero.tokenizer.sentencepiece").valid_utf8(s) end

-- Opens and checks a file: its header parses, every tensor has a known
-- dtype, a shape and data_offsets that agree, and lies inside the file.
function M.open(path)
  local fd = ffi.C.open(path, 524288, 0) -- O_RDONLY | O_CLOEXEC
  if fd < 0 then fail(path, ("cannot read it (%s)"):format(why())) end
  local self = setmetatable({ path = path, fd = fd, tensors = {}, names = {} }, File)
  local ok, err = pcall(function()
    self.size = tonumber(ffi.C.lseek(fd, 0, 2))
    if self.size < 8 then
      fail(path, ("%d bytes, shorter than the 8-byte header length: not a safetensors file")
                 :format(self.size))
    end
    local len = ffi.new("uint64_t[1]")
    if ffi.C.pread(fd, len, 8, 0) ~= 8 then
      fail(path, ("cannot read it (%s); give a .safetensors file"):format(why()))
    end
    local n = tonumber(len[0])
    if n > MAX_HEADER then
      fail(path, ("header length %.0f is over %d bytes: not a safetensors file"):format(n, MAX_HEADER))
    end
    if 8 + n > self.size then
      fail(path, ("header length %d runs past the end of the file (%d bytes): the file is " ..
                  "truncated; copy or export it again"):format(n, self.size))
    end
    local buf = ffi.new("char[?]", n)
    if ffi.C.pread(fd, buf, n, 8) ~= n then
      fail(path, ("cannot read its header (%s); give a .safetensors file"):format(why()))
    end
    local text = ffi.string(buf, n)
    if text:find("[\128-\255]") and not valid_utf8(text) then
      fail(path, "header is not UTF-8 text; the file is damaged or not safetensors")
    end
    -- cjson stops at a NUL and takes raw control characters; JSON has neither
    local at = text:find("[%z\1-\8\11\12\14-\31]")
    if at then
      fail(path, ("header byte %d is the control character %d, which JSON does not allow; the " ..
                  "file is damaged or not safetensors"):format(at - 1, text:byte(at)))
    end
    local jok, h = pcall(cjson.decode, text)
    if not jok or type(h) ~= "table" or not text:find("^%s*{") then
      fail(path, ("header is not a JSON object (%s); the file is damaged or not safetensors")
                 :format(jok and (type(h) == "table" and "an array" or type(h)) or tostring(h)))
    end
    self.start = 8 + n
    local meta = h.__metadata__
    if meta ~= nil and meta ~= cjson.null then
      local bad = type(meta) ~= "table"
      for k, v in pairs(type(meta) == "table" and meta or {}) do
        bad = bad or type(k) ~= "string" or type(v) ~= "string"
      end
      if bad then
        fail(path, ("__metadata__: %s is not an object of strings; the file is damaged or not " ..
                    "safetensors"):format(quoted.encode(meta)))
      end
    end
    self.metadata = type(meta) == "table" and meta or {}
    for name, e in pairs(h) do
      if name ~= "__metadata__" then self:add(name, e) end
    end
    table.sort(self.names)
    self:check_tiling()
  end)
  if not ok then
    ffi.C.close(fd)
    error(err, 0)
  end
  return self
end

function File:add(name, e)
  local path = self.path
  local function refuse(fmt, ...)
    fail(path, ("tensor %s: " .. fmt .. "; the file is damaged or not safetensors")
               :format(name, ...))
  end
  if type(e) ~= "table" then refuse("header entry %s is not an object", quoted.encode(e)) end
  local es = M.DTYPES[e.dtype] or OTHER_DTYPES[e.dtype]
  if not es then
    fail(path, ("tensor %s: dtype %s is not a safetensors dtype; the file is damaged or not " ..
                "safetensors"):format(name, quoted.encode(e.dtype == nil and cjson.null or e.dtype)))
  end
  if type(e.shape) ~= "table" or not is_array(e.shape) then
    refuse("shape %s is not a list", quoted.encode(e.shape == nil and cjson.null or e.shape))
  end
  -- As the format's own reader: every dimension, their product and its
  -- bytes fit in 64 bits.
  local numel = 1
  for _, d in ipairs(e.shape) do
    if type(d) ~= "number" or d < 0 or d ~= math.floor(d) or d >= 2 ^ 64 then
      refuse("shape %s is not a list of whole numbers from 0", quoted.encode(e.shape))
    end
    numel = numel * d
    if numel >= 2 ^ 64 then refuse("shape %s overflows 64 bits", quoted.encode(e.shape)) end
  end
  if numel * es >= 2 ^ 64 then
    refuse("shape %s of %s overflows 64 bits of bytes", quoted.encode(e.shape), e.dtype)
  end
  local o = e.data_offsets
  if type(o) ~= "table" or not is_array(o) or #o ~= 2 or type(o[1]) ~= "number" or
     type(o[2]) ~= "number" or o[2] < o[1] or o[1] ~= math.floor(o[1]) or
     o[2] ~= math.floor(o[2]) then
    refuse("data_offsets %s is not [begin, end] (whole numbers, begin <= end)",
           quoted.encode(o == nil and cjson.null or o))
  end
  if o[1] < 0 then
    refuse("data_offsets [%.0f, %.0f] begin before the data (offsets count from the end of the " ..
           "header, from 0)", o[1], o[2])
  end
  if o[2] - o[1] ~= numel * es then
    refuse("data_offsets span %.0f bytes, but shape %s of %s needs %.0f", o[2] - o[1],
           shape_text(e.shape), e.dtype, numel * es)
  end
  if self.start + o[2] > self.size then
    fail(path, ("tensor %s: ends at byte %.0f, but the file has %d bytes: the file is " ..
                "truncated; copy or export it again"):format(name, self.start + o[2], self.size))
  end
  self.tensors[name] = { name = name, dtype = e.dtype, esize = es, shape = e.shape,
                         numel = numel, begin = self.start + o[1], stop = self.start + o[2] }
  self.names[#self.names + 1] = name
end

-- The format's rule: sorted by offset, the tensors fill the data region
-- exactly: no gap, no overlap, nothing after the last.
function File:check_tiling()
  local list = {}
  for _, n in ipairs(self.names) do list[#list + 1] = self.tensors[n] end
  table.sort(list, function(a, b)
    if a.begin ~= b.begin then return a.begin < b.begin end
    if a.stop ~= b.stop then return a.stop < b.stop end
    return a.name < b.name
  end)
  local pos, prev = self.start, nil
  local function span(t) return ("[%d, %d]"):format(t.begin - self.start, t.stop - self.start) end
  for _, t in ipairs(list) do
    if t.begin > pos then
      fail(self.path, ("tensor %s: data_offsets %s begin %d bytes after %s: a gap (the " ..
                       "tensors must fill the data with no gap); the file is damaged or not " ..
                       "safetensors"):format(t.name, span(t), t.begin - pos,
                       prev and ("tensor " .. prev.name .. " ends") or "the data starts"))
    elseif t.begin < pos then
      fail(self.path, ("tensor %s: data_offsets %s overlap tensor %s's %s (each byte of the " ..
                       "data belongs to one tensor); the file is damaged or not safetensors")
                      :format(t.name, span(t), prev.name, span(prev)))
    end
    pos, prev = t.stop, t
  end
  if pos ~= self.size then
    fail(self.path, ("%d bytes after the last tensor (%s), which belong to none; the file is " ..
                     "damaged or not safetensors"):format(self.size - pos,
                     prev and prev.name or "there are none"))
  end
end

local function pread_all(self, buf, bytes, at, what)
  local done = 0
  while done < bytes do
    local r = tonumber(ffi.C.pread(self.fd, ffi.cast("char *", buf) + done, bytes - done, at + done))
    if r <= 0 then
      fail(self.path, ("reading tensor %s at byte %d failed (%s)"):format(what, at + done,
                       r < 0 and why() or "end of file: the file shrank while read"))
    end
    done = done + r
  end
end

-- Elements [first, first + n) of tensor t, as fp32, into dst (float *).
function File:read(t, first, n, dst)
  if not M.DTYPES[t.dtype] then
    fail(self.path, ("tensor %s: dtype %s is not one luazero reads; convert the file to F32, " ..
                     "BF16 or F16"):format(t.name, quoted.encode(t.dtype)))
  end
  if n <= 0 then return end
  assert(first >= 0 and first + n <= t.numel, "safetensors: read past the tensor")
  local at = t.begin + first * t.esize
  if t.dtype == "F32" then
    pread_all(self, dst, n * 4, at, t.name)
    return
  end
  local conv = table_of(t.dtype)
  local bits = ffi.cast("uint32_t *", dst)
  self.stage = self.stage or ffi.new("uint16_t[?]", STAGE)
  local src, done = self.stage, 0
  while done < n do
    local k = math.min(STAGE, n - done)
    pread_all(self, src, k * 2, at + done * 2, t.name)
    for i = 0, k - 1 do bits[done + i] = conv[src[i]] end
    done = done + k
  end
end

function File:close()
  if self.fd >= 0 then ffi.C.close(self.fd) end
  self.fd = -1
end

-- A header for tensors {name, dtype, shape, bytes} laid out in that order:
-- the bytes to write first (length, JSON padded with spaces to 8), and each
-- tensor's data offset after it.
function M.header(list, metadata)
  local h, offset = { __metadata__ = metadata }, 0
  for _, e in ipairs(list) do
    h[e.name] = { dtype = e.dtype, shape = e.shape, data_offsets = { offset, offset + e.bytes } }
    e.data_offset = offset
    offset = offset + e.bytes
  end
  local text = cjson.encode(h)
  text = text .. (" "):rep((8 - #text % 8) % 8)
  local len = ffi.new("uint64_t[1]", #text)
  return ffi.string(len, 8) .. text, offset
end

return M
