-- data.lua — training data: token files (llm.c's format) and plain text
-- (byte-level: one token per byte, vocabulary 256), a held-out validation
-- split, and deterministic batches for a seed.
--
-- Token file: a header of 256 int32 (little endian) — [0] magic 20240520,
-- [1] version 1, [2] token count — then that many uint16 tokens.
--
-- Which is which: a name ending in .bin or .tok is a token file; otherwise a
-- file whose first KiB holds a NUL byte is one (a header always does: its
-- version field is 01 00 00 00), and anything else is text.
--
-- Errors are one line, "data: FILE: what is wrong; what to do".
local ffi = require("ffi")
local lz = require("luazero")
local rng = require("luazero.rng")

local M = {}

M.MAGIC = 20240520
M.VERSION = 1
M.HEADER_INTS = 256
M.HEADER_BYTES = 256 * 4

local function fail(path, msg) error("data: " .. path .. ": " .. msg, 0) end

-- Files stream through in chunks of this size, so a large corpus never
-- passes through the Lua heap whole: its tokens go straight to C memory.
local CHUNK = 2 ^ 20

pcall(ffi.cdef, "int open(const char *path, int flags, int mode);")
pcall(ffi.cdef, "int64_t lseek(int fd, int64_t offset, int whence);")
pcall(ffi.cdef, "int close(int fd);")

-- A folder or a stream is refused before it is opened for reading (opening
-- a FIFO with no writer would wait for one).
local function check_kind(path)
  local d = io.open(path .. "/.", "rb")
  if d then
    d:close()
    fail(path, "is a folder; give a text file or a token file made by tools/prepare-data")
  end
  local O_NONBLOCK, SEEK_END = 2048, 2
  local fd = ffi.C.open(path, O_NONBLOCK, 0)
  if fd < 0 then return end -- io.open below says why
  local size = ffi.C.lseek(fd, 0, SEEK_END)
  ffi.C.close(fd)
  if size < 0 then
    fail(path, "is a pipe or a stream (a FIFO, <(...), /dev/stdin), which is not supported: " ..
         "the loader needs the size up front to hold out the last 10% for validation and " ..
         "draws windows at random positions; write it to a file first")
  end
end

local function open(path)
  check_kind(path)
  local f, err = io.open(path, "rb")
  if not f then
    if err and err:find("No such file", 1, true) then
      fail(path, "no such file; give a text file or a token file made by tools/prepare-data")
    end
    fail(path, "cannot open (" .. tostring(err) .. ")")
  end
  local size = f:seek("end")
  if not size or not f:seek("set", 0) then
    f:close()
    fail(path, "cannot seek in it; give a regular file")
  end
  return f, size
end

local function looks_like_token_file(path, head)
  if path:match("%.bin$") or path:match("%.tok$") then return true end
  return head:find("\0", 1, true) ~= nil
end

-- Tokens in C memory: a u16 tensor (category workspace), and the largest id.
local function tokens_from_file(path, f, size, head)
  if size < M.HEADER_BYTES then
    fail(path, ("truncated: %d bytes, shorter than the %d-byte header of a token file; " ..
                "re-create it with tools/prepare-data"):format(size, M.HEADER_BYTES))
  end
  local header = ffi.cast("const int32_t *", head)
  local magic, version, count = header[0], header[1], header[2]
  if magic ~= M.MAGIC then
    fail(path, ("header magic %d is not a token file (expected %d); give a token file " ..
                "made by tools/prepare-data, or a text file"):format(magic, M.MAGIC))
  end
  if version ~= M.VERSION then
    fail(path, ("token file version %d is not supported (expected %d)")
         :format(version, M.VERSION))
  end
  local have = size - M.HEADER_BYTES
  if count < 0 or count * 2 > have then
    fail(path, ("truncated: the header says %d tokens (%d bytes) but only %d bytes follow " ..
                "it; re-create it with tools/prepare-data"):format(count, count * 2, have))
  end
  if count * 2 < have then
    fail(path, ("the header says %d tokens (%d bytes) but %d bytes follow it (%s); a token " ..
                "file holds exactly its count: re-create it with tools/prepare-data")
         :format(count, count * 2, have, have % 2 == 1 and "an odd byte at the end" or
                 ("%d tokens more"):format((have - count * 2) / 2)))
  end
  if count == 0 then fail(path, "holds no tokens; give a file with some text in it") end
  local t = lz.tensor({ count }, "u16", "workspace")
  local dst, left = ffi.cast("char *", t.data), count * 2
  f:seek("set", M.HEADER_BYTES)
  while left > 0 do
    local chunk = f:read(math.min(CHUNK, left))
    if not chunk or #chunk == 0 then fail(path, "could not read the tokens (file changed?)") end
    ffi.copy(dst, chunk, #chunk)
    dst, left = dst + #chunk, left - #chunk
  end
  local p, max = ffi.cast("uint16_t *", t.data), 0
  for i = 0, count - 1 do if p[i] > max then max = p[i] end end
  return t, max
end

local function tokens_from_text(path, f, size)
  local t = lz.tensor({ size }, "u16", "workspace")
  local p, n, max = ffi.cast("uint16_t *", t.data), 0, 0
  while n < size do
    local chunk = f:read(math.min(CHUNK, size - n))
    if not chunk or #chunk == 0 then fail(path, "could not read it (file changed?)") end
    local src = ffi.cast("const uint8_t *", chunk)
    for i = 0, #chunk - 1 do
      local b = src[i]
      p[n + i] = b
      if b > max then max = b end
    end
    n = n + #chunk
  end
  return t, max
end

-- Reads `path` (token file or text). Returns { tokens = u16 tensor, count,
-- max_id, kind = "tokens"|"text", path }.
function M.load(path)
  local f, size = open(path)
  if size == 0 then
    f:close()
    fail(path, "file is empty; give a text file or a token file made by tools/prepare-data")
  end
  local head = f:read(M.HEADER_BYTES) or ""
  local kind = looks_like_token_file(path, head) and "tokens" or "text"
  f:seek("set", 0)
  local ok, t, max = pcall(kind == "tokens" and tokens_from_file or tokens_from_text, path, f,
                           size, head)
  f:close()
  if not ok then error(t, 0) end
  return { tokens = t, count = t:numel(), max_id = max, kind = kind, path = path }
end

-- Writes tokens as a token file: a Lua string of bytes (one token each) or a
-- list of ids, each 0..65535 (the file holds uint16). llm.c's header, then one
-- uint16 per token; written whole or not at all (io/atomic.lua). Returns the
-- token count.
function M.write_token_file(path, tokens)
  local n = #tokens
  local header = ffi.new("int32_t[256]")
  header[0], header[1], header[2] = M.MAGIC, M.VERSION, n
  local body = ffi.new("uint16_t[?]", math.max(n, 1))
  if type(tokens) == "string" then
    local src = ffi.cast("const uint8_t *", tokens)
    for i = 0, n - 1 do body[i] = src[i] end
  else
    for i = 1, n do
      local id = tokens[i]
      if id < 0 or id > 65535 then
        error(("%s: token id %d does not fit a token file's uint16 (0..65535)"):format(path, id), 0)
      end
      body[i - 1] = id
    end
  end
  require("luazero.io.atomic").build_file(path, M.HEADER_BYTES + n * 2, function(w)
    w:write(header, M.HEADER_BYTES)
    w:write(body, n * 2)
  end)
  return n
end

--------------------------------------------------------------- batches

local Loader = {}
Loader.__index = Loader

-- data: from M.load. opts: B, T, seed, vocab (the model's: every id must be
-- below it), val_fraction (0.1), rank and world (default 0 and 1): each batch
-- draws world * B windows, the same on every rank, and rank r takes windows
-- r*B+1 .. (r+1)*B, so the global batch does not depend on the world size. The last val_fraction of the tokens is held
-- out; training windows start at random positions of the rest.
function M.loader(data, opts)
  local B, T = opts.B, opts.T
  local path = data.path
  if data.max_id >= opts.vocab then
    fail(path, ("token id %d is not below the model's vocabulary %d; use --vocab %d or " ..
                "larger"):format(data.max_id, opts.vocab, data.max_id + 1))
  end
  local n = data.count
  local n_val = math.floor(n * (opts.val_fraction or 0.1))
  local n_train = n - n_val
  -- Each window needs T + 1 tokens: T inputs and the T targets shifted by one.
  if n_train < T + 1 then
    fail(path, ("%d tokens: too few for sequences of %d (need at least %d for training); " ..
                "use a longer text or a smaller --seq-len"):format(n, T,
                math.ceil((T + 1) / (1 - (opts.val_fraction or 0.1)))))
  end
  local self = setmetatable({
    data = data, B = B, T = T, n_train = n_train, n_val = n_val,
    ids = ffi.cast("uint16_t *", data.tokens.data),
    rng = rng.new(opts.seed or 0, 2),
    rank = opts.rank or 0, world = opts.world or 1,
    inputs = lz.tensor({ B, T }, "i32", "workspace"),
    targets = lz.tensor({ B, T }, "i32", "workspace"),
  }, Loader)
  -- Validation windows: consecutive, non-overlapping, from the held-out part.
  self.val_batches = math.floor(math.max(n_val - 1, 0) / (B * T))
  return self
end

local function fill(self, starts)
  local ids, T = self.ids, self.T
  local x = ffi.cast("int32_t *", self.inputs.data)
  local y = ffi.cast("int32_t *", self.targets.data)
  for b = 0, self.B - 1 do
    local s = starts[b + 1]
    for t = 0, T - 1 do
      x[b * T + t] = ids[s + t]
      y[b * T + t] = ids[s + t + 1]
    end
  end
  return self.inputs, self.targets
end

-- The next training batch: inputs, targets (i32 [B, T], reused each call).
function Loader:next_batch()
  local starts, span = {}, self.n_train - self.T
  local first = self.rank * self.B
  for i = 0, self.world * self.B - 1 do
    local s = self.rng:int(span)
    if i >= first and i < first + self.B then starts[i - first + 1] = s end
  end
  return fill(self, starts)
end

-- Validation batch i (1-based, i <= val_batches).
function Loader:val_batch(i)
  local starts, base = {}, self.n_train + (i - 1) * self.B * self.T
  for b = 1, self.B do starts[b] = base + (b - 1) * self.T end
  return fill(self, starts)
end

function Loader:free()
  self.inputs:free()
  self.targets:free()
end

-- Tokens to text for a byte vocabulary: printable bytes as they are.
function M.decode_bytes(ids)
  local chars = {}
  for i, id in ipairs(ids) do chars[i] = string.char(id < 256 and id or 63) end
  return table.concat(chars)
end

return M
