-- data.lua — training data: token files (llm.c's format, uint16 or uint32
-- ids), plain text (byte-level: one token per byte, vocabulary 256) and
-- instruction data (JSON Lines or an instruction file: examples with
-- per-token loss weights), a held-out validation split, and deterministic
-- batches for a seed.
--
--   data/files.lua     reading files, token files v1/v2 (read and write)
--   data/instruct.lua  JSONL examples tokenised, the instruction file
--   data/stream.lua    batches from a token stream: random windows
--   data/packed.lua    batches from instruction data: pack or pad
--
-- Which is which: a name ending in .jsonl is JSON Lines; a name ending in
-- .bin or .tok, or a file whose first KiB holds a NUL byte (a header always
-- does), is a token file or an instruction file (by its magic); anything
-- else is text.
--
-- Errors are one line, "data: FILE: what is wrong; what to do" (a JSONL
-- line's: "data: FILE:LINE: what; fix").
local files = require("luazero.data.files")
local instruct = require("luazero.data.instruct")

local M = {}

M.MAGIC = files.MAGIC
M.INSTRUCT_MAGIC = files.INSTRUCT_MAGIC
M.VERSION = 1 -- what a token file of uint16 ids is; 2 holds uint32 ids
M.HEADER_INTS = files.HEADER_INTS
M.HEADER_BYTES = files.HEADER_BYTES

local fail = files.fail

function M.is_jsonl(path) return path:match("%.jsonl$") ~= nil end

-- Reads `path`. Returns a corpus: { tokens (a tensor in C memory), ids (a
-- uint16_t* or uint32_t* over it), count, max_id, kind = "tokens"|"text"|
-- "instruct", path, version (a token file's) }; instruction data adds
-- weights, starts, lines, docs (data/instruct.lua). opts for a .jsonl
-- (data/instruct.lua's tokenize_jsonl): tokenizer, template, max_len, chat_vars.
function M.load(path, opts)
  if type(path) ~= "string" then
    error(("data.load: path must be a file name (got %s)"):format(tostring(path)), 2)
  end
  if M.is_jsonl(path) then return instruct.tokenize_jsonl(path, opts) end
  local f, size = files.open(path)
  if size == 0 then
    f:close()
    fail(path, "file is empty; give a text file or a token file made by tools/prepare-data")
  end
  local head = f:read(M.HEADER_BYTES) or ""
  local kind = files.looks_like_token_file(path, head) and "tokens" or "text"
  f:seek("set", 0)
  local ok, c = pcall(function()
    if kind == "text" then
      local t, ids, max = files.read_text(path, f, size)
      return { tokens = t, ids = ids, max_id = max }
    end
    if size < M.HEADER_BYTES then
      fail(path, ("truncated: %d bytes, shorter than the %d-byte header of a token file; " ..
                  "re-create it with tools/prepare-data"):format(size, M.HEADER_BYTES))
    end
    if require("ffi").cast("const int32_t *", head)[0] == M.INSTRUCT_MAGIC then
      return instruct.read(path, f, size, head)
    end
    local t, ids, max, version, made_with = files.read_token_file(path, f, size, head)
    return { tokens = t, ids = ids, max_id = max, version = version, made_with = made_with }
  end)
  f:close()
  if not ok then error(c, 0) end
  c.path, c.kind, c.count = path, c.kind or kind, c.count or c.tokens:numel()
  return c
end

-- Frees a corpus's C memory.
function M.free(c)
  if c.kind == "instruct" then return instruct.free(c) end
  if c.tokens then c.tokens:free() end
  c.tokens, c.ids = nil, nil
end

-- Writes a token file (data/files.lua): version 1 (uint16 ids) unless an id
-- needs version 2 (uint32) or opts.version says. Returns the count and the
-- version.
M.write_token_file = files.write_token_file
M.fingerprint = files.fingerprint -- a checkpoint's record of which data it trained on
M.write_instruction_file = instruct.write

-- Batches (data/stream.lua, data/packed.lua): opts B, T, seed, vocab,
-- val_fraction, rank, world; instruction data also packing ("pack" or
-- "pad") and pad_id. loader:next_batch() returns tokens, targets and, for
-- instruction data, extra = { pos, seg }; loader:val_batch(i) the same;
-- loader:position() / loader:set_position(pos) for a checkpoint.
-- The options every loader takes, checked (each refusal names the option).
local function check_loader_opts(c, opts)
  local is_whole = require("luazero.config.values").is_whole
  local function whole(k, least)
    local v = opts[k]
    if not is_whole(v) or v < least then
      fail(c.path, ("the loader's %s must be a whole number >= %d (got %s)"):format(k, least,
                                                                                 tostring(v)))
    end
  end
  whole("B", 1); whole("T", 1); whole("vocab", 1)
  local rank, world = opts.rank or 0, opts.world or 1
  if not (is_whole(world) and world >= 1 and is_whole(rank) and rank >= 0 and rank < world) then
    fail(c.path, ("the loader's rank %s must be one of 0 .. world - 1 (world %s)")
                 :format(tostring(rank), tostring(world)))
  end
  local f = opts.val_fraction
  if f ~= nil and not (type(f) == "number" and f >= 0 and f <= 1) then
    fail(c.path, ("the loader's val_fraction must be in [0, 1] (got %s)"):format(tostring(f)))
  end
end

function M.loader(c, opts)
  if type(c) ~= "table" or not c.kind then
    error(("data.loader: c must be a corpus (data.load's); got %s"):format(tostring(c)), 2)
  end
  if type(opts) ~= "table" then
    error("data.loader: opts must be a table ({ B = , T = , vocab = , ... })", 2)
  end
  check_loader_opts(c, opts)
  if c.kind == "instruct" then return require("luazero.data.packed").loader(c, opts) end
  if opts.packing then
    fail(c.path, ("--packing %s applies to instruction data (a .jsonl or a file made by " ..
                  "tools/prepare-data --format jsonl), not a token stream; drop it")
         :format(opts.packing))
  end
  return require("luazero.data.stream").loader(c, opts)
end

-- Tokens to text for a byte vocabulary: each id below 256 its byte, others
-- "?". escape: control bytes other than newline and tab written \xNN, for a
-- terminal (a model of binary data would otherwise send it escape codes).
function M.decode_bytes(ids, escape)
  local chars = {}
  for i, id in ipairs(ids) do
    local c = string.char(id < 256 and id or 63)
    if escape and (id < 32 or id == 127) and id ~= 10 and id ~= 9 then
      c = ("\\x%02x"):format(id)
    end
    chars[i] = c
  end
  return table.concat(chars)
end

return M
