-- tests/ref/tokenize.lua — the luazero side of tests/ref/test_tokenizer.py:
-- encodes each INPUT with a tokenizer.json, writes its ids (one line,
-- space-separated) to INPUT.ids, each token's byte offset to INPUT.starts,
-- its decoding to INPUT.decoded (and without special tokens to
-- INPUT.decoded_skip), and prints one JSON line per input:
-- { "input", "bytes", "tokens", "seconds", "bos_id", "eos_id" }.
--   luazero tests/ref/tokenize.lua TOKENIZER.json INPUT...
local cjson = require("cjson")
local tokenizer = require("luazero.tokenizer")

local function clock()
  local ffi = require("ffi")
  pcall(ffi.cdef, "typedef struct { long tv_sec; long tv_nsec; } lz_ref_timespec;" ..
                  "int clock_gettime(int clk, lz_ref_timespec *ts);")
  local ts = ffi.new("lz_ref_timespec")
  return function()
    ffi.C.clock_gettime(1, ts) -- CLOCK_MONOTONIC
    return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
  end
end
local now = clock()

local function write(path, s)
  local f = assert(io.open(path, "wb"), "tokenize.lua: cannot write " .. path)
  f:write(s)
  f:close()
end

assert(#arg >= 2, "usage: luazero tests/ref/tokenize.lua TOKENIZER.json INPUT...")
local tok = tokenizer.load(arg[1])
for i = 2, #arg do
  local f = assert(io.open(arg[i], "rb"), "tokenize.lua: cannot read " .. arg[i])
  local text = f:read("*a")
  f:close()
  local t0 = now()
  local ids = tok:encode(text)
  local seconds = now() - t0
  local ids2, starts = tok:encode(text, { offsets = true })
  assert(#ids2 == #ids and #starts == #ids, "tokenize.lua: encode with offsets gave other ids")
  write(arg[i] .. ".ids", table.concat(ids, " "))
  write(arg[i] .. ".starts", table.concat(starts, " "))
  write(arg[i] .. ".decoded", tok:decode(ids))
  write(arg[i] .. ".decoded_skip", tok:decode(ids, { skip_special_tokens = true }))
  print(cjson.encode({ input = arg[i], bytes = #text, tokens = #ids, seconds = seconds,
                       bos_id = tok.bos_id or cjson.null, eos_id = tok.eos_id or cjson.null }))
end
