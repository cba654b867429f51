-- tools/prepare_data.lua — turns text into a token file (llm.c's format, one
-- uint16 per token): byte level (one token per byte, vocabulary 256), or with
-- --tokenizer a Hugging Face tokenizer.json byte-level BPE. Run by
-- tools/prepare-data.
--   luazero tools/prepare_data.lua [--tokenizer tokenizer.json] INPUT... OUTPUT.bin
-- Several inputs are concatenated in order.
local data = require("luazero.data")
local atomic = require("luazero.io.atomic")

local UINT16_TOKENS = 65536

local function fail(msg)
  io.stderr:write("prepare-data: ", msg, "\n")
  os.exit(2)
end

local args, tokenizer_path = {}, nil
do
  local i = 1
  while i <= #arg do
    local a = arg[i]
    if a == "--tokenizer" then
      tokenizer_path = arg[i + 1]
      if not tokenizer_path then fail("--tokenizer needs a file: --tokenizer tokenizer.json") end
      i = i + 2
    elseif a:match("^%-%-tokenizer=") then
      tokenizer_path = a:sub(#"--tokenizer=" + 1)
      i = i + 1
    elseif a == "--help" then
      args = { "--help" }
      break
    else
      args[#args + 1] = a
      i = i + 1
    end
  end
end

if #args < 2 or args[1] == "--help" then
  print("usage: tools/prepare-data [--tokenizer tokenizer.json] INPUT.txt... OUTPUT.bin\n" ..
        "Writes a token file: 256 int32 header (magic 20240520, version 1, token count),\n" ..
        "then one uint16 token per byte of the inputs, or with --tokenizer the ids of a\n" ..
        "Hugging Face byte-level BPE tokenizer.json (vocabulary at most 65536).")
  os.exit(args[1] == "--help" and 0 or 2)
end

local tok
if tokenizer_path then
  local ok, t = pcall(require("luazero.tokenizer").load, tokenizer_path)
  if not ok then fail(tostring(t)) end
  tok = t
  if tok:vocab_size() > UINT16_TOKENS then
    fail(("%s: vocabulary of %d tokens is larger than a token file holds (uint16 ids: at " ..
          "most %d); use a tokenizer with a smaller vocabulary"):format(tokenizer_path,
          tok:vocab_size(), UINT16_TOKENS))
  end
end

for i = 1, #args - 1 do
  local ok, err = pcall(atomic.refuse_overlap, args[#args], "the output", args[i], "the input")
  if not ok then fail(err) end
end
if tokenizer_path then
  local ok, err = pcall(atomic.refuse_overlap, args[#args], "the output", tokenizer_path,
                        "--tokenizer")
  if not ok then fail(err) end
end

local parts = {}
for i = 1, #args - 1 do
  local f, err = io.open(args[i], "rb")
  if not f then fail(args[i] .. ": cannot read it (" .. tostring(err) .. ")") end
  parts[#parts + 1] = f:read("*a") or ""
  f:close()
end
local text = table.concat(parts)
if #text == 0 then fail("the inputs are empty; give a text file with something in it") end
local out = args[#args]
local tokens, what = text, "byte level, vocab 256"
if tok then
  local t0 = os.clock()
  tokens = tok:encode(text)
  what = ("%s, vocab %d, %.1f MB/s"):format(tokenizer_path, tok:vocab_size(),
                                           #text / 1e6 / math.max(os.clock() - t0, 1e-9))
end
if #tokens > 2 ^ 31 - 1 then fail("more than 2^31 tokens; split the input") end
local ok, n = pcall(data.write_token_file, out, tokens)
if not ok then fail(tostring(n)) end
print(("prepare-data: %s: %d tokens (%s)"):format(out, n, what))
