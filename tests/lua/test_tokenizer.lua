-- test_tokenizer.lua — lua/luazero/tokenizer.lua without Hugging Face's
-- tokenizers: the GPT-2 and Llama 3 splits against pieces worked out by hand
-- from their patterns, BPE merges on a tiny tokenizer.json, added tokens,
-- decode and the refusals. tests/ref/test_tokenizer.py compares with
-- tokenizers itself.
local cjson = require("cjson")
local tokenizer = require("luazero.tokenizer")

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

function T.refusals_name_the_field()
  local cases = {
    { function(j) j.model.type = "Unigram" end, 'model.type is "Unigram"; supported: "BPE"' },
    { function(j) j.normalizer = { type = "NFKC" } end, 'normalizer is "NFKC"; supported: null' },
    { function(j) j.model.merges = { "a" } end, 'model.merges[1] is "a"' },
    { function(j) j.model.continuing_subword_prefix = "##" end, "model.continuing_subword_prefix" },
  }
  for _, c in ipairs(cases) do
    local ok, err = pcall(tokenizer.load, tiny(c[1]))
    assert(not ok and tostring(err):find(c[2], 1, true), tostring(err))
  end
  local ok, err = pcall(tokenizer.load, "/nonexistent/tokenizer.json")
  assert(not ok and tostring(err):find("cannot read it", 1, true), err)
end

return T
