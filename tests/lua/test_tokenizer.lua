-- test_tokenizer.lua — lua/luazero/tokenizer/ without Hugging Face's
-- tokenizers: the GPT-2, Llama 3 and Qwen2 splits against pieces worked out by hand
-- from their patterns, BPE merges on tiny tokenizer.json files (byte-level,
-- and SentencePiece-style with byte fallback, unknown tokens, Metaspace),
-- offsets, added tokens, decode and the refusals; a long text encoded piece
-- by piece (tokenizer/stream.lua) as it is whole. The expected ids are
-- tokenizers 0.19's for the same files; tests/ref/test_tokenizer.py compares
-- with tokenizers itself.
local cjson = require("cjson")
local tokenizer = require("luazero.tokenizer")
local support = dofile(require("luazero").root .. "/tests/lua/support.lua")

local T = {}

local function pieces(split, s)
  local out = {}
  split(s, function(t, i, j) out[#out + 1] = t:sub(i, j) end)
  return out
end

local function same(got, want)
  local a, b = cjson.encode(got), cjson.encode(want)
  assert(a == b, ("\nexpected: %s\n     got: %s"):format(b, a))
end

function T.gpt2_split()
  local split = tokenizer.split_gpt2
  same(pieces(split, "Hello world's  it'S 123x"),
       { "Hello", " world", "'s", " ", " it", "'", "S", " 123", "x" })
  same(pieces(split, "a  \n\nb  "), { "a", "  \n", "\n", "b", "  " })
  same(pieces(split, "café — naïve"), { "café", " —", " naïve" })
  same(pieces(split, "x\u{00A0}y ½"), { "x", "\u{00A0}", "y", " ½" })
  same(pieces(split, ""), {})
end

function T.llama3_split()
  local split = tokenizer.split_llama3
  same(pieces(split, "'T 12345678 \"Hi x.\n\n  \n\tfoo  bar"),
       { "'T", " ", "123", "456", "78", " \"", "Hi", " x", ".\n\n", "  \n", "\tfoo", " ", " bar" })
end

function T.qwen2_split()
  local split = tokenizer.split_qwen2
  same(pieces(split, "'T 12345 \"Hi x.\n\n  \n\tfoo  bar"),
       { "'T", " ", "1", "2", "3", "4", "5", " \"", "Hi", " x", ".\n\n", "  \n", "\tfoo", " ", " bar" })
end

-- NFC against Python's unicodedata.normalize("NFC", ...), and the offsets
-- tokenizers' alignments give: positional, so marks put into canonical order
-- take the places they move to, a composite the place of its first part.
function T.nfc()
  local nfc = require("luazero.tokenizer.nfc")
  local function norm(s) return (nfc.normalize(s, 0, false)) end
  same(norm("Cafe\u{301} A\u{30A} \u{2126} \u{1100}\u{1161}\u{11A8} \u{AC00}\u{11A8}"),
       "Caf\u{E9} \u{C5} \u{3A9} \u{AC01} \u{AC01}")
  same(norm("q\u{307}\u{323} \u{1E0B}\u{323} \u{958} \u{344} e\u{301}\u{301}"),
       "q\u{323}\u{307} \u{1E0D}\u{307} \u{915}\u{93C} \u{308}\u{301} \u{E9}\u{301}")
  same(norm("plain ASCII"), "plain ASCII")
  local s, map = nfc.normalize("xe\u{301}q\u{307}\u{323}", 10, true)
  same(s, "x\u{E9}q\u{323}\u{307}")
  same(map, { 10, 11, 11, 14, 15, 15, 17, 17 })
  -- Bytes of no well-formed character (Latin-1 text, a stray continuation
  -- byte, an overlong form, a surrogate, a cut-off character) stay as they
  -- are, and so do their neighbours; a mark after one composes with nothing.
  for _, bad in ipairs({ "caf\xe9 au lait, na\xefve r\xe9sum\xe9", "a\x80b", "\xC0\xAF x",
                         "\xED\xA0\x80 y", "\xF4\x90\x80\x80z", "ok \xF0\x9F\x98",
                         "\xff\u{301}e\u{301}" }) do
    local want = bad:gsub("e\u{301}", "\u{E9}")
    same(norm(bad), want)
  end
  local split = require("luazero.tokenizer.split")
  for s, len in pairs({ ["\u{E9}"] = 2, ["\u{20AC}"] = 3, ["\u{1F600}"] = 4, ["\xC1\xBF"] = 1,
                        ["\xE0\x9F\xBF"] = 1, ["\xED\xA0\x80"] = 1, ["\xF4\x90\x80\x80"] = 1,
                        ["\xE2\x82"] = 1, ["\x80"] = 1, ["\xF5\x80\x80\x80"] = 1 }) do
    support.eq(split.char_len(s, 1), len, ("char_len %q"):format(s))
  end
end

local function write(text)
  local path = os.tmpname()
  local f = assert(io.open(path, "wb"))
  f:write(text)
  f:close()
  return path
end

-- Vocabulary: the bytes a, b, c, space (Ġ), then merges "a b" -> ab, "Ġ ab" -> Ġab.
local function tiny(extra)
  local j = {
    added_tokens = { { id = 6, content = "<|eot|>", special = true } },
    pre_tokenizer = { type = "ByteLevel", add_prefix_space = false, use_regex = true },
    decoder = { type = "ByteLevel" },
    model = { type = "BPE", vocab = { a = 0, b = 1, c = 2, ["Ġ"] = 3, ab = 4, ["Ġab"] = 5 },
              merges = { "a b", { "Ġ", "ab" } } },
  }
  if extra then extra(j) end
  return write(cjson.encode(j))
end

function T.encode_and_decode()
  local tok = tokenizer.load(tiny())
  same(tok:encode("ab abc<|eot|>c ab"), { 4, 5, 2, 6, 2, 5 })
  assert(tok:decode({ 4, 5, 2, 6, 2, 5 }) == "ab abc<|eot|>c ab")
  assert(tok:vocab_size() == 7, tok:vocab_size())
  local ok, err = pcall(tok.decode, tok, { 99 })
  assert(not ok and tostring(err):find("id 99 at position 1 is not in the vocabulary", 1, true), err)
end

-- A merge listed twice takes its last rank, as the tokenizers library's
-- merge map does: "b b" listed again after "a b" merges after it.
-- The special tokens a TemplateProcessing post-processor puts around one
-- sequence (what transformers' tokenizer(text) adds; generate adds them to a
-- plain prompt where tokenizer_config.json has no add_bos_token).
function T.the_templates_specials_around_one_sequence()
  local tok = tokenizer.load(tiny(function(j)
    j.post_processor = { type = "TemplateProcessing",
      single = { { SpecialToken = { id = "<|eot|>", type_id = 0 } }, { Sequence = { id = "A", type_id = 0 } } },
      pair = { { Sequence = { id = "A", type_id = 0 } }, { Sequence = { id = "B", type_id = 1 } } },
      special_tokens = { ["<|eot|>"] = { id = "<|eot|>", ids = { 6 }, tokens = { "<|eot|>" } } } }
  end))
  same(tok.single_prefix, { 6 })
  same(tok.single_suffix, {})
  same(tokenizer.load(tiny()).single_prefix, {})
end

function T.a_repeated_merge_takes_its_last_rank()
  local function with(merges)
    return tokenizer.load(tiny(function(j) j.model.vocab.bb, j.model.merges = 7, merges end))
  end
  same(with({ "b b", "a b", "Ġ ab" }):encode("abb"), { 0, 7 })
  same(with({ "b b", "a b", "Ġ ab", { "b", "b" } }):encode("abb"), { 4, 1 })
end

function T.byte_level_offsets()
  local tok = tokenizer.load(tiny())
  local ids, starts = tok:encode("ab abc<|eot|>c ab", { offsets = true })
  same(ids, { 4, 5, 2, 6, 2, 5 })
  same(starts, { 0, 2, 5, 6, 13, 14 })
  assert(tok.bos_id == nil and tok.eos_id == nil)
  same(tok:decode(ids, { skip_special_tokens = true }), "ab abcc ab")
end

-- An added token with rstrip (Phi-3's <|end|>) takes the blanks after it
-- along, one with lstrip those before it; they give no token.
function T.added_tokens_strip_blanks()
  local tok = tokenizer.load(tiny(function(j)
    j.added_tokens = { { id = 6, content = "<|eot|>", special = true, rstrip = true },
                       { id = 7, content = "<|sys|>", special = true, lstrip = true } }
  end))
  local ids, starts = tok:encode("ab<|eot|>  c  <|sys|>ab", { offsets = true })
  same({ ids, starts }, { { 4, 6, 2, 7, 4 }, { 0, 2, 11, 12, 21 } })
  same(tok:encode("<|eot|> <|sys|>"), { 6, 7 })
end

-- Llama 2's layout (support.sentencepiece_tokenizer), unless edit changes it.
local function sentencepiece(edit)
  local j = support.sentencepiece_tokenizer()
  if edit then edit(j) end
  return write(cjson.encode(j))
end

-- ids, starts and both decodings of each text against want.
local function check_encodings(tok, want)
  for _, w in ipairs(want) do
    local ids, starts = tok:encode(w[1], { offsets = true })
    same({ w[1], ids, starts }, { w[1], w[2], w[3] })
    same(tok:encode(w[1]), w[2])
    same({ tok:decode(ids), tok:decode(ids, { skip_special_tokens = true }) }, { w[4], w[5] })
  end
end

function T.sentencepiece_llama2()
  local tok = tokenizer.load(sentencepiece())
  check_encodings(tok, {
    { "ab ab", { 263, 261, 263, 261 }, { 0, 1, 2, 4 }, "ab ab", "ab ab" },
    { " ab  c", { 259, 263, 261, 267, 262 }, { 0, 0, 2, 3, 5 }, " ab  c", " ab  c" },
    -- 日 is not a piece: its three bytes; the prepended ▁ starts where "c" does
    { "aé日b", { 263, 266, 233, 154, 168, 261 }, { 0, 1, 3, 4, 5, 6 }, "aé日b", "aé日b" },
    { "c</s>ab", { 259, 262, 2, 263, 261 }, { 0, 0, 1, 5, 6 }, "c</s> ab", "c ab" },
    { "", {}, {}, "", "" },
    { "</s>", { 2 }, { 0 }, "</s>", "" },
    { "x\u{301}", { 259, 123, 207, 132 }, { 0, 0, 1, 2 }, "x\u{301}", "x\u{301}" },
  })
  assert(tok.bos_id == 1 and tok.eos_id == 2 and tok:vocab_size() == 268)
  -- Lone or broken bytes decode as one U+FFFD each, as Rust's from_utf8 refuses them.
  same(tok:decode({ 233, 154, 261, 233, 154, 168 }), "\u{FFFD}\u{FFFD}b日")
end

-- What generate's --out writes (JSON holds UTF-8) and a byte-level decode
-- gives: each invalid sequence, its maximal subpart, becomes one U+FFFD (as
-- Rust's String::from_utf8_lossy and Python's decode("utf-8", "replace")),
-- valid text stays as it is.
function T.lossy_utf8_replaces_each_invalid_sequence()
  local S = require("luazero.tokenizer.sentencepiece")
  same(S.lossy_utf8("ab\230"), "ab\u{FFFD}")
  same(S.lossy_utf8("\230\151\165x\255\254y"), "日x\u{FFFD}\u{FFFD}y")
  same(S.lossy_utf8("\u{1F600} ok"), "\u{1F600} ok")
  same(S.lossy_utf8(""), "")
  -- a character cut after two of its three bytes, or three of four: one
  same(S.lossy_utf8("\230\157"), "\u{FFFD}")
  same(S.lossy_utf8("a\240\159\152b"), "a\u{FFFD}b")
  -- a surrogate (ED A0 80) and an overlong form (E0 80 80): one each byte
  same(S.lossy_utf8("\237\160\128"), ("\u{FFFD}"):rep(3))
  same(S.lossy_utf8("\224\128\128"), ("\u{FFFD}"):rep(3))
  -- a byte-level vocabulary's tokens ending inside a character
  local tok = tokenizer.load(tiny(function(j) j.model.vocab["æ"], j.model.vocab["¡"] = 7, 8 end))
  same(tok:decode({ 7, 8 }), "\u{FFFD}")
  same(tok:decode({ 0, 7 }), "a\u{FFFD}")
end

-- A completion read back (run/text.lua, what generate prints and --stop
-- matches) is the tokenizer's decode of the ids as one sequence: spaces
-- between pieces and characters of byte-fallback pieces kept; an id past the
-- vocabulary shows as <id> between runs decoded whole.
function T.completions_decode_as_one_sequence()
  local tok = tokenizer.load(sentencepiece())
  local text = require("luazero.run.text")
  local ids = { 263, 261, 259, 263, 261, 266, 233, 154, 168, 261 }
  same(text.decode(tok, ids), tok:decode(ids))
  same(text.decode(tok, ids), "ab  abé日b")
  same(text.decode(tok, { 263, 261, 9999, 259, 263, 261 }),
       tok:decode({ 263, 261 }) .. "<9999>" .. tok:decode({ 259, 263, 261 }))
end

function T.sentencepiece_metaspace()
  local tok = tokenizer.load(sentencepiece(function(j)
    j.normalizer = cjson.null
    j.pre_tokenizer = { type = "Metaspace", replacement = "▁", prepend_scheme = "first", split = true }
    j.decoder = { type = "Metaspace", replacement = "▁", prepend_scheme = "first", split = true }
  end))
  check_encodings(tok, {
    { "ab ab", { 263, 261, 263, 261 }, { 0, 1, 2, 4 }, "ab ab", "ab ab" },
    { " ab  c", { 263, 261, 259, 259, 262 }, { 0, 2, 3, 4, 5 }, "ab  c", "ab  c" },
    -- "first": no ▁ before the text after a special token
    { "c</s>ab", { 259, 262, 2, 264 }, { 0, 0, 1, 5 }, "c</s>ab", "cab" },
    { "<s>ab", { 1, 264 }, { 0, 3 }, "<s>ab", "ab" },
  })
end

function T.sentencepiece_unknown()
  local tok = tokenizer.load(sentencepiece(function(j) j.model.byte_fallback = false end))
  check_encodings(tok, {
    { "a日本b", { 263, 0, 261 }, { 0, 1, 7 }, "a<unk>b", "ab" }, -- fused
    { "日 本", { 259, 0, 259, 0 }, { 0, 0, 3, 4 }, "<unk> <unk>", " " },
  })
end

function T.heap_merges_equal_scanning_merges()
  -- Past 48 symbols the merges run on a heap: the same result as scanning.
  local bpe = require("luazero.tokenizer.bpe")
  local tok = tokenizer.load(sentencepiece())
  local alphabet = { "a", "b", "c", "▁" }
  math.randomseed(7)
  for _ = 1, 200 do
    local syms, lens = {}, {}
    for i = 1, math.random(2, 160) do
      local c = alphabet[math.random(#alphabet)]
      syms[i], lens[i] = tok.by_text[c], #c
    end
    local s2, l2 = { unpack(syms) }, { unpack(lens) }
    local n1 = bpe.merge_scan(tok, syms, lens, #syms)
    local n2 = bpe.merge_heap(tok, s2, l2, #s2)
    assert(n1 == n2 and n1 == #syms and n2 == #s2)
    same({ s2, l2 }, { syms, lens })
  end
  local word = ("ab"):rep(40) .. "c" .. (" ab"):rep(30)
  assert(tok:decode(tok:encode(word)) == word)
end

-- A word longer than bpe.LONG bytes (a whole text, without a
-- pre-tokenizer: Llama 2's layout) is merged in parts, cut only where no
-- merge reaches across: the ids and offsets of the whole word.
function T.long_words_merge_in_parts_to_the_same_tokens()
  local bpe = require("luazero.tokenizer.bpe")
  local tok = tokenizer.load(sentencepiece())
  local alphabet = { "a", "b", "c", " ", " ", "é", "x", "\n", "a", "b" }
  math.randomseed(11)
  local saved = bpe.LONG
  for _ = 1, 20 do
    local t = {}
    for i = 1, math.random(200, 3000) do t[i] = alphabet[math.random(#alphabet)] end
    local text = table.concat(t)
    bpe.LONG = 2 ^ 20
    local ids, starts = tok:encode(text, { offsets = true })
    bpe.LONG = math.random(8, 120)
    local ids2, starts2 = tok:encode(text, { offsets = true })
    bpe.LONG = saved
    same({ ids2, starts2 }, { ids, starts })
  end
end

-- tokenizer/stream.lua: a text fed in blocks of any size and cut into
-- pieces gives the ids of encoding it whole, for byte-level and
-- SentencePiece-style tokenizers, texts with and without newlines, long
-- blank runs, added tokens, and a tokenizer whose merges cross newlines and
-- spaces (where a cut's check must refuse places).
function T.stream_pieces_encode_as_the_whole_text()
  local stream = require("luazero.tokenizer.stream")
  local root = require("luazero").root .. "/tests/fixtures/tokenizer/"
  local uni = io.open(root .. "unicode_corpus.txt"):read("*a")
  local crossing = cjson.decode(io.open(root .. "byte_level.json"):read("*a"))
  crossing.pre_tokenizer.use_regex = false -- the whole text is one word
  local n = 300 -- (past the fixture's ids and its added token's)
  for _, m in ipairs({ "Ċ T", "s Ġ", "Ġ t", "e Ċ" }) do
    crossing.model.vocab[m:gsub(" ", "")] = n
    crossing.model.merges[#crossing.model.merges + 1] = m
    n = n + 1
  end
  local toks = {
    byte_level = tokenizer.load(root .. "byte_level.json"),
    sentencepiece = tokenizer.load(root .. "sentencepiece.json"),
    llama2 = tokenizer.load(sentencepiece()),
    metaspace_first = tokenizer.load(sentencepiece(function(j)
      j.normalizer = cjson.null
      j.pre_tokenizer = { type = "Metaspace", replacement = "▁", prepend_scheme = "first", split = true }
    end)),
    metaspace_always = tokenizer.load(sentencepiece(function(j)
      j.normalizer = cjson.null
      j.pre_tokenizer = { type = "Metaspace", replacement = "▁", prepend_scheme = "always", split = false }
    end)),
    crossing = tokenizer.load(write(cjson.encode(crossing))),
  }
  local rng = require("luazero.rng").new(7)
  local words = { "the", "The", "cat's", "sat", "on", "ab", "aba", "e", "Tea", "tset", "1234567",
                  "naïve", "日本語", "<|endoftext|>", "</s>", "x\u{00A0}y", ",", "--", "\t" }
  local function text_of(len, blanks)
    local parts = {}
    local size = 0
    while size < len do
      local w = words[rng:int(#words) + 1]
      local b = blanks[rng:int(#blanks) + 1]
      parts[#parts + 1] = w .. b
      size = size + #w + #b
    end
    return table.concat(parts)
  end
  local texts = {
    lines = text_of(30000, { " ", " ", " ", "\n", "\n\n", "  ", "\r\n", " \n" }),
    one_line = text_of(30000, { " ", " ", "  " }),
    unicode = (uni .. "\n"):rep(20),
    long_blanks = text_of(12000, { " ", "\n" }) .. (" "):rep(9000) .. text_of(12000, { " ", "\n" }),
    no_blanks = text_of(20000, { "", "." }),
    -- CJK lines longer than a window's widening: cut at character boundaries
    cjk = (function()
      local cjk, lines = { "日", "本", "語", "の", "テ", "キ", "ス", "ト", "。", "中", "文" }, {}
      for l = 1, 4 do
        local t = {}
        for _ = 1, 2500 do t[#t + 1] = cjk[rng:int(#cjk) + 1] end
        lines[l] = table.concat(t)
      end
      return table.concat(lines, "\n")
    end)(),
  }
  for tname, tok in pairs(toks) do
    for xname, text in pairs(texts) do
      local whole = tok:encode(text)
      for _, sizes in ipairs({ { 1000, 777 }, { 3000, 4096 }, { 50000, 100 } }) do
        local got, pieces = {}, 0
        local function emit(ids)
          pieces = pieces + 1
          for i = 1, #ids do got[#got + 1] = ids[i] end
        end
        local enc = stream.encoder(tok, { piece_bytes = sizes[1] })
        for at = 1, #text, sizes[2] do enc:feed(text:sub(at, at + sizes[2] - 1), emit) end
        enc:finish(emit)
        local what = ("%s on %s, pieces of %d fed by %d (%d pieces)")
                     :format(tname, xname, sizes[1], sizes[2], pieces)
        assert(#got == #whole, what .. (": %d ids, whole %d"):format(#got, #whole))
        for i = 1, #whole do
          if got[i] ~= whole[i] then error(what .. (": id %d differs"):format(i)) end
        end
        if sizes[1] == 1000 and xname ~= "no_blanks" and xname ~= "long_blanks" then
          assert(pieces > 5, what .. ": the text was not cut")
        end
        if xname == "cjk" and sizes[1] == 1000 and tname == "byte_level" then
          assert(pieces > 10, what .. ": the CJK text was not cut inside its lines")
        end
      end
    end
  end
end

function T.refusals_name_the_field()
  local cases = {
    { function(j) j.model.type = "Unigram" end, 'model.type is "Unigram"; supported: "BPE"' },
    { function(j) j.normalizer = { type = "NFKC" } end, 'normalizer is "NFKC"; supported: null' },
    { function(j) j.pre_tokenizer = { type = "Whitespace" } end,
      'pre_tokenizer is "Whitespace"; supported: "ByteLevel" or "Metaspace"' },
    { function(j) j.decoder = { type = "WordPiece" } end, 'decoder is "WordPiece"; supported: "ByteLevel"' },
    { function(j) j.model.merges = { "a" } end, 'model.merges[1] is "a"' },
    { function(j) j.model.continuing_subword_prefix = "##" end, "model.continuing_subword_prefix" },
    { function(j)
        j.pre_tokenizer = { type = "Sequence", pretokenizers = {
          { type = "Split", behavior = "Isolated", invert = false,
            pattern = { Regex = require("luazero.tokenizer.split").LLAMA3_PATTERN } },
          { type = "ByteLevel", add_prefix_space = true, use_regex = false } } }
      end, "ByteLevel (use_regex false, add_prefix_space false)" },
  }
  for _, c in ipairs(cases) do
    local ok, err = pcall(tokenizer.load, tiny(c[1]))
    assert(not ok and tostring(err):find(c[2], 1, true), tostring(err))
  end
  local ok, err = pcall(tokenizer.load, "/nonexistent/tokenizer.json")
  assert(not ok and tostring(err):find("cannot read it", 1, true), err)
end

return T
