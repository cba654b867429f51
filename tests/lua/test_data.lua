-- test_data.lua — lua/luazero/data: token files v1 and v2 (round trip, the
-- version prepare-data picks, the refusals), instruction data from JSON
-- Lines (prompt/completion and messages: ids and weights token by token),
-- the instruction file, the pack and pad layouts position by position,
-- determinism across world sizes and a resumed position, every bad line's
-- message, and training through scripts/train.lua (a Llama-3 vocabulary
-- from a version 2 file; a .jsonl resumed bitwise).
local ffi = require("ffi")
local cjson = require("cjson")
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local data = require("luazero.data")
local instruct = require("luazero.data.instruct")

local T = {}
local q, eq, expect_error = support.quote, support.eq, support.expect_error
local write, tmp = support.scratch()

local function same(got, want, what)
  local a, b = cjson.encode(got), cjson.encode(want)
  assert(a == b, ("%s:\nexpected: %s\n     got: %s"):format(what or "", b, a))
end

local function list(p, n, first)
  local out = {}
  for i = first or 0, n - 1 do out[#out + 1] = tonumber(p[i]) end
  return out
end

local function tool(cmd)
  return support.sh(("cd %s && LUAZERO=%s %s"):format(q(lz.root), q(lz.executable()), cmd))
end

-- A byte-level BPE tokenizer.json over all 256 bytes (GPT-2's byte to
-- character map) with added tokens {content = id} and merges {"a b", ...}
-- (each merged token gets the next id from 300).
local function byte_tokenizer(name, added, merges)
  local vocab, n = {}, 0
  for b = 0, 255 do
    local printable = (b >= 33 and b <= 126) or (b >= 161 and b <= 172) or b >= 174
    local cp = printable and b or 256 + n
    if not printable then n = n + 1 end
    local ch = cp < 128 and string.char(cp) or
               string.char(0xC0 + math.floor(cp / 64), 0x80 + cp % 64)
    vocab[ch] = b
  end
  for i, m in ipairs(merges or {}) do vocab[m:gsub(" ", "")] = 299 + i end
  local add = {}
  for content, id in pairs(added or {}) do
    add[#add + 1] = { id = id, content = content, special = true }
  end
  table.sort(add, function(a, b) return a.id < b.id end)
  return write(name, cjson.encode({
    added_tokens = add,
    pre_tokenizer = { type = "ByteLevel", add_prefix_space = false, use_regex = true },
    decoder = { type = "ByteLevel" },
    model = { type = "BPE", vocab = vocab, merges = merges or {} },
  }))
end

------------------------------------------------------------ token files

function T.token_files_v1_and_v2_round_trip()
  local small, big = { 0, 1, 65535, 7 }, { 0, 65536, 128255, 3, 4294967295 }
  local p1, p2 = tmp .. "/v1.bin", tmp .. "/v2.bin"
  same({ data.write_token_file(p1, small) }, { 4, 1 }, "v1 count, version")
  same({ data.write_token_file(p2, big) }, { 5, 2 }, "v2 count, version")
  eq(#io.open(p1, "rb"):read("*a"), 1024 + 4 * 2, "v1 bytes")
  eq(#io.open(p2, "rb"):read("*a"), 1024 + 5 * 4, "v2 bytes")
  local c1, c2 = data.load(p1), data.load(p2)
  same({ c1.version, c1.count, c1.max_id }, { 1, 4, 65535 }, "v1 header")
  same(list(c1.ids, 4), small, "v1 ids")
  same({ c2.version, c2.count, c2.max_id }, { 2, 5, 4294967295 }, "v2 header")
  same(list(c2.ids, 5), big, "v2 ids")
  -- llm.c's header: magic, version, count
  local h = ffi.cast("const int32_t *", io.open(p2, "rb"):read(12))
  same({ h[0], h[1], h[2] }, { 20240520, 2, 5 }, "v2 header ints")
  -- version 2 asked for small ids; version 1 refuses an id over 65535
  same({ data.write_token_file(tmp .. "/v2small.bin", small, { version = 2 }) }, { 4, 2 })
  same(list(data.load(tmp .. "/v2small.bin").ids, 4), small, "v2 small ids")
  expect_error(function() data.write_token_file(tmp .. "/x.bin", big, { version = 1 }) end,
               "token id 65536 does not fit a version 1 token file (0..65535)")
  data.free(c1); data.free(c2)
end

function T.token_file_refusals_name_the_file_and_fix()
  local function file(name, version, count, body_bytes)
    local h = ffi.new("int32_t[256]")
    h[0], h[1], h[2] = 20240520, version, count
    return write(name, ffi.string(h, 1024) .. ("\1"):rep(body_bytes))
  end
  expect_error(function() data.load(file("v3.bin", 3, 2, 8)) end,
               "v3.bin: token file version 3 is not supported (this luazero reads versions 1 " ..
               "and 2: uint16 and uint32 ids); re-create it with tools/prepare-data")
  expect_error(function() data.load(file("short.bin", 2, 3, 8)) end,
               "short.bin: truncated: the header says 3 tokens (12 bytes) but only 8 bytes")
  expect_error(function() data.load(file("long.bin", 2, 2, 14)) end,
               "long.bin: the header says 2 tokens (8 bytes) but 14 bytes follow it (6 bytes " ..
               "more, not whole 4-byte tokens)")
  expect_error(function() data.load(file("long1.bin", 1, 2, 8)) end,
               "the header says 2 tokens (4 bytes) but 8 bytes follow it (2 tokens more)")
  local path = tmp .. "/big.bin"
  local ids = {}
  for i = 1, 200 do ids[i] = i % 7 end
  ids[50] = 128255
  data.write_token_file(path, ids)
  local c = data.load(path)
  expect_error(function() data.loader(c, { B = 1, T = 8, vocab = 32000 }) end,
               "data: " .. path .. ": token id 128255 is not below the model's vocabulary " ..
               "32000; use --vocab 128256 or larger")
  data.free(c)
  -- an id no --vocab can take is not answered with a --vocab it cannot take
  ids[50] = 4294967295
  data.write_token_file(path, ids)
  c = data.load(path)
  expect_error(function() data.loader(c, { B = 1, T = 8, vocab = 32000 }) end,
               "data: " .. path .. ": token id 4294967295 is larger than any vocabulary (--vocab " ..
               "takes at most 2147483647): the file is damaged")
  data.free(c)
end

-- prepare-data writes version 1 for a vocabulary that fits uint16 and
-- version 2 for one that does not (an added token at id 70000), and the
-- version 2 file loads with that id.
function T.prepare_data_picks_version_2_for_a_large_vocabulary()
  local text = write("p.txt", "hello <|big|> world")
  local small = byte_tokenizer("small.json", { ["<|eot|>"] = 256 })
  local large = byte_tokenizer("large.json", { ["<|big|>"] = 70000 })
  local out, st = tool(("tools/prepare-data --tokenizer %s %s %s"):format(q(small), q(text),
                       q(tmp .. "/p1.bin")))
  assert(st == 0 and out:find("version 1 (uint16 ids", 1, true), out)
  -- one file and no output: said, before the usage
  out, st = tool(("tools/prepare-data %s"):format(q(text)))
  assert(st == 2 and out:find("prepare-data: one file given (" .. text .. "); give the input " ..
                              "file(s), then the OUTPUT.bin to write", 1, true), out)
  out, st = tool(("tools/prepare-data --tokenizer %s %s %s"):format(q(large), q(text),
                 q(tmp .. "/p2.bin")))
  assert(st == 0 and out:find("13 tokens, version 2 (uint32 ids", 1, true), out)
  local c = data.load(tmp .. "/p2.bin")
  same({ c.version, c.ids[6], c.max_id }, { 2, 70000, 70000 }, "version 2 with the added id")
  data.free(c)
  eq(data.load(tmp .. "/p1.bin").version, 1, "small vocabulary's version")
end

-- prepare-data reads what it is told: --format jsonl whatever the input's
-- name; and it refuses what it would turn into wrong data without a word
-- (a .jsonl among several inputs, a token or instruction file as text,
-- bytes that are not UTF-8 for a tokenizer) and flags it does not know.
function T.prepare_data_refuses_what_it_would_get_wrong()
  local jl = write("ex.jsonl", '{"prompt": "a", "completion": "b"}\n')
  local as_txt = write("ex.txt", '{"prompt": "a", "completion": "b"}\n')
  local text = write("q.txt", "hello world\n")
  local bad = write("bad.txt", "fine\nab\255\254cd\n")
  local tokzr = byte_tokenizer("q.json", {})
  local function run(args)
    return tool("tools/prepare-data " .. args)
  end
  local out, st = run(("--format jsonl %s %s"):format(q(as_txt), q(tmp .. "/q1.bin")))
  assert(st == 0 and out:find("1 examples, 2 tokens, 1 trained", 1, true), out)
  out, st = run(("%s %s %s"):format(q(jl), q(jl), q(tmp .. "/q2.bin")))
  assert(st == 2 and out:find(jl .. " is JSON Lines (instruction data), read as such only " ..
                              "alone", 1, true), out)
  out, st = run(("%s %s"):format(q(text), q(tmp .. "/q3.bin")))
  assert(st == 0, out)
  out, st = run(("%s %s"):format(q(tmp .. "/q3.bin"), q(tmp .. "/q4.bin")))
  assert(st == 2 and out:find("q3.bin is already a token file", 1, true), out)
  out, st = run(("%s %s"):format(q(tmp .. "/q1.bin"), q(tmp .. "/q5.bin")))
  assert(st == 2 and out:find("q1.bin is already an instruction file", 1, true), out)
  out, st = run(("--tokenizer %s %s %s"):format(q(tokzr), q(bad), q(tmp .. "/q6.bin")))
  assert(st == 2 and out:find(bad .. ":2: byte 8 (0xFF) is not UTF-8", 1, true), out)
  out, st = run(("--packing pad %s %s"):format(q(jl), q(tmp .. "/q7.bin")))
  assert(st == 2 and out:find("unknown flag --packing (--help lists the flags)", 1, true), out)
  for _, f in ipairs({ "q2.bin", "q4.bin", "q5.bin", "q6.bin", "q7.bin" }) do
    assert(not io.open(tmp .. "/" .. f), f .. " written by a refused run")
  end
  -- a folder as input; an OUTPUT forgotten, so the last input (notes) would
  -- be the output; -h
  out, st = run(("%s %s"):format(q(tmp), q(tmp .. "/q8.bin")))
  assert(st == 2 and out:find(tmp .. " is a folder; give the text file(s) in it", 1, true), out)
  local notes = write("notes.txt", "my notes\n")
  out, st = run(("%s %s"):format(q(text), q(notes)))
  assert(st == 2 and out:find(notes .. " is there and is not a token or instruction file, so " ..
                              "writing the output would destroy it", 1, true), out)
  eq(lz.read_file(notes), "my notes\n", "the notes after a refused run")
  out, st = run(("%s %s"):format(q(text), q(tmp .. "/q3.bin"))) -- (an earlier token file: replaced)
  assert(st == 0, out)
  out, st = run("-h")
  assert(st == 0 and out:find("^usage: tools/prepare%-data"), out)
end

-- prepare-data reads an input by blocks and encodes it by pieces
-- (tokenizer/stream.lua), with the ids of encoding it whole; a byte that is
-- not UTF-8 past the first block, or a file ending inside a character, is
-- refused naming its line and byte.
function T.prepare_data_encodes_a_large_input_by_pieces()
  local root = lz.root .. "/tests/fixtures/tokenizer/"
  local tok = require("luazero.tokenizer").load(root .. "byte_level.json")
  local uni = io.open(root .. "unicode_corpus.txt"):read("*a")
  local lines = {}
  for i = 1, 40000 do
    lines[i] = ("line %d: the cat's <|endoftext|> %s"):format(i, i % 97 == 0 and uni or "")
  end
  local text = table.concat(lines, "\n")
  assert(#text > 1.5 * 2 ^ 20, #text) -- (two pieces of the default size, two blocks)
  local big = write("big.txt", text)
  for _, env in ipairs({ "", "LZ_PREPARE_PIECE_BYTES=70000 " }) do
    local out, st = tool(("%stools/prepare-data --tokenizer %s %s %s")
                         :format(env, q(root .. "byte_level.json"), q(big), q(tmp .. "/big.bin")))
    assert(st == 0, out)
    local d = data.load(tmp .. "/big.bin")
    local whole = tok:encode(text)
    assert(d.count == #whole, ("%s%d ids, whole %d"):format(env, d.count, #whole))
    for i = 1, #whole do
      if d.ids[i - 1] ~= whole[i] then error(("%sid %d differs"):format(env, i)) end
    end
    data.free(d)
  end
  -- the bad byte past the first block (1 MiB)
  local before = table.concat(lines, "\n", 1, 30000) .. "\nab"
  local bad = write("bad-late.txt", before .. "\255cd\n")
  local line, at = select(2, before:gsub("\n", "")) + 1, #before + 1
  local out, st = tool(("tools/prepare-data --tokenizer %s %s %s"):format(q(root .. "byte_level.json"),
                                                                     q(bad), q(tmp .. "/bad-late.bin")))
  assert(at > 2 ^ 20 and st == 2 and
         out:find(("%s:%d: byte %d (0xFF) is not UTF-8"):format(bad, line, at), 1, true), out)
  -- a character cut by the end of the file ("é" is C3 A9)
  local cut = write("cut.txt", text:sub(1, 2 ^ 20 + 5) .. "\195")
  out, st = tool(("tools/prepare-data --tokenizer %s %s %s"):format(q(root .. "byte_level.json"),
                                                                 q(cut), q(tmp .. "/cut-end.bin")))
  assert(st == 2 and out:find(("%s: the file ends inside a character (byte %d, 0xC3")
                              :format(cut, 2 ^ 20 + 6), 1, true), out)
  assert(not io.open(tmp .. "/bad-late.bin") and not io.open(tmp .. "/cut-end.bin"),
         "a refused run wrote its output")
  -- a token file's magic is looked for at the start only, not in each block
  local magic = ffi.new("int32_t[1]", data.MAGIC)
  local mid = write("magic-mid.txt", ("a"):rep(2 ^ 20) .. ffi.string(magic, 4) .. "text\n")
  out, st = tool(("tools/prepare-data %s %s"):format(q(mid), q(tmp .. "/magic-mid.bin")))
  assert(st == 0 and out:find(("%d tokens"):format(2 ^ 20 + 9), 1, true), out)
end

-- A version 2 file of a Llama 3 vocabulary (128256) trains a tiny Llama.
function T.llama3_vocabulary_trains_from_a_version_2_file()
  local ids = {}
  for i = 1, 3000 do ids[i] = (i * 7919) % 128256 end
  ids[3] = 128255
  local path = tmp .. "/llama3.bin"
  eq(select(2, data.write_token_file(path, ids)), 2, "version")
  local out, st = support.sh(("cd %s && %s scripts/train.lua --model llama-tiny --vocab 128256 " ..
    "--n-layer 1 --context 32 --seq-len 16 --micro-batch 1 --steps 3 --sample 0 " ..
    "--eval-batches 1 --data %s"):format(q(lz.root), q(lz.executable()), q(path)))
  assert(st == 0, out)
  assert(out:find("vocab 128256", 1, true), out)
  local n = 0
  for loss in out:gmatch("| loss ([%d.]+)") do
    n = n + 1
    assert(tonumber(loss) < math.huge and tonumber(loss) > 10, out) -- about ln 128256 = 11.76
  end
  eq(n, 3, "steps with a finite loss")
end

-- prepare-data records the tokenizer in the token file's header (its
-- vocabulary, its tokenizer.json's xxh64; byte level 256): train.lua refuses
-- the file with another --tokenizer or with one when it was made at byte
-- level (before, the ids trained as other tokens and samples decoded as
-- garbage), and its vocabulary hint is the tokenizer's. llm.c's files and
-- older ones (zeros there) are taken as they are.
function T.a_token_file_records_its_tokenizer()
  local text = write("rec.txt", ("the cat sat on the mat. "):rep(300))
  local fixtures = lz.root .. "/tests/fixtures/tokenizer/"
  local bl, sp = fixtures .. "byte_level.json", fixtures .. "sentencepiece.json"
  local made, byte = tmp .. "/rec-tok.bin", tmp .. "/rec-byte.bin"
  local out, st = tool(("tools/prepare-data --tokenizer %s %s %s"):format(q(bl), q(text), q(made)))
  assert(st == 0, out)
  out, st = tool(("tools/prepare-data %s %s"):format(q(text), q(byte)))
  assert(st == 0, out)
  local c = data.load(made)
  local files = require("luazero.data.files")
  assert(files.same_tokenizer(c.made_with, files.tokenizer_record(bl, 267)), "recorded")
  data.free(c)
  c = data.load(byte)
  assert(files.same_tokenizer(c.made_with, files.BYTE_LEVEL), "byte level recorded")
  data.free(c)
  local function train(flags)
    return tool(("build/bin/luazero scripts/train.lua --model gpt2-nano --n-layer 1 --n-embd 32 " ..
                 "--n-head 2 --context 16 --seq-len 8 --steps 1 --sample 0 %s"):format(flags))
  end
  out, st = train(("--vocab 300 --data %s --tokenizer %s"):format(q(made), q(bl)))
  assert(st == 0, out)
  out, st = train(("--vocab 40000 --data %s --tokenizer %s"):format(q(made), q(sp)))
  assert(st == 2 and out:find("is not the tokenizer --data " .. made .. " was made with " ..
                              "(tools/prepare-data recorded one of 267 tokens", 1, true), out)
  out, st = train(("--vocab 300 --data %s --tokenizer %s"):format(q(byte), q(bl)))
  assert(st == 2 and out:find("was made at byte level (each byte a token), not with --tokenizer",
                              1, true), out)
  out, st = train(("--vocab 200 --data %s"):format(q(made)))
  assert(st == 2 and out:find("the file was made with a tokenizer of 267 tokens: use --vocab 267 " ..
                              "or larger", 1, true), out)
  -- an instruction file records its tokenizer alike
  local sft = write("rec.jsonl", ('{"prompt": "a", "completion": "b"}\n'):rep(30))
  local ins = tmp .. "/rec-ins.bin"
  out, st = tool(("tools/prepare-data --tokenizer %s %s %s"):format(q(bl), q(sft), q(ins)))
  assert(st == 0, out)
  out, st = train(("--vocab 40000 --data %s --tokenizer %s"):format(q(ins), q(sp)))
  assert(st == 2 and out:find("is not the tokenizer --data " .. ins .. " was made with", 1, true),
         out)
  out, st = train(("--vocab 300 --data %s --tokenizer %s"):format(q(ins), q(bl)))
  assert(st == 0, out)
  -- several inputs: each tokenised on its own, the ids one after another
  -- (before, the joined text was tokenised: a token could span two files)
  -- (a tokenizer merging "c a" and "ca t": the joined text would hold "cat")
  local mt = byte_tokenizer("rec-merges.json", {}, { "c a", "ca t" })
  local a, b = write("rec-a.txt", "the ca"), write("rec-b.txt", "t sat on the mat.\n")
  local both, one = tmp .. "/rec-ab.bin", tmp .. "/rec-a.bin"
  out, st = tool(("tools/prepare-data --tokenizer %s %s %s %s"):format(q(mt), q(a), q(b), q(both)))
  assert(st == 0, out)
  local want = {}
  for _, f in ipairs({ a, b }) do
    out, st = tool(("tools/prepare-data --tokenizer %s %s %s"):format(q(mt), q(f), q(one)))
    assert(st == 0, out)
    local c1 = data.load(one)
    for i = 0, c1.count - 1 do want[#want + 1] = c1.ids[i] end
    data.free(c1)
  end
  c = data.load(both)
  same(list(c.ids, c.count), want, "ids of the two inputs, each on its own")
  data.free(c)
  -- a file recording none (llm.c's header of zeros past the count) trains with any
  local ids = {}
  for i = 1, 400 do ids[i] = i % 250 end
  local plain = tmp .. "/rec-plain.bin"
  data.write_token_file(plain, ids)
  out, st = train(("--vocab 300 --data %s --tokenizer %s"):format(q(plain), q(bl)))
  assert(st == 0, out)
end

------------------------------------------------------------ instruction data

local function jsonl(name, lines)
  local parts = {}
  for i, l in ipairs(lines) do parts[i] = type(l) == "string" and l or cjson.encode(l) end
  return write(name, table.concat(parts, "\n") .. "\n")
end

local function doc(c, d)
  local a, e = c.st[d], c.st[d + 1]
  return list(c.ids, e, a), list(c.w, e, a)
end

local function bytes_of(s)
  local t = {}
  for i = 1, #s do t[i] = s:byte(i) end
  return t
end

function T.jsonl_prompt_completion_byte_level()
  local path = jsonl("pc.jsonl", { { prompt = "ab", completion = "cd" }, "",
                                   { prompt = "", completion = "xyz" } })
  local c = data.load(path)
  same({ c.kind, c.docs, c.count, c.max_id }, { "instruct", 2, 7, 122 }, "corpus")
  local ids, w = doc(c, 0)
  same(ids, bytes_of("abcd"), "ids 0")
  same(w, { 0, 0, 1, 1 }, "weights 0")
  ids, w = doc(c, 1)
  same(ids, bytes_of("xyz"), "ids 1")
  same(w, { 1, 1, 1 }, "weights 1")
  same(list(c.ln, 2), { 1, 3 }, "source lines (a blank line skipped)")
  data.free(c)
end

-- Held-out instruction data (--val-data, scripts/eval.lua): every example
-- is validation, in file order, masked as training masks it.
function T.held_out_instruction_data_is_every_example_masked()
  local path = jsonl("held.jsonl", { { prompt = "ab", completion = "cd" },
                                     { prompt = "efg", completion = "h" },
                                     { prompt = "i", completion = "jk" } })
  local c = data.load(path)
  local loader = require("luazero.held_out").loader(c, { B = 1, T = 8, vocab = 256, seed = 1,
                                                        packing = "pad" })
  same({ loader.val_batches }, { 3 }, "one padded row per example")
  local scored = {}
  for i = 1, loader.val_batches do
    local x, y = loader:val_batch(i)
    local n = 0
    for t = 0, 7 do if y:get(t) >= 0 then n = n + 1 end end
    scored[i] = n
    same({ x:get(0) }, { ("aei"):byte(i) }, "example " .. i .. " in file order")
  end
  -- Scored: the targets whose next token is the completion's.
  same(scored, { 2, 1, 2 }, "masked targets per example")
  loader:free()
  data.free(c)
end

-- With a tokenizer: bos (weight 0) prompt (0) completion (1) eos (1).
function T.jsonl_prompt_completion_with_bos_and_eos()
  local tok = require("luazero.tokenizer").load(byte_tokenizer("be.json",
                                                { ["<s>"] = 256, ["</s>"] = 257 }))
  tok.bos_id, tok.eos_id = 256, 257
  local c = data.load(jsonl("be.jsonl", { { prompt = "Hi", completion = " yo</s>" } }),
                      { tokenizer = tok })
  local ids, w = doc(c, 0)
  -- the completion's own "</s>" is the special token, as tokenizers reads it
  same(ids, { 256, 72, 105, 32, 121, 111, 257, 257 }, "ids")
  same(w, { 0, 0, 0, 1, 1, 1, 1, 1 }, "weights")
  data.free(c)
end

-- A token across the prompt/completion boundary weighs as the part its first
-- byte lies in: "xa" + "bcd" is x, ab, c, d.
function T.jsonl_prompt_completion_boundary_token()
  local tok = require("luazero.tokenizer").load(byte_tokenizer("m.json", {}, { "a b" }))
  local c = data.load(jsonl("mb.jsonl", { { prompt = "xa", completion = "bcd" },
                                          { prompt = "x", completion = "abcd" } }),
                      { tokenizer = tok })
  local ids, w = doc(c, 0)
  same(ids, { 120, 300, 99, 100 }, "ids")
  same(w, { 0, 0, 1, 1 }, "weights")
  ids, w = doc(c, 1)
  same(ids, { 120, 300, 99, 100 }, "ids")
  same(w, { 0, 1, 1, 1 }, "weights")
  data.free(c)
end

-- messages: the template's text, weight 1 on tokens whose first byte lies
-- in an assistant span. A stand-in template and a tokenizer with offsets.
local function stub_template(log)
  return function()
    return {
      render = function(_, msgs)
        local text, spans = "", {}
        for _, m in ipairs(msgs) do
          if m.role ~= "user" and m.role ~= "assistant" and m.role ~= "system" then
            error("chat_template: tc/tokenizer_config.json: role '" .. m.role ..
                  "' is not one this template renders (raise_exception: Conversation roles " ..
                  "must be user or assistant); use user, assistant or system", 0)
          end
          local head = "<" .. m.role .. ">"
          text = text .. head
          local first = #text
          text = text .. m.content .. "|"
          if m.role == "assistant" then
            spans[#spans + 1] = { first = first, last = #text, role = "assistant" }
          end
        end
        if log then log[#log + 1] = text end
        return text, spans
      end,
    }
  end
end

-- A tokenizer whose tokens are pairs of bytes (the last maybe one), with
-- offsets: a token straddling a span's start is weighted by its first byte.
local pairs_tok = {
  vocab_size = 65536,
  encode = function(_, text, opts)
    local ids, starts = {}, {}
    for i = 1, #text, 2 do
      ids[#ids + 1] = text:byte(i) * 256 + (text:byte(i + 1) or 0)
      starts[#starts + 1] = i - 1
    end
    if opts and opts.offsets then return ids, starts end
    return ids
  end,
}

function T.jsonl_messages_weigh_assistant_spans()
  local log = {}
  local path = jsonl("m.jsonl", { { messages = {
    { role = "system", content = "S" }, { role = "user", content = "hey" },
    { role = "assistant", content = "hello" }, { role = "user", content = "x" },
    { role = "assistant", content = "ok" } } } })
  local c = data.load(path, { tokenizer = pairs_tok, template = stub_template(log) })
  local text = "<system>S|<user>hey|<assistant>hello|<user>x|<assistant>ok|"
  eq(log[1], text, "rendered")
  local ids, w = doc(c, 0)
  eq(#ids, math.ceil(#text / 2), "tokens")
  -- byte b (0-based) is in a span when it lies in "hello|" (32..37) or "ok|" (56..58)
  local want = {}
  for i = 1, #ids do
    local b = 2 * (i - 1)
    want[i] = ((b >= 32 and b < 38) or (b >= 56 and b < 59)) and 1 or 0
  end
  same(w, want, "weights by first byte")
  eq(ids[1], ("<"):byte() * 256 + ("s"):byte(), "first id")
  data.free(c)
end

-- End to end with a real template (ChatML, tests/fixtures/chat) and a
-- tokenizer folder: the assistant's content and its <|im_end|> weigh 1,
-- the rest (headers, system, user, the newline after <|im_end|>) 0; a role
-- the template rejects is the line's error.
function T.jsonl_messages_with_a_chat_template_folder()
  local dir = tmp .. "/chatml"
  os.execute("mkdir -p " .. q(dir))
  os.execute(("cp %s/tests/fixtures/chat/chatml/tokenizer_config.json %s/"):format(q(lz.root),
             q(dir)))
  os.rename(byte_tokenizer("chatml.json", { ["<|im_start|>"] = 256, ["<|im_end|>"] = 257 }),
            dir .. "/tokenizer.json")
  local tok, template = instruct.open_tokenizer(dir)
  local path = jsonl("chat.jsonl", { { messages = {
    { role = "system", content = "S" }, { role = "user", content = "Hi" },
    { role = "assistant", content = "Yo" } } } })
  local c = data.load(path, { tokenizer = tok, template = template })
  local ids, w = doc(c, 0)
  local want_ids, want_w = {}, {}
  local function add(s, weight)
    if type(s) == "number" then
      want_ids[#want_ids + 1], want_w[#want_w + 1] = s, weight
      return
    end
    for i = 1, #s do want_ids[#want_ids + 1], want_w[#want_w + 1] = s:byte(i), weight end
  end
  add(256, 0); add("system\nS", 0); add(257, 0); add("\n", 0)
  add(256, 0); add("user\nHi", 0); add(257, 0); add("\n", 0)
  add(256, 0); add("assistant\n", 0); add("Yo", 1); add(257, 1); add("\n", 0)
  same(ids, want_ids, "ids")
  same(w, want_w, "weights")
  data.free(c)
  -- Llama 2's template raises for roles that do not alternate
  local l2 = tmp .. "/llama2"
  os.execute("mkdir -p " .. q(l2))
  os.execute(("cp %s/tests/fixtures/chat/llama2/tokenizer_config.json %s/"):format(q(lz.root),
             q(l2)))
  os.rename(byte_tokenizer("l2.json", { ["<s>"] = 256, ["</s>"] = 257 }), l2 .. "/tokenizer.json")
  tok, template = instruct.open_tokenizer(l2)
  local bad = jsonl("alt.jsonl", { { prompt = "a", completion = "b" }, { messages = {
    { role = "user", content = "a" }, { role = "user", content = "b" } } } })
  local ok, err = pcall(data.load, bad, { tokenizer = tok, template = template })
  assert(not ok and tostring(err):find("^data: " .. bad:gsub("%p", "%%%0") .. ":2: chat_template: ")
         and not tostring(err):find("\n"), tostring(err))
end

function T.every_bad_line_is_one_line_with_file_line_and_fix()
  local cases = {
    { '{"prompt": "a", "completion": ', ":1: not valid JSON (", "fix the line or drop it" },
    { '[1, 2]', ":1: not a JSON object; give {\"prompt\"" },
    { '{"prompt": "a"}', ':1: no "completion"; give {"prompt": "...", "completion": "..."}' },
    { '{"completion": "a"}', ':1: no "prompt"' },
    { '{"prompt": 3, "completion": "a"}', ':1: "prompt" is number, not a string' },
    { '{"text": "a"}', ':1: has neither "prompt" and "completion" nor "messages"' },
    { '{"messages": [], "prompt": "a"}', ':1: has both "messages" and "prompt"/"completion"' },
    { '{"messages": {}}', ':1: "messages" is not a list of messages' },
    { '{"messages": [{"role": "user"}]}', ':1: messages[1] needs a "role" and a "content"' },
    { '{"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]}',
      ":1: chat_template: tc/tokenizer_config.json: role 'tool' is not one this template " ..
      "renders" },
    { '{"messages": [{"role": "user", "content": "hello there"}]}',
      ":1: no token is trained (", "none from an assistant message); add text there or drop" },
    { '{"prompt": "aaaa", "completion": "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"}',
      ":1: the example is 35 tokens, longer than the sequence length 32; raise --seq-len to " ..
      "35 or drop the line" },
    -- JSON is UTF-8: a Latin-1 byte inside a string is named, not passed on
    { '{"prompt": "caf\233", "completion": "b"}', ":1: byte 16 (0xE9) is not UTF-8; save the " ..
      "file as UTF-8" },
    { '{"prompt": "\237\160\128", "completion": "b"}', ":1: byte 13 (0xED) is not UTF-8" },
  }
  for i, case in ipairs(cases) do
    local path = write(("bad%d.jsonl"):format(i), '{"prompt": "p", "completion": "c"}\n\n' ..
                                                   case[1] .. "\n")
    local ok, err = pcall(data.load, path, { template = stub_template(), max_len = 32 })
    assert(not ok, "no error for " .. case[1])
    err = tostring(err)
    assert(not err:find("\n"), "not one line: " .. err)
    local want = "data: " .. path .. case[2]:gsub("^:1:", ":3:")
    assert(err:sub(1, #want) == want, ("\n  got: %s\n want: %s..."):format(err, want))
    for k = 3, #case do assert(err:find(case[k], 1, true), err .. "\n lacks " .. case[k]) end
  end
  -- a byte order mark is named
  local bom = write("bom.jsonl", '\239\187\191{"prompt": "p", "completion": "c"}\n')
  expect_error(function() data.load(bom, { template = stub_template() }) end,
               "data: " .. bom .. ":1: starts with a UTF-8 byte order mark (EF BB BF)")
  -- messages with no template at all: where to get one
  expect_error(function()
    data.load(jsonl("nt.jsonl", { { messages = { { role = "user", content = "a" } } } }))
  end, "nt.jsonl:1: a \"messages\" line needs a chat template: give --tokenizer with a " ..
       "Hugging Face tokenizer folder")
  expect_error(function() data.load(write("empty.jsonl", "\n\n")) end,
               "empty.jsonl: holds no examples")
end

function T.instruction_file_round_trip_and_refusals()
  local lines = {}
  for i = 1, 5 do lines[i] = { prompt = ("p%d"):format(i), completion = ("c%d!"):format(i) } end
  local c = data.load(jsonl("rt.jsonl", lines))
  local path = tmp .. "/rt.bin"
  data.write_instruction_file(path, c)
  local r = data.load(path)
  same({ r.kind, r.count, r.docs, r.max_id }, { "instruct", c.count, 5, c.max_id }, "corpus")
  same(list(r.ids, r.count), list(c.ids, c.count), "ids")
  same(list(r.w, r.count), list(c.w, c.count), "weights")
  same(list(r.st, 6), { 0, 5, 10, 15, 20, 25 }, "document starts")
  same(list(r.ln, 5), { 1, 2, 3, 4, 5 }, "source lines")
  local h = ffi.cast("const int32_t *", io.open(path, "rb"):read(16))
  same({ h[0], h[1], h[2], h[3] }, { 20240521, 1, 25, 5 }, "header")
  local bytes = io.open(path, "rb"):read("*a")
  eq(#bytes, 1024 + 25 * 4 + 25 + 6 * 4 + 5 * 4, "file size")
  expect_error(function() data.load(write("cut.bin", bytes:sub(1, -2))) end,
               "cut.bin: 1192 bytes, but the header's 25 tokens in 5 documents make 1193 " ..
               "(truncated); re-create it with tools/prepare-data --format jsonl")
  local hv = ffi.new("int32_t[4]", 20240521, 2, 25, 5)
  expect_error(function() data.load(write("v2i.bin", ffi.string(hv, 16) .. bytes:sub(17))) end,
               "v2i.bin: instruction file version 2 is not supported (this luazero reads " ..
               "version 1)")
  -- a weight that is not 0 or 1
  local at = 1024 + 25 * 4 + 1
  expect_error(function()
    data.load(write("w.bin", bytes:sub(1, at - 1) .. "\7" .. bytes:sub(at + 1)))
  end, "w.bin: token 0's weight is 7, not 0 or 1; re-create it")
  -- an example whose weights are all 0 trains nothing: refused as its .jsonl line is
  local w3 = at + 10 -- example 3: tokens 10..14
  expect_error(function()
    data.load(write("z.bin", bytes:sub(1, w3 - 1) .. ("\0"):rep(5) .. bytes:sub(w3 + 5)))
  end, "z.bin: example 3 (line 3 of its .jsonl): no token is trained (5 tokens, all of " ..
       "weight 0); give it a completion there or drop the line; re-create it with " ..
       "tools/prepare-data --format jsonl")
  -- an example longer than --seq-len names its line; an id over the vocabulary
  expect_error(function() data.loader(r, { B = 1, T = 4, vocab = 256 }) end,
               "data: " .. path .. ": the example from line 1 is 5 tokens, longer than the " ..
               "sequence length 4; raise --seq-len to 5 or drop that line")
  expect_error(function() data.loader(r, { B = 1, T = 8, vocab = 100 }) end,
               "token id 112 is not below the model's vocabulary 100; use --vocab 113")
  data.free(r); data.free(c)
end

function T.prepare_data_jsonl_writes_an_instruction_file()
  local src = jsonl("prep.jsonl", { { prompt = "a", completion = "bc" },
                                    { prompt = "dd", completion = "e" } })
  local out, st = tool(("tools/prepare-data %s %s"):format(q(src), q(tmp .. "/prep.bin")))
  assert(st == 0 and out:find("2 examples, 6 tokens, 3 trained", 1, true), out)
  local c = data.load(tmp .. "/prep.bin")
  same(list(c.ids, 6), bytes_of("abcdde"), "ids")
  same(list(c.w, 6), { 0, 1, 1, 0, 0, 1 }, "weights")
  data.free(c)
  out, st = tool(("tools/prepare-data --format jsonl --seq-len 2 %s %s"):format(q(src),
                 q(tmp .. "/prep2.bin")))
  assert(st == 2 and out:find("prepare-data: data: " .. src .. ":1: the example is 3 tokens, " ..
         "longer than the sequence length 2; raise --seq-len to 3 or drop the line", 1, true), out)
  assert(not support.exists(tmp .. "/prep2.bin"), "a refused run left its output")
end

-- A Hugging Face folder of a fixture's chat template and a byte-level
-- tokenizer with ChatML's two special tokens.
local function chatml_folder(name, fixture)
  local dir = tmp .. "/" .. name
  os.execute("mkdir -p " .. q(dir))
  os.execute(("cp %s/tests/fixtures/chat/%s/tokenizer_config.json %s/"):format(q(lz.root),
             fixture, q(dir)))
  os.rename(byte_tokenizer(name .. ".json", { ["<|im_start|>"] = 256, ["<|im_end|>"] = 257 }),
            dir .. "/tokenizer.json")
  return dir
end

-- --chat-kwargs (apply_chat_template's keyword arguments) reach the
-- template: Qwen2.5's tools in the data (prepare-data as data.load),
-- Qwen3's enable_thinking in generate's prompt; a value that is not a JSON
-- object is one line naming the flag.
function T.chat_kwargs_reach_the_template()
  local dir = chatml_folder("qwen25", "qwen2.5")
  local tok, template = instruct.open_tokenizer(dir)
  local path = jsonl("tools.jsonl", { { messages = {
    { role = "user", content = "Hi" }, { role = "assistant", content = "Yo" } } } })
  local tools = { { type = "function", ["function"] = { name = "get_weather",
                                                     description = "The weather" } } }
  -- as JSON, keys in the order a Lua table is written (sorted)
  local tools_json = '{"tools": [{"function": {"description": "The weather", ' ..
                     '"name": "get_weather"}, "type": "function"}]}'
  local plain = data.load(path, { tokenizer = tok, template = template })
  local with = data.load(path, { tokenizer = tok, template = template,
                                 chat_vars = { tools = tools } })
  local ids0, w0 = doc(plain, 0)
  local ids1, w1 = doc(with, 0)
  local text = {}
  for i, id in ipairs(ids1) do text[i] = id < 256 and string.char(id) or "" end
  text = table.concat(text)
  assert(text:find("# Tools", 1, true) and text:find('"name": "get_weather"', 1, true), text)
  assert(#ids1 > #ids0, "the tools are in the rendered text")
  local function trained(w) local n = 0 for _, v in ipairs(w) do n = n + v end return n end
  eq(trained(w1), trained(w0), "the assistant's tokens alone weigh")
  data.free(plain); data.free(with)
  -- prepare-data writes the same ids with --chat-kwargs
  local out, st = tool(("tools/prepare-data --tokenizer %s --chat-kwargs %s %s %s")
                       :format(q(dir), q(tools_json), q(path),
                               q(tmp .. "/tools.bin")))
  assert(st == 0, out)
  local c = data.load(tmp .. "/tools.bin")
  same(list(c.ids, c.count), ids1, "prepare-data's ids")
  data.free(c)
  -- a line's own "tools" (as TRL's datasets keep them): the same ids
  local own = jsonl("own_tools.jsonl", { '{"messages": [{"role": "user", "content": "Hi"}, ' ..
    '{"role": "assistant", "content": "Yo"}], "tools": [{"function": {"description": ' ..
    '"The weather", "name": "get_weather"}, "type": "function"}]}' })
  c = data.load(own, { tokenizer = tok, template = template })
  same(list(c.ids, c.count), ids1, "a line's own tools")
  data.free(c)
  out, st = tool(("tools/prepare-data --tokenizer %s --chat-kwargs '[1]' %s %s")
                 :format(q(dir), q(path), q(tmp .. "/bad.bin")))
  assert(st == 2 and out:find("prepare-data: --chat-kwargs: [1] is not a JSON object of " ..
                              "template variables", 1, true), out)
  -- train.lua renders its data with them: the example's length says so
  local lzx = q(lz.executable())
  local train = ("cd %s && %s scripts/train.lua --model llama-tiny --vocab 320 --context 64 " ..
                 "--seq-len 16 --micro-batch 2 --steps 1 --sample 0 "):format(q(lz.root), lzx)
  out, st = support.sh(train .. ("--tokenizer %s --data %s --chat-kwargs %s")
                       :format(q(dir), q(path), q(tools_json)))
  assert(st == 2 and out:find(("the example is %d tokens, longer than the sequence length 16")
                              :format(#ids1), 1, true), out)
  -- generate --chat: Qwen3's prompt without thinking ends with an empty <think> block
  local q3 = chatml_folder("qwen3", "qwen3")
  local text_file = write("t.txt", ("some text to train on\n"):rep(40))
  out, st = support.sh(train .. ("--data %s --save %s/ck && %s tools/ckpt.lua export %s/ck " ..
                                 "%s/hf && cp %s/tokenizer.json %s/tokenizer_config.json %s/hf/")
                       :format(q(text_file), q(tmp), lzx, q(tmp), q(tmp), q(q3), q(q3), q(tmp)))
  assert(st == 0, out)
  local prompts = {}
  for i, kw in ipairs({ "", " --chat-kwargs '{\"enable_thinking\": false}'" }) do
    out, st = support.sh(("cd %s && %s scripts/generate.lua --hf %s/hf --chat --prompt Hi " ..
                          "--max-new-tokens 1 --out %s/g%d.jsonl%s")
                         :format(q(lz.root), lzx, q(tmp), q(tmp), i, kw))
    assert(st == 0, out)
    prompts[i] = support.records(("%s/g%d.jsonl"):format(tmp, i))[1].prompt_ids
  end
  local want = {}
  for _, id in ipairs(prompts[1]) do want[#want + 1] = id end
  for _, b in ipairs(bytes_of("<think>\n\n</think>\n\n")) do want[#want + 1] = b end
  same(prompts[2], want, "enable_thinking false: the empty <think> block after the prompt")
  out, st = support.sh(("cd %s && %s scripts/generate.lua --hf %s/hf --prompt Hi " ..
                        "--chat-kwargs '{}'"):format(q(lz.root), lzx, q(tmp)))
  assert(st == 2 and out:find("--chat-kwargs", 1, true) and out:find("--chat", 1, true), out)
end

------------------------------------------------------------ batches

local function ints(t, n) return list(ffi.cast("int32_t *", t.data), n) end

-- Documents (ids, weights): A = 10 11 12 (weights 0 1 1), B = 20 21 (0 1),
-- C = 30 31 32 33 (0 0 1 1), D = 40 41 (1 1), E = 50 51 52 (0 1 1).
local function five_docs()
  return instruct.corpus("five", 14, 5, function(c)
    local ids = { 10, 11, 12, 20, 21, 30, 31, 32, 33, 40, 41, 50, 51, 52 }
    local w = { 0, 1, 1, 0, 1, 0, 0, 1, 1, 1, 1, 0, 1, 1 }
    for i = 1, 14 do c.ids[i - 1], c.w[i - 1] = ids[i], w[i] end
    local st = { 0, 3, 5, 9, 11, 14 }
    for i = 1, 6 do c.st[i - 1] = st[i] end
    for i = 1, 5 do c.ln[i - 1] = i end
    c.max_id = 52
  end)
end

-- Each row of a batch as a list of (token, target, pos, seg).
local function rows(x, y, e, B, Tn)
  local xs, ys, ps, ss = ints(x, B * Tn), ints(y, B * Tn), ints(e.pos, B * Tn), ints(e.seg, B * Tn)
  local out = {}
  for b = 0, B - 1 do
    local r = {}
    for t = 1, Tn do
      local k = b * Tn + t
      r[t] = { xs[k], ys[k], ps[k], ss[k] }
    end
    out[b + 1] = r
  end
  return out
end

-- The order the loader shuffled into, as the first id of each document.
local function firsts(l)
  local o = {}
  for i, d in ipairs(l.order) do o[i] = l.data.ids[l.data.st[d]] end
  return o
end

function T.pack_layout_position_by_position()
  local c = five_docs()
  -- val_fraction 0: all five train; the shuffled order decides the rows
  local l = data.loader(c, { B = 1, T = 6, vocab = 64, seed = 3, val_fraction = 0 })
  local order = firsts(l)
  eq(#order, 5, "documents in the epoch")
  -- what each document contributes: (token, target, pos) with the target -1
  -- where the next token is not trained or is past the document's end
  local parts = {
    [10] = { { 10, 11 }, { 11, 12 }, { 12, -1 } }, [20] = { { 20, 21 }, { 21, -1 } },
    [30] = { { 30, -1 }, { 31, 32 }, { 32, 33 }, { 33, -1 } },
    [40] = { { 40, 41 }, { 41, -1 } }, [50] = { { 50, 51 }, { 51, 52 }, { 52, -1 } },
  }
  local lens = { [10] = 3, [20] = 2, [30] = 4, [40] = 2, [50] = 3 }
  -- the rows packing lays, worked out here from the order
  local want_rows, row, used = {}, nil, 6
  for _, f in ipairs(order) do
    if used + lens[f] > 6 then
      row, used = {}, 0
      want_rows[#want_rows + 1] = row
    end
    local seg = row.segs or 0
    for k, p in ipairs(parts[f]) do row[#row + 1] = { p[1], p[2], k - 1, seg } end
    row.segs, used = seg + 1, used + lens[f]
  end
  for _, r in ipairs(want_rows) do
    local n = #r
    for k = n + 1, 6 do r[k] = { 0, -1, k - n - 1, r.segs } end
    r.segs = nil
  end
  eq(#l.rows - 1, #want_rows, "rows in the epoch")
  for i, want in ipairs(want_rows) do
    local x, y, e = l:next_batch()
    local got = rows(x, y, e, 1, 6)
    same(got[1], want, ("row %d (order %s)"):format(i, table.concat(order, " ")))
  end
  -- the next batch starts a new epoch, in a new order of the same documents
  l:next_batch()
  eq(l.epoch, 2, "epoch")
  l:free()
  instruct.free(c)
end

function T.pad_layout_one_example_per_row()
  local c = five_docs()
  local l = data.loader(c, { B = 5, T = 5, vocab = 64, seed = 1, val_fraction = 0,
                             packing = "pad", pad_id = 9 })
  local x, y, e = l:next_batch()
  local got = rows(x, y, e, 5, 5)
  local by_first = {}
  for _, r in ipairs(got) do by_first[r[1][1]] = r end
  same(by_first[30], { { 30, -1, 0, 0 }, { 31, 32, 1, 0 }, { 32, 33, 2, 0 }, { 33, -1, 3, 0 },
                       { 9, -1, 0, 1 } }, "C padded")
  same(by_first[20], { { 20, 21, 0, 0 }, { 21, -1, 1, 0 }, { 9, -1, 0, 1 }, { 9, -1, 1, 1 },
                       { 9, -1, 2, 1 } }, "B padded")
  same(by_first[40], { { 40, 41, 0, 0 }, { 41, -1, 1, 0 }, { 9, -1, 0, 1 }, { 9, -1, 1, 1 },
                       { 9, -1, 2, 1 } }, "D padded")
  for _, f in ipairs({ 10, 50 }) do assert(by_first[f], "document " .. f .. " in the batch") end
  expect_error(function() data.loader(c, { B = 1, T = 5, vocab = 64, packing = "zip" }) end,
               "--packing must be pack or pad (got zip)")
  l:free()
  instruct.free(c)
end

-- Validation: the last 10% of the examples in file order, the same on every
-- rank; training batches split across ranks as the stream loader's do.
function T.validation_and_ranks_and_a_resumed_position()
  local lines = {}
  for i = 1, 40 do lines[i] = { prompt = ("q%d "):format(i), completion = ("a%d"):format(i) } end
  local c = data.load(jsonl("many.jsonl", lines))
  local function loader(rank, world, B)
    return data.loader(c, { B = B, T = 16, vocab = 256, seed = 5, rank = rank, world = world })
  end
  local one = loader(0, 1, 4)
  eq(one.docs_val, 4, "held-out examples")
  -- the held-out examples (7 tokens each, two to a row of 16) in file order
  eq(one.val_batches, 0, "validation batches of 4 rows")
  local two = loader(0, 1, 2)
  eq(two.val_batches, 1, "validation batches of 2 rows")
  local x = ints((two:val_batch(1)), 32)
  eq(string.char(unpack(x, 1, 16)), "q37 a37q38 a38\0\0", "first held-out row")
  eq(string.char(unpack(x, 17, 30)), "q39 a39q40 a40", "second held-out row")
  two:free()
  local r0, r1 = loader(0, 2, 2), loader(1, 2, 2)
  for step = 1, 6 do
    local whole = ints((one:next_batch()), 4 * 16)
    local a, b = ints((r0:next_batch()), 32), ints((r1:next_batch()), 32)
    for i = 1, 32 do a[32 + i] = b[i] end
    same(a, whole, ("step %d: ranks 0 and 1 together are world 1's batch"):format(step))
  end
  -- a position saved mid-epoch, restored in a fresh loader, gives the same batches
  local pos = cjson.decode(cjson.encode(one:position()))
  local want = {}
  for i = 1, 12 do want[i] = ints((one:next_batch()), 64) end
  local again = loader(0, 1, 4)
  again:set_position(pos)
  for i = 1, 12 do same(ints((again:next_batch()), 64), want[i], "resumed batch " .. i) end
  expect_error(function() loader(0, 1, 4):set_position({ rng_state = "0123456789abcdef" }) end,
               "many.jsonl: the checkpoint's data position (a token stream")
  for _, l in ipairs({ one, r0, r1, again }) do l:free() end
  data.free(c)
end

-- scripts/train.lua on a .jsonl: the layout said, a resumed run bitwise the
-- straight one, --packing refused on a token stream.
function T.train_on_jsonl_resumes_bitwise()
  local lines = {}
  for i = 1, 60 do
    lines[i] = { prompt = ("Q: %d plus %d?\n"):format(i, i + 1), completion = ("A: %d."):format(2 * i + 1) }
  end
  local path = jsonl("train.jsonl", lines)
  local train, ok_train = support.trainer("--model gpt2-nano --n-layer 2 --n-embd 64 " ..
    "--n-head 4 --context 64 --seq-len 32 --sample 0 --eval-batches 1 --seed 7 " ..
    "--micro-batch 2 --data " .. q(path))
  local dir = tmp .. "/jck"
  for _, packing in ipairs({ "pack", "pad" }) do
    local out, straight = ok_train(1, ("--steps 6 --packing %s --save %s --save-every 3")
                                      :format(packing, q(dir .. packing)))
    assert(out:find("instruction data: 60 examples (54 for training, 6 held out), " ..
                    (packing == "pack" and "packed" or "padded"), 1, true), out)
    local _, resumed = ok_train(1, ("--steps 6 --packing %s --resume %s")
                                   :format(packing, q(dir .. packing .. "/step-000003")))
    eq(resumed, straight, packing .. ": resumed checksum")
  end
  local out, st = train(1, ("--steps 6 --packing pad --resume %s"):format(q(dir ..
                        "pack/step-000003")))
  assert(st == 2 and out:find("the checkpoint's data position (--packing pack", 1, true), out)
  -- other examples, as many of them: the checkpoint's fingerprint of its
  -- data refuses them (the position would pick other examples); the same
  -- bytes under another name resume bitwise
  local other = {}
  for i = 1, 60 do
    other[i] = { prompt = ("Q: %d minus %d?\n"):format(i + 9, i), completion = ("A: %d."):format(9) }
  end
  local other_path = jsonl("other.jsonl", other)
  out, st = support.sh(("cd %s && %s scripts/train.lua --model gpt2-nano --n-layer 2 --n-embd 64 " ..
    "--n-head 4 --context 64 --seq-len 32 --sample 0 --eval-batches 1 --seed 7 --micro-batch 2 " ..
    "--steps 6 --packing pack --data %s --resume %s"):format(q(lz.root), q(lz.executable()),
    q(other_path), q(dir .. "pack/step-000003")))
  eq(st, 2, "another --data of as many examples: " .. out)
  assert(out:find("train: --resume " .. dir .. "pack/step-000003: the checkpoint trained on " ..
                  path .. " (size:xxh64 ", 1, true) and
         out:find("--data " .. other_path .. " is other data", 1, true), out)
  local copy = write("copy.jsonl", lz.read_file(path))
  out, st = support.sh(("cd %s && %s scripts/train.lua --model gpt2-nano --n-layer 2 --n-embd 64 " ..
    "--n-head 4 --context 64 --seq-len 32 --sample 0 --eval-batches 1 --seed 7 --micro-batch 2 " ..
    "--steps 6 --packing pack --data %s --resume %s"):format(q(lz.root), q(lz.executable()),
    q(copy), q(dir .. "pack/step-000003")))
  assert(st == 0, out)
  out, st = support.sh(("cd %s && %s scripts/train.lua --model gpt2-nano --n-layer 1 " ..
    "--steps 1 --seq-len 8 --data %s"):format(q(lz.root), q(lz.executable()), q(path)))
  assert(st == 2 and out:find("train: data: " .. path .. ":1: the example is 18 tokens, " ..
         "longer than the sequence length 8; raise --seq-len to 18 or drop the line", 1, true),
         out)
  local corpus = write("c.txt", ("plain text "):rep(100))
  out, st = support.sh(("cd %s && %s scripts/train.lua --model gpt2-nano --n-layer 1 " ..
    "--steps 1 --packing pad --data %s"):format(q(lz.root), q(lz.executable()), q(corpus)))
  assert(st == 2 and out:find("--packing pad applies to instruction data", 1, true), out)
end

-- Instruction data trains on the mean over the step's trained targets: the
-- same loss and gradient norm whatever the split into ranks and
-- micro-batches (before, each micro-batch's mean counted alike: 1 rank x 4
-- and 2 ranks x 2 parted in the third digit).
function T.instruction_data_loss_is_the_same_at_any_split()
  local lines = {}
  for i = 1, 40 do
    lines[i] = { prompt = ("Q%s?\n"):format(("x"):rep(i % 7 + 1)),
                 completion = ("A%s."):format(("y"):rep((i * 5) % 11 + 1)) }
  end
  local path = jsonl("split.jsonl", lines)
  local _, ok_train = support.trainer("--model gpt2-nano --n-layer 1 --n-embd 32 --n-head 2 " ..
    "--context 32 --seq-len 32 --sample 0 --eval-batches 1 --seed 3 --steps 2 --data " .. q(path))
  local got = {}
  for _, run in ipairs({ { 1, "--micro-batch 4" }, { 1, "--micro-batch 2 --grad-accum 2" },
                         { 1, "--micro-batch 1 --grad-accum 4" }, { 2, "--micro-batch 2" } }) do
    local log = ("%s/split-%d.jsonl"):format(tmp, #got)
    -- (one thread a rank in every run: on some CPUs oneDNN's sgemm splits a
    -- small product's sums by the thread count; docs/zero.md)
    local _, sum = ok_train(run[1], run[2] .. " --log " .. q(log), "OMP_NUM_THREADS=1")
    local rec = support.records(log)[1]
    got[#got + 1] = { what = run[1] .. " rank(s) " .. run[2], loss = rec.loss,
                      norm = rec.grad_norm, sum = sum }
  end
  for _, g in ipairs(got) do
    assert(math.abs(g.loss - got[1].loss) <= 1e-6 * got[1].loss and
           math.abs(g.norm - got[1].norm) <= 1e-5 * got[1].norm,
           ("%s: step 1 loss %.9g norm %.9g, against %s's %.9g and %.9g"):format(
             g.what, g.loss, g.norm, got[1].what, got[1].loss, got[1].norm))
  end
  eq(got[4].sum, got[2].sum, "2 ranks x 2 against 1 rank x 2 x 2 accumulated")
end

-- A byte model's text: bytes as they are, or (for a terminal, train.lua's
-- sample) control bytes other than newline and tab as \xNN.
function T.decode_bytes_escapes_control_bytes_when_asked()
  local ids = { 72, 27, 91, 50, 74, 10, 9, 0, 127, 300, 233 }
  assert(data.decode_bytes(ids) == "H\27[2J\n\t\0\127?\233")
  local shown = data.decode_bytes(ids, true)
  assert(shown == "H\\x1b[2J\n\t\\x00\\x7f?\233", shown)
end

return T
