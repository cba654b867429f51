-- tools/prepare_data.lua — turns text into a token file (llm.c's format):
-- byte level (one token per byte, vocabulary 256), or with --tokenizer a
-- Hugging Face tokenizer; uint16 ids (version 1) unless the vocabulary needs
-- uint32 (version 2: an id over 65535, or a vocabulary over 65536). With
-- --format jsonl, JSON Lines of instruction examples into an instruction
-- file (docs/formats.md). Run by tools/prepare-data.
--   luazero tools/prepare_data.lua [--tokenizer T] INPUT... OUTPUT.bin
--   luazero tools/prepare_data.lua --format jsonl [--tokenizer T] [--seq-len N]
--                                  [--chat-kwargs JSON] IN.jsonl OUT.bin
-- Several text inputs: each tokenised on its own, their ids in order.
local data = require("luazero.data")
local instruct = require("luazero.data.instruct")
local paths = require("luazero.io.paths")
local fs = require("luazero.io.fs")

local UINT16_TOKENS = 65536

-- Exit status 2 for bad input, 1 when writing the output failed (a full
-- disk), as docs/training.md's table says.
local function fail(msg)
  io.stderr:write("prepare-data: ", msg, "\n")
  os.exit(require("luazero.io.atomic").write_failed and 1 or 2)
end

local USAGE = [[
usage: tools/prepare-data [--tokenizer TOKENIZER] INPUT.txt... OUTPUT.bin
       tools/prepare-data --format jsonl [--tokenizer TOKENIZER] [--seq-len N] [--chat-kwargs JSON]
                          IN.jsonl OUTPUT.bin
Text: writes a token file: 256 int32 header (magic 20240520, version, token count),
then one token per byte of the inputs, or with --tokenizer the ids of a Hugging Face
tokenizer (a tokenizer.json, or a folder holding one): uint16 ids (version 1), or
uint32 (version 2) when the vocabulary is over 65536.
--format jsonl (the default for a .jsonl input): lines {"prompt": ..., "completion": ...}
or {"messages": [{"role": ..., "content": ...}, ...]} (rendered with the chat template
of the --tokenizer folder's tokenizer_config.json) into an instruction file: the ids,
a loss weight per token (1 on completions and assistant turns) and where each example
starts. --seq-len N refuses examples longer than N tokens now rather than at training.
--chat-kwargs JSON: more variables of the chat template, a JSON object as
apply_chat_template's keyword arguments (e.g. '{"enable_thinking": false}').]]

local args, opt = {}, {}
do
  local takes = { ["--tokenizer"] = "tokenizer", ["--format"] = "format", ["--seq-len"] = "seq_len",
                  ["--chat-kwargs"] = "chat_kwargs" }
  local i = 1
  while i <= #arg do
    local a = arg[i]
    local name, value = a:match("^(%-%-[%w-]+)=(.*)$")
    if takes[name or a] then
      local key = takes[name or a]
      if not name then
        value = arg[i + 1]
        i = i + 1
      end
      if not value then fail(("%s needs a value; see --help"):format(a)) end
      if opt[key] then fail(("%s given twice; give it once"):format(name or a)) end
      opt[key] = value
      i = i + 1
    elseif a == "--help" or a == "-h" then
      print(USAGE)
      os.exit(0)
    elseif a:sub(1, 2) == "--" then
      fail(("unknown flag %s (--help lists the flags)"):format(name or a))
    else
      args[#args + 1] = a
      i = i + 1
    end
  end
end

if #args < 2 then
  io.stderr:write(("prepare-data: %s; give the input file(s), then the OUTPUT.bin to write\n")
                  :format(#args == 0 and "no files given" or
                          ("one file given (%s)"):format(args[1])))
  io.stderr:write(USAGE, "\n")
  os.exit(2)
end
for i = 1, #args - 1 do
  if fs.is_dir(args[i]) then
    fail(("%s is a folder; give the text file(s) in it"):format(args[i]))
  end
end
local out = args[#args]
local format = opt.format or (#args == 2 and data.is_jsonl(args[1]) and "jsonl") or "text"
if format ~= "text" and format ~= "jsonl" then
  fail(("--format must be text or jsonl (got %s)"):format(format))
end
local seq_len = opt.seq_len and tonumber(opt.seq_len)
if opt.seq_len and not (seq_len and seq_len >= 2 and seq_len % 1 == 0) then
  fail(("--seq-len must be a whole number >= 2 (got %s)"):format(opt.seq_len))
end
if seq_len and format ~= "jsonl" then
  fail("--seq-len applies to --format jsonl (examples longer than it are refused); drop it")
end
if not opt.format and #args > 2 then
  for i = 1, #args - 1 do
    if data.is_jsonl(args[i]) then
      fail(("%s is JSON Lines (instruction data), read as such only alone: give one .jsonl " ..
            "input (concatenate them first), or --format text to take the files as plain text")
           :format(args[i]))
    end
  end
end
if format == "jsonl" and #args ~= 2 then
  fail(("--format jsonl takes one input and the output (got %d inputs); concatenate the " ..
        ".jsonl files first"):format(#args - 1))
end

-- Every file it touches (io/paths.lua): the output must not be an input.
local touches = paths.new()
for i = 1, #args - 1 do touches:read("the input", args[i]) end
touches:read("--tokenizer", opt.tokenizer, { whole = opt.tokenizer and fs.is_dir(opt.tokenizer) })
touches:write("the output", out)
local checked_ok, overlap = pcall(touches.check, touches)
if not checked_ok then fail(overlap) end
-- "token" or "instruction" where the first bytes `head` are those files'
-- header (made by this tool), else nil.
local function data_kind(head)
  local magic = #head >= 4 and require("ffi").cast("const int32_t *", head)[0]
  return magic == data.MAGIC and "token" or magic == data.INSTRUCT_MAGIC and "instruction" or nil
end
-- An output that is there already is replaced only when it is data this
-- tool made (a forgotten OUTPUT would make the last input the output).
do
  local f = fs.kind(out, true) == "file" and io.open(out, "rb")
  local head = f and f:read(4)
  if f then f:close() end
  if head and not data_kind(head) then
    fail(("%s is there and is not a token or instruction file, so writing the output would " ..
          "destroy it: give the OUTPUT.bin to write after the inputs, a new name, or remove it " ..
          "first"):format(out))
  end
end

local tok, template
if opt.tokenizer then
  local ok, t, ct = pcall(instruct.open_tokenizer, opt.tokenizer)
  if not ok then fail(tostring(t)) end
  tok, template = t, ct
end
local function vocab_of(t)
  if type(t.vocab_size) == "function" then return t:vocab_size() end
  return t.vocab_size
end

-- (either file's header records the tokenizer: train.lua refuses it with another)
local files = require("luazero.data.files")
local made_with = tok and files.tokenizer_record(opt.tokenizer, vocab_of(tok)) or files.BYTE_LEVEL

if format == "jsonl" then
  local t0 = os.clock()
  local vok, vars = pcall(function()
    return opt.chat_kwargs and require("luazero.chat_template").kwargs(opt.chat_kwargs,
                                                                       "--chat-kwargs")
  end)
  if not vok then fail(tostring(vars)) end
  -- (JSON Lines whatever the file's name: --format says so)
  local ok, c = pcall(instruct.tokenize_jsonl, args[1], { tokenizer = tok, template = template,
                                                        max_len = seq_len, chat_vars = vars or nil })
  if not ok then fail(tostring(c)) end
  local wok, err = pcall(data.write_instruction_file, out, c, made_with)
  if not wok then fail(tostring(err)) end
  local trained = 0
  for i = 0, c.count - 1 do trained = trained + c.w[i] end
  print(("prepare-data: %s: %d examples, %d tokens, %d trained (%s, %.1f s)")
        :format(out, c.docs, c.count, trained, tok and ("%s, vocab %d"):format(opt.tokenizer,
                vocab_of(tok)) or "byte level, vocab 256", os.clock() - t0))
  data.free(c)
  os.exit(0)
end

-- Text: each input tokenised on its own and its ids written after the
-- previous input's (no token spans two files), the whole file or nothing.
-- An input is read by blocks and encoded by pieces (tokenizer/stream.lua:
-- the ids of encoding it whole), so a corpus larger than memory fits.
local version = tok and vocab_of(tok) > UINT16_TOKENS and 2 or 1
local wok, tw = pcall(files.token_writer, out, version, made_with)
if not wok then fail(tostring(tw)) end
local function refuse(msg)
  tw:abort()
  fail(msg)
end
local stream = require("luazero.tokenizer.stream")
local BLOCK = 2 ^ 20
local piece_bytes = tonumber(os.getenv("LZ_PREPARE_PIECE_BYTES") or "") or stream.PIECE_BYTES

-- The bytes at the end of s that begin a character not yet whole.
local function open_char(s)
  for back = 1, math.min(3, #s) do
    local c = s:byte(#s - back + 1)
    if c < 0x80 then return 0 end
    if c >= 0xC0 then
      local len = c >= 0xF0 and 4 or c >= 0xE0 and 3 or 2
      return back < len and back or 0
    end
  end
  return 0
end

local function add(ids)
  if tw.count() + #ids > 2 ^ 31 - 1 then refuse("more than 2^31 tokens; split the input") end
  local ok, aerr = pcall(tw.add, tw, ids) -- (a failed add has removed the file)
  if not ok then fail(tostring(aerr)) end
end

local bytes, t0, shown = 0, os.clock(), os.time()
for i = 1, #args - 1 do
  local f, err = io.open(args[i], "rb")
  if not f then refuse(args[i] .. ": cannot read it (" .. tostring(err) .. ")") end
  local enc = tok and stream.encoder(tok, { piece_bytes = piece_bytes })
  local carry, at, lines = "", 0, 0 -- the file's bytes before carry, and their newlines
  local first_block = true
  while true do
    local block = f:read(BLOCK)
    if not block then break end
    if first_block then
      first_block = false
      -- A token or instruction file is data already: as text its header and
      -- ids would become byte tokens.
      local kind = data_kind(block)
      if kind then
        refuse(("%s is already a%s file (made by tools/prepare-data): train on it as it is " ..
                "(--data %s), or give the text it was made from"):format(args[i],
                kind == "token" and " token" or "n instruction", args[i]))
      end
    end
    bytes = bytes + #block
    if not tok then
      add(block)
    else
      -- A Hugging Face tokenizer reads text (Python's str): as in JSON Lines,
      -- bytes that are not UTF-8 are refused rather than passed on as bytes.
      local text = carry .. block
      local whole = #text - open_char(text)
      local chars = text:sub(1, whole) -- (whole characters; the rest waits for the next block)
      local bad = instruct.bad_utf8_at(chars)
      if bad then
        local line = lines + select(2, chars:sub(1, bad):gsub("\n", "")) + 1
        refuse(("%s:%d: byte %d (0x%02X) is not UTF-8, which --tokenizer reads; save the file " ..
                "as UTF-8"):format(args[i], line, at + bad, chars:byte(bad)))
      end
      lines = lines + select(2, chars:gsub("\n", ""))
      carry, at = text:sub(whole + 1), at + whole
      local ok, perr = pcall(enc.feed, enc, chars, add)
      if not ok then refuse(tostring(perr)) end
    end
    if os.time() - shown >= 10 then
      shown = os.time()
      io.stderr:write(("prepare-data: %s: %.0f MB read, %d tokens so far\n")
                      :format(args[i], bytes / 1e6, tw.count()))
    end
  end
  f:close()
  if tok then
    if #carry > 0 then
      refuse(("%s: the file ends inside a character (byte %d, 0x%02X, is not UTF-8, which " ..
              "--tokenizer reads); save the file as UTF-8"):format(args[i], at + 1, carry:byte(1)))
    end
    local ok, perr = pcall(enc.finish, enc, add)
    if not ok then refuse(tostring(perr)) end
  end
  collectgarbage()
end
if bytes == 0 then refuse("the inputs are empty; give a text file with something in it") end
local fok, n = pcall(tw.finish, tw)
if not fok then fail(tostring(n)) end
local what = tok and ("%s, vocab %d, %.1f MB/s"):format(opt.tokenizer, vocab_of(tok),
                       bytes / 1e6 / math.max(os.clock() - t0, 1e-9)) or "byte level, vocab 256"
print(("prepare-data: %s: %d tokens, version %d (%s ids; %s)"):format(out, n, version,
      version == 2 and "uint32" or "uint16", what))
