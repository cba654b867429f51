-- data/files.lua — reading the files training data comes in: token files
-- (llm.c's format, versions 1 and 2), instruction files and plain text,
-- streamed through in chunks straight into C memory; and writing token files.
--
-- Token file: a header of 256 int32 (little endian) — [0] magic 20240520,
-- [1] version, [2] token count — then that many tokens: uint16 in version 1,
-- uint32 in version 2 (llm.c's layout for vocabularies over 65536).
-- Instruction file (data/instruct.lua): magic 20240521, see docs/formats.md.
--
-- Errors are one line, "data: FILE: what is wrong; what to do".
local oneline = require("luazero.io.oneline")
local ffi = require("ffi")
local lz = require("luazero")

local M = {}

M.MAGIC = 20240520
M.INSTRUCT_MAGIC = 20240521
M.VERSIONS = { [1] = 2, [2] = 4 } -- token file version -> bytes per token
M.HEADER_INTS = 256
M.HEADER_BYTES = 256 * 4
M.UINT16_IDS = 65536

local function fail(path, msg) error(oneline.of("data: " .. path .. ": " .. msg), 0) end
M.fail = fail

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

-- The file opened for reading, and its size.
function M.open(path)
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

-- A data file's identity, for a checkpoint's data position: its size and
-- the xxh64 of all of it when it holds at most WHOLE bytes, else of its
-- first BLOCK and of SAMPLES blocks spread evenly to its end (a resume
-- reads a long corpus in a moment, and an edit anywhere but between the
-- samples is seen). "<size>:<hex>".
local WHOLE, BLOCK, SAMPLES = 2 ^ 26, 2 ^ 16, 64
function M.fingerprint(path)
  local f, size = M.open(path)
  local h = lz.hasher(0)
  local ok, err = pcall(function()
    local function take(at, n)
      f:seek("set", at)
      local bytes = f:read(n) or ""
      h:update(bytes, #bytes)
    end
    if size <= WHOLE then
      for at = 0, size - 1, CHUNK do take(at, CHUNK) end
    else
      take(0, BLOCK)
      for i = 1, SAMPLES do take(math.floor((size - BLOCK) * i / SAMPLES), BLOCK) end
    end
  end)
  f:close()
  local sum = ok and require("bit").tohex(h:digest(), 16)
  h:free()
  if not ok then error(err, 0) end
  return ("%d:%s"):format(size, sum)
end

-- Refuses a validation batch index i outside 1 .. n (a loader's
-- val_batches), which would read past the held-out part.
function M.check_val_batch(i, n)
  if not require("luazero.config.values").is_whole(i) or i < 1 or i > n then
    error(("data: validation batch %s is not one of 1 .. %d (loader.val_batches)")
          :format(tostring(i), n), 3)
  end
end

-- Refuses a loader position that is not what loader:position() returns:
-- a table whose rng_state is a hex string (a checkpoint's extra.data).
function M.check_position(pos)
  if type(pos) ~= "table" or type(pos.rng_state) ~= "string" or
     not pos.rng_state:match("^%x+$") or #pos.rng_state > 16 then
    error(("data: set_position takes what loader:position() returned (a table with its " ..
           "rng_state, a hex string), not %s"):format(type(pos) == "table"
             and "a table with rng_state " .. tostring(pos.rng_state) or
             type(pos) .. " " .. tostring(pos)), 3)
  end
end

-- Refuses data whose largest id `max_id` the model's vocabulary `vocab`
-- cannot embed, suggesting the --vocab that can (or, past what --vocab
-- takes, naming the file as not this tokenizer's); `more`: a further fix.
-- fixed: the words naming weights that fix the vocabulary ("the weights in
-- DIR"), where no --vocab can help: the data's tokenizer is another.
-- The tokenizer a token file records (header int32 3: its vocabulary; 4
-- and 5: the xxh64 of its tokenizer.json, low and high words; a byte-level
-- file: 256 and 0, 0). Files without it (llm.c's, older ones) hold zeros.
M.BYTE_LEVEL = { vocab = 256, lo = 0, hi = 0 }

-- A tokenizer's record: its vocabulary and its tokenizer.json's xxh64 words
-- (path: the file, or a Hugging Face folder holding it).
function M.tokenizer_record(path, vocab)
  local json = require("luazero.io.fs").is_dir(path) and path .. "/tokenizer.json" or path
  local bytes = assert(lz.read_file(json), json)
  local h = lz.xxh64(bytes, #bytes)
  return { vocab = vocab, lo = tonumber(h % 4294967296ULL), hi = tonumber(h / 4294967296ULL) }
end

-- The record in header words at .. at + 2 (nil when none is there), and
-- put there (a token file's at 3, an instruction file's at 4).
function M.made_with_at(header, at)
  if header[at] <= 0 then return nil end
  return { vocab = header[at], lo = tonumber(ffi.cast("uint32_t", header[at + 1])),
           hi = tonumber(ffi.cast("uint32_t", header[at + 2])) }
end
function M.put_made_with(header, at, made)
  if not made then return end
  header[at] = made.vocab
  header[at + 1] = ffi.cast("int32_t", ffi.cast("uint32_t", made.lo))
  header[at + 2] = ffi.cast("int32_t", ffi.cast("uint32_t", made.hi))
end

-- Whether two records name the same tokenizer.
function M.same_tokenizer(a, b)
  return a.vocab == b.vocab and a.lo == b.lo and a.hi == b.hi
end

function M.check_vocab(path, max_id, vocab, more, fixed, made_with)
  if max_id < vocab then return end
  -- (the tokenizer the file records says the vocabulary to give)
  if made_with and made_with.vocab > max_id and not fixed then
    fail(path, ("token id %d is not below the model's vocabulary %d; the file was made with a " ..
                "tokenizer of %d tokens: use --vocab %d or larger%s")
               :format(max_id, vocab, made_with.vocab, made_with.vocab, more or ""))
  end
  if fixed then
    fail(path, ("token id %d is not below the model's vocabulary %d (fixed by %s): the data was " ..
                "made with another tokenizer; prepare it with the model's"):format(max_id, vocab,
                                                                                   fixed))
  end
  if max_id + 1 > require("luazero.args").INT_MAX then
    fail(path, ("token id %d is larger than any vocabulary (--vocab takes at most %d): the file " ..
                "is damaged or not made with a tokenizer; re-create it with tools/prepare-data")
               :format(max_id, require("luazero.args").INT_MAX))
  end
  fail(path, ("token id %d is not below the model's vocabulary %d; use --vocab %d or larger%s")
             :format(max_id, vocab, max_id + 1, more or ""))
end

function M.looks_like_token_file(path, head)
  if path:match("%.bin$") or path:match("%.tok$") then return true end
  return head:find("\0", 1, true) ~= nil
end

-- A C buffer of n bytes on the ledger (workspace): an i32 tensor, since the
-- library's dtypes hold no 8-bit type; its bytes are read through a cast.
function M.bytes_tensor(n)
  return lz.tensor({ math.max(1, math.ceil(n / 4)) }, "i32", "workspace")
end

-- Reads n bytes from f (at its position) into the C memory at dst.
function M.read_into(path, f, dst, n)
  dst = ffi.cast("char *", dst)
  while n > 0 do
    local chunk = f:read(math.min(CHUNK, n))
    if not chunk or #chunk == 0 then fail(path, "could not read it whole (file changed?)") end
    ffi.copy(dst, chunk, #chunk)
    dst, n = dst + #chunk, n - #chunk
  end
end

-- The largest of n ids at p.
function M.max_id(p, n)
  local max = 0
  for i = 0, n - 1 do if p[i] > max then max = p[i] end end
  return tonumber(max)
end

-- Tokens of a token file in C memory: version 1 as a u16 tensor, version 2
-- as uint32 ids held in an i32 tensor (4 bytes each; read them through
-- `ids`). Returns tensor, ids (a uint16_t* or uint32_t*), max id, version.
function M.read_token_file(path, f, size, head)
  local header = ffi.cast("const int32_t *", head)
  local magic, version, count = header[0], header[1], header[2]
  if magic ~= M.MAGIC then
    fail(path, ("header magic %d is not a token file (expected %d); give a token file " ..
                "made by tools/prepare-data, or a text file"):format(magic, M.MAGIC))
  end
  local width = M.VERSIONS[version]
  if not width then
    fail(path, ("token file version %d is not supported (this luazero reads versions 1 and " ..
                "2: uint16 and uint32 ids); re-create it with tools/prepare-data")
         :format(version))
  end
  local have = size - M.HEADER_BYTES
  if count < 0 or count * width > have then
    fail(path, ("truncated: the header says %d tokens (%d bytes) but only %d bytes follow " ..
                "it; re-create it with tools/prepare-data"):format(count, count * width, have))
  end
  if count * width < have then
    local extra = have - count * width
    fail(path, ("the header says %d tokens (%d bytes) but %d bytes follow it (%s); a token " ..
                "file holds exactly its count: re-create it with tools/prepare-data")
         :format(count, count * width, have,
                 extra % width == 0 and ("%d tokens more"):format(extra / width) or
                 width == 2 and "an odd byte at the end" or
                 ("%d bytes more, not whole %d-byte tokens"):format(extra, width)))
  end
  if count == 0 then fail(path, "holds no tokens; give a file with some text in it") end
  local t = lz.tensor({ count }, width == 2 and "u16" or "i32", "workspace")
  f:seek("set", M.HEADER_BYTES)
  M.read_into(path, f, t.data, count * width)
  local ids = ffi.cast(width == 2 and "uint16_t *" or "uint32_t *", t.data)
  return t, ids, M.max_id(ids, count), version, M.made_with_at(header, 3)
end

-- Plain text: one token per byte (vocabulary 256), as a u16 tensor.
function M.read_text(path, f, size)
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
  return t, p, max
end

-- The version a list of ids needs: 2 when one is over 65535, else 1.
function M.version_for(tokens)
  if type(tokens) == "string" then return 1 end
  for i = 1, #tokens do
    if tokens[i] >= M.UINT16_IDS then return 2 end
  end
  return 1
end

-- Appends tokens to writer w (io/atomic.lua) as `width`-byte ids: a Lua
-- string of bytes (one token each) or a list of ids. Returns their count.
local function put_tokens(path, w, tokens, version, width)
  local n, top = #tokens, width == 2 and 65535 or 4294967295
  if n == 0 then return 0 end
  local body = ffi.new(width == 2 and "uint16_t[?]" or "uint32_t[?]", n)
  if type(tokens) == "string" then
    local src = ffi.cast("const uint8_t *", tokens)
    for i = 0, n - 1 do body[i] = src[i] end
  else
    for i = 1, n do
      local id = tokens[i]
      if id < 0 or id > top then
        error(("%s: token id %d does not fit a version %d token file (0..%d)")
              :format(path, id, version, top), 0)
      end
      body[i - 1] = id
    end
  end
  w:write(body, n * width)
  return n
end

-- A token file written piece by piece, whole or not at all (io/atomic.lua):
--   local tw = files.token_writer(path, version, made_with)
--   tw:add(ids); tw:add(more_ids); tw:finish()   -- or tw:abort()
-- version 1 (uint16 ids) or 2 (uint32); made_with: the tokenizer's record.
-- finish writes the header's count and returns it.
function M.token_writer(path, version, made_with)
  local width = M.VERSIONS[version]
  if not width then
    error(("%s: token file version %s is not one of 1, 2"):format(path, tostring(version)), 0)
  end
  local header = ffi.new("int32_t[256]")
  header[0], header[1] = M.MAGIC, version
  M.put_made_with(header, 3, made_with)
  local w = require("luazero.io.atomic").open(path)
  w:write(header, M.HEADER_BYTES)
  local tw, n = {}, 0
  function tw.add(_, tokens)
    local ok, k = pcall(put_tokens, path, w, tokens, version, width)
    if not ok then w:abort(); error(k, 0) end
    n = n + k
  end
  function tw.finish()
    header[2] = n
    w:pwrite(header, M.HEADER_BYTES, 0)
    w:commit()
    return n
  end
  function tw.abort() w:abort() end
  function tw.count() return n end
  return tw
end

-- Writes tokens as a token file: a Lua string of bytes (one token each) or a
-- list of ids. opts.version: 1 (uint16 ids, 0..65535), 2 (uint32 ids), or
-- nil: 2 when an id needs it, else 1; opts.made_with: the tokenizer's record
-- (tokenizer_record; BYTE_LEVEL), kept in the header. llm.c's header, then
-- the ids; written whole or not at all (io/atomic.lua). Returns the token
-- count and version.
function M.write_token_file(path, tokens, opts)
  local version = opts and opts.version or M.version_for(tokens)
  local tw = M.token_writer(path, version, opts and opts.made_with)
  tw:add(tokens)
  return tw:finish(), version
end

return M
