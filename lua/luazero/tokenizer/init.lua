-- tokenizer — a Hugging Face tokenizer.json BPE tokenizer: encode text to
-- ids (and each token's byte offset) and decode ids to text, as tokenizers
-- 0.19 does.
--
--   local tokenizer = require("luazero.tokenizer")
--   local tok = tokenizer.load("tokenizer.json")
--   local ids = tok:encode("Hello world")   -- { 15496, 995 }, 0-based ids
--   local ids, starts = tok:encode("Hi<|eot_id|>", { offsets = true })
--   local text = tok:decode(ids)             -- { skip_special_tokens = true } drops them
--   tok:vocab_size()                         -- largest id + 1
--   tok.bos_id, tok.eos_id                   -- nil when the tokenizer has none
--
-- Two kinds of BPE (model.type "BPE": vocab, merges as "a b" strings or
-- [a, b] lists, ignore_merges, unk_token, fuse_unk, byte_fallback):
--  * byte-level (GPT-2, Llama 3, Qwen2/2.5/3): no normalizer or NFC (Qwen2's,
--    tokenizer/nfc.lua), the ByteLevel pre-tokenizer (GPT-2's split,
--    add_prefix_space, use_regex) or a Sequence [Split (Llama 3's or Qwen2's
--    pattern), ByteLevel]; a ByteLevel or absent decoder (tokenizer/split.lua);
--  * SentencePiece-style (Llama 2, Mistral, TinyLlama, Phi-3, Gemma): "▁" for
--    spaces by a Prepend/Replace normalizer (with Gemma's Split on " "), or a
--    Metaspace pre-tokenizer, characters missing from the vocabulary as
--    <0xNN> byte tokens or the unknown token, decoded by
--    Replace/ByteFallback/Fuse/Strip or Metaspace (tokenizer/sentencepiece.lua).
-- added_tokens are matched in the text before anything else (leftmost, then
-- longest) and are one id each; one with lstrip or rstrip (Phi-3's <|end|>)
-- takes the blanks before or after it along. A post-processor (ByteLevel,
-- TemplateProcessing) adds nothing: encode gives the text's ids alone, as
-- tokenizers' encode(text, add_special_tokens=False). Anything else is
-- refused naming the field.
--
-- starts[i] (encode with offsets) is the 0-based byte offset in text of the
-- first byte token i covers; a token made only of text the normalizer added
-- (a prepended "▁") starts where the text it stands before starts.
local oneline = require("luazero.io.oneline")
local cjson = require("cjson")
local split = require("luazero.tokenizer.split")
local bpe = require("luazero.tokenizer.bpe")
local sp = require("luazero.tokenizer.sentencepiece")

local byte, char, sub, concat = string.byte, string.char, string.sub, table.concat
local unbyte, split_gpt2, split_llama3 = split.unbyte, split.split_gpt2, split.split_llama3

local M = {}

local function fail(path, msg) error(oneline.of("tokenizer: " .. path .. ": " .. msg), 0) end

local Tokenizer = {}
Tokenizer.__index = Tokenizer

local PAIR = bpe.PAIR
local SPACE_BYTE = 32

-- The ids (and byte lengths, and the bytes before the first) of one word,
-- cached by its text.
local function word_ids(self, word)
  local cached = self.cache[word]
  if cached then return cached[1], cached[2], cached[3] end
  local ids, lens, lead
  if self.byte_level then ids, lens, lead = bpe.byte_word(self, word)
  else ids, lens, lead = bpe.char_word(self, word) end
  if #word <= 256 then
    self.cache_size = self.cache_size + 1
    if self.cache_size > self.cache_limit then self.cache, self.cache_size = {}, 0 end
    self.cache[word] = { ids, lens, lead }
  end
  return ids, lens, lead
end

-- Appends the ids of word (bytes i..j of s) to out, and when starts is
-- given their offsets: map[k] is the original offset of byte k of s (or
-- nil: s is the original from byte start on, shifted by shift).
local function emit_word(self, s, i, j, out, starts, map, start, shift)
  if j < i then return end
  local ids, lens, lead = word_ids(self, sub(s, i, j))
  local m = #out
  for k = 1, #ids do out[m + k] = ids[k] end
  if starts then
    local pos = i + lead -- byte of s where the next token starts
    for k = 1, #ids do
      local at
      if map then
        at = map[pos] or (start + #s) -- past the end: an empty word
      else
        at = start + math.max(pos - 1 - shift, 0)
      end
      starts[m + k] = at
      pos = pos + lens[k]
    end
  end
end

-- Unicode White_Space (Rust's char::is_whitespace, which lstrip and rstrip
-- use), by code point.
local WHITE = { [9] = true, [10] = true, [11] = true, [12] = true, [13] = true, [32] = true,
                [0x85] = true, [0xA0] = true, [0x1680] = true, [0x2028] = true, [0x2029] = true,
                [0x202F] = true, [0x205F] = true, [0x3000] = true }
for cp = 0x2000, 0x200A do WHITE[cp] = true end

-- The byte after the blanks of text from byte p on.
local function blanks_after(text, p)
  while p <= #text do
    local cp, l = split.code_point(text, p)
    if not WHITE[cp] then break end
    p = p + l
  end
  return p
end

-- The first byte of the blanks of text that end just before byte p.
local function blanks_before(text, p)
  while p > 1 do
    local q = p - 1
    while q > 1 and byte(text, q) >= 0x80 and byte(text, q) < 0xC0 do q = q - 1 end
    if not WHITE[(split.code_point(text, q))] then break end
    p = q
  end
  return p
end

-- Where the added tokens of by_prefix occur in text: leftmost first, the
-- longest at a place. A hit is { first byte, length, id, first byte of the
-- token itself }: a token with lstrip or rstrip takes the blanks before or
-- after it along (they give no token), as tokenizers' AddedVocabulary does.
local function find_added(by_prefix, text)
  local hits = {}
  for prefix, group in pairs(by_prefix) do
    local init = 1
    while true do
      local p = text:find(prefix, init, true)
      if not p then break end
      for _, a in ipairs(group) do -- longest first
        if sub(text, p, p + #a.content - 1) == a.content then
          local first, after = p, p + #a.content
          if a.lstrip then first = blanks_before(text, p) end
          if a.rstrip then after = blanks_after(text, after) end
          hits[#hits + 1] = { first, after - first, a.id, p, #a.content }
          break
        end
      end
      init = p + 1
    end
  end
  table.sort(hits, function(x, y) return x[4] < y[4] or (x[4] == y[4] and x[5] > y[5]) end)
  return hits
end

-- Encodes bytes a..b of normalized text norm (its byte map: map).
local function encode_normalized(self, norm, map, a, b, out, starts, start)
  if b < a then return end
  local piece, piece_map = sub(norm, a, b), nil
  if map then
    piece_map = {}
    for k = a, b do piece_map[k - a + 1] = map[k] end
    start = map[a]
  end
  if self.byte_level then
    if self.add_prefix_space and byte(piece, 1) ~= SPACE_BYTE then
      piece = " " .. piece
      if piece_map then table.insert(piece_map, 1, piece_map[1]) end
    end
    if not self.split then return emit_word(self, piece, 1, #piece, out, starts, piece_map, start, 0) end
    self.split(piece, function(_, i, j) emit_word(self, piece, i, j, out, starts, piece_map, start, 0) end)
    return
  end
  local s, smap, words = sp.pre_tokenize(self, piece, piece_map, start)
  for _, w in ipairs(words) do emit_word(self, s, w[1], w[2], out, starts, smap, start, 0) end
end

-- Encodes text[p, q] (1-based, inclusive), which holds no added token
-- matched on the text as written.
local function encode_plain(self, text, p, q, out, starts)
  if q < p then return end
  local s, start = sub(text, p, q), p - 1
  if self.byte_level and not self.normalizers then
    local shift = 0
    if self.add_prefix_space and byte(s, 1) ~= SPACE_BYTE then s, shift = " " .. s, 1 end
    if not self.split then return emit_word(self, s, 1, #s, out, starts, nil, start, shift) end
    self.split(s, function(_, i, j) emit_word(self, s, i, j, out, starts, nil, start, shift) end)
    return
  end
  local norm, map = sp.normalize(self, s, start, starts ~= nil or self.added_normalized ~= nil)
  local at = 1
  if self.added_normalized then -- added tokens matched on the normalized text
    for _, h in ipairs(find_added(self.added_normalized, norm)) do
      if h[4] >= at then
        local first = math.max(h[1], at) -- blanks a token before it took are not taken again
        encode_normalized(self, norm, map, at, first - 1, out, starts, start)
        out[#out + 1] = h[3]
        if starts then starts[#out] = map[first] end
        at = h[1] + h[2]
      end
    end
  end
  encode_normalized(self, norm, map, at, #norm, out, starts, start)
end

function Tokenizer:encode(text, opts)
  if type(text) ~= "string" then
    error("tokenizer: encode(text) needs a string (got " .. type(text) .. ")", 2)
  end
  local starts = opts and opts.offsets and {} or nil
  local out, p = {}, 1
  if self.added_by_prefix then
    for _, h in ipairs(find_added(self.added_by_prefix, text)) do
      if h[4] >= p then
        local first = math.max(h[1], p) -- blanks a token before it took are not taken again
        encode_plain(self, text, p, first - 1, out, starts)
        out[#out + 1] = h[3]
        if starts then starts[#out] = first - 1 end
        p = h[1] + h[2]
      end
    end
  end
  encode_plain(self, text, p, #text, out, starts)
  if starts then return out, starts end
  return out
end

function Tokenizer:decode(ids, opts)
  local skip = opts and opts.skip_special_tokens
  local parts, bytes_of, special = {}, self.bytes_of, self.special
  for i = 1, #ids do
    local b = bytes_of[ids[i]]
    if not b then
      error(("tokenizer: decode: id %s at position %d is not in the vocabulary (0..%d)")
            :format(tostring(ids[i]), i, self.size - 1), 2)
    end
    if not (skip and special[ids[i]]) then parts[#parts + 1] = b end
  end
  if self.decode_tokens then return self.decode_tokens(parts) end
  -- (the ByteLevel decoder's bytes as String::from_utf8_lossy reads them: a
  -- character cut by the end, or a lone byte's token, is one U+FFFD)
  local s = concat(parts)
  if not sp.valid_utf8(s) then s = sp.lossy_utf8(s) end
  return s
end

function Tokenizer:vocab_size() return self.size end

-- The id of a token given as its text (an added token, raw bytes for a
-- byte-level vocabulary, the vocabulary's own text otherwise), or nil.
function Tokenizer:token_id(text) return self.added_id[text] or self.by_bytes[text] end

--------------------------------------------------------------- loading

-- The type of an optional part of the file, refused unless it is one of
-- supported (or absent, where null_ok).
local function check_type(path, field, value, supported, null_ok)
  if (value == nil or value == cjson.null) and null_ok then return nil end
  local t = type(value) == "table" and value.type or nil
  for _, s in ipairs(supported) do if t == s then return t end end
  local names = {}
  for _, s in ipairs(supported) do names[#names + 1] = '"' .. s .. '"' end
  if null_ok then names[#names + 1] = "null" end
  fail(path, ("%s is %s; supported: %s"):format(field,
    t and ('"' .. tostring(t) .. '"') or (value == nil or value == cjson.null) and "null" or
    "without a type", concat(names, " or ")))
end

local function is_set(v) return v ~= nil and v ~= cjson.null and v ~= false and v ~= "" end


-- The pre-tokenizer: "byte_level" (with its split) or "metaspace" (with its
-- settings) or nil (none: a SentencePiece-style model on the whole text).
local function pre_tokenizer(path, pre)
  -- Llama 3: Sequence [Split(its pattern, Isolated), ByteLevel(use_regex false)].
  if type(pre) == "table" and pre.type == "Sequence" and type(pre.pretokenizers) == "table" then
    local list = pre.pretokenizers
    if #list == 1 and type(list[1]) == "table" and list[1].type == "Metaspace" then
      return pre_tokenizer(path, list[1])
    end
    local sp1, bl = list[1], list[2]
    local pattern = type(sp1) == "table" and type(sp1.pattern) == "table" and sp1.pattern.Regex
    local how = pattern and split.SPLIT_PATTERNS[pattern]
    if not (#list == 2 and sp1.type == "Split" and how and
            sp1.behavior == "Isolated" and sp1.invert ~= true and type(bl) == "table" and
            bl.type == "ByteLevel" and bl.use_regex == false and bl.add_prefix_space ~= true) then
      -- (ByteLevel's add_prefix_space there would prefix every split piece)
      fail(path, "pre_tokenizer is a Sequence other than Llama 3's or Qwen2's; supported: " ..
                 "\"ByteLevel\", \"Metaspace\", Split (a string, MergedWithPrevious), or " ..
                 "Sequence [Split (Llama 3's or Qwen2's pattern, Isolated), ByteLevel " ..
                 "(use_regex false, add_prefix_space false)]")
    end
    return "byte_level", how, bl
  end
  local t = check_type(path, "pre_tokenizer", pre, { "ByteLevel", "Metaspace", "Split" }, true)
  if t == "ByteLevel" then return "byte_level", pre.use_regex ~= false and split_gpt2 or nil, pre end
  if t == "Metaspace" then return "metaspace", sp.metaspace(path, "pre_tokenizer", pre) end
  if t == "Split" then return "split", sp.split_string(path, "pre_tokenizer", pre) end
  return nil
end

-- bos and eos: from tokenizer_config.json beside the file, else the first
-- special token of a TemplateProcessing, else the usual names.
local function special_ids(self, path, j)
  local bos, eos
  local folder = path:match("^(.*)/[^/]*$") or "."
  local f = io.open(folder .. "/tokenizer_config.json", "rb")
  if f then
    local ok, c = pcall(cjson.decode, f:read("*a"))
    f:close()
    if ok and type(c) == "table" then
      local function text(v)
        if type(v) == "table" then v = v.content end
        return type(v) == "string" and v or nil
      end
      bos, eos = text(c.bos_token), text(c.eos_token)
      if c.bos_token == cjson.null then bos = false end
      if c.eos_token == cjson.null then eos = false end
    end
  end
  local post = j.post_processor
  if bos == nil and type(post) == "table" and post.type == "TemplateProcessing" and
     type(post.single) == "table" and type(post.single[1]) == "table" and
     type(post.single[1].SpecialToken) == "table" then
    bos = post.single[1].SpecialToken.id
  end
  local function named(names)
    for _, n in ipairs(names) do if self.added_id[n] then return n end end
  end
  if bos == nil then bos = named({ "<s>", "<|begin_of_text|>", "<bos>", "<|endoftext|>" }) end
  if eos == nil then eos = named({ "</s>", "<|end_of_text|>", "<eos>", "<|endoftext|>" }) end
  self.bos_id = bos and self:token_id(bos) or nil
  self.eos_id = eos and self:token_id(eos) or nil
  -- The special tokens the post-processor's template puts around one
  -- sequence (TemplateProcessing's "single": [<s>, $A] gives prefix {id of
  -- <s>}), which tokenizers' encode(text) adds (add_special_tokens=True).
  local tmpl = type(post) == "table" and post.type == "TemplateProcessing" and post or nil
  if type(post) == "table" and post.type == "Sequence" then
    for _, p in ipairs(post.processors or {}) do
      if type(p) == "table" and p.type == "TemplateProcessing" then tmpl = p end
    end
  end
  self.single_prefix, self.single_suffix = {}, {}
  if tmpl and type(tmpl.single) == "table" then
    local side = self.single_prefix
    for _, piece in ipairs(tmpl.single) do
      if type(piece) == "table" and type(piece.Sequence) == "table" then
        side = self.single_suffix
      elseif type(piece) == "table" and type(piece.SpecialToken) == "table" then
        local name = piece.SpecialToken.id
        local spec = type(tmpl.special_tokens) == "table" and tmpl.special_tokens[name]
        local ids = type(spec) == "table" and type(spec.ids) == "table" and spec.ids or
                    { self:token_id(name) }
        for _, id in ipairs(ids) do side[#side + 1] = id end
      end
    end
  end
end

function M.load(path)
  local f, err = io.open(path, "rb")
  if not f then fail(path, "cannot read it (" .. tostring(err) .. "); give a tokenizer.json") end
  local text = f:read("*a")
  f:close()
  local ok, j = pcall(cjson.decode, text)
  if not ok or type(j) ~= "table" then
    fail(path, "is not JSON (" .. tostring(j) .. "); give a Hugging Face tokenizer.json")
  end
  local model = j.model
  if type(model) ~= "table" then fail(path, "has no \"model\"; give a Hugging Face tokenizer.json") end
  if model.type ~= "BPE" then
    fail(path, ("model.type is %s; supported: \"BPE\""):format(cjson.encode(model.type or cjson.null)))
  end
  for _, field in ipairs({ "continuing_subword_prefix", "end_of_word_suffix", "dropout" }) do
    if is_set(model[field]) then
      fail(path, ("model.%s is %s; supported: null"):format(field, cjson.encode(model[field])))
    end
  end
  local kind, how, pre = pre_tokenizer(path, j.pre_tokenizer)
  local normalizers = sp.normalizer(path, j.normalizer)
  -- Post-processors add nothing here: encode is the text's ids alone
  -- (tokenizers' encode(text, add_special_tokens=False)).
  local post = j.post_processor
  if type(post) == "table" and post.type == "Sequence" and type(post.processors) == "table" then
    for i, p in ipairs(post.processors) do
      check_type(path, ("post_processor.processors[%d]"):format(i), p,
                 { "ByteLevel", "TemplateProcessing" }, false)
    end
  else
    check_type(path, "post_processor", post, { "ByteLevel", "TemplateProcessing", "Sequence" }, true)
  end

  local self = setmetatable({
    byte_level = kind == "byte_level",
    add_prefix_space = kind == "byte_level" and pre.add_prefix_space == true,
    split = kind == "byte_level" and how or nil,
    metaspace = kind == "metaspace" and how or nil,
    split_string = kind == "split" and how or nil,
    normalizers = normalizers,
    ignore_merges = model.ignore_merges == true,
    fuse_unk = model.fuse_unk == true,
    cache = {}, cache_size = 0, cache_limit = 2 ^ 20,
    by_bytes = {}, by_text = {}, bytes_of = {}, byte_id = {}, merge_rank = {}, merge_result = {},
    added_id = {}, special = {}, size = 0,
  }, Tokenizer)
  if self.byte_level then
    check_type(path, "decoder", j.decoder, { "ByteLevel" }, true)
  else
    self.decode_tokens = sp.decoder(path, j.decoder)
  end

  if type(model.vocab) ~= "table" then fail(path, "model.vocab is missing; give a BPE vocabulary") end
  local by_text = model.vocab
  self.by_text = by_text
  for t, id in pairs(by_text) do
    if type(id) ~= "number" or id < 0 or id >= PAIR or id % 1 ~= 0 then
      fail(path, ("model.vocab[%q] is %s; ids are integers 0..%d"):format(t, tostring(id), PAIR - 1))
    end
    local b = self.byte_level and unbyte(t) or t
    self.by_bytes[b], self.bytes_of[id] = id, b
    if id + 1 > self.size then self.size = id + 1 end
  end
  for b = 0, 255 do self.byte_id[b] = self.by_bytes[char(b)] end
  if model.byte_fallback == true and not self.byte_level then
    self.byte_token = {}
    for b = 0, 255 do self.byte_token[b] = by_text[("<0x%02X>"):format(b)] end
  end
  if is_set(model.unk_token) then self.unk_id = by_text[model.unk_token] end
  local merges = model.merges
  if type(merges) ~= "table" then fail(path, "model.merges is missing; give the BPE merges") end
  for rank, m in ipairs(merges) do
    local a, b
    if type(m) == "string" then
      a, b = m:match("^([^ ]+) ([^ ]+)$")
    elseif type(m) == "table" then
      a, b = m[1], m[2]
    end
    if type(a) ~= "string" or type(b) ~= "string" then
      fail(path, ("model.merges[%d] is %s; supported: \"a b\" or [\"a\", \"b\"]")
                 :format(rank, cjson.encode(m)))
    end
    local ia, ib, ic = by_text[a], by_text[b], by_text[a .. b]
    if not (ia and ib and ic) then
      fail(path, ("model.merges[%d] (%s %s) names a token missing from model.vocab (%s)")
                 :format(rank, a, b, not ia and a or not ib and b or a .. b))
    end
    -- a pair listed twice takes its last rank, as the tokenizers library's
    -- merge map does (later entries overwrite earlier ones)
    local key = ia * PAIR + ib
    self.merge_rank[key], self.merge_result[key] = rank, ic
  end

  local added = j.added_tokens
  if added ~= nil and added ~= cjson.null then
    if type(added) ~= "table" then
      fail(path, ("added_tokens is %s; give a list of tokens"):format(cjson.encode(added)))
    end
    local by_prefix, by_prefix_normalized = {}, {}
    for i, a in ipairs(added) do
      if type(a) ~= "table" or type(a.content) ~= "string" or a.content == "" or
         type(a.id) ~= "number" then
        fail(path, ("added_tokens[%d] needs a non-empty \"content\" and an \"id\""):format(i))
      end
      if a.id < 0 or a.id >= PAIR or a.id % 1 ~= 0 then
        fail(path, ("added_tokens[%d] (%s) has id %s; ids are integers 0..%d")
                   :format(i, a.content, tostring(a.id), PAIR - 1))
      end
      if a.single_word == true then
        fail(path, ("added_tokens[%d] (%s) has single_word true; supported: false")
                   :format(i, a.content))
      end
      if a.special == true then self.special[a.id] = true end
      -- With a normalizer, a normalized token is matched on the normalized
      -- text, as the normalizer writes it (tokenizers' AddedVocabulary).
      local group, content = by_prefix, a.content
      if a.normalized == true and normalizers then
        group, content = by_prefix_normalized, (sp.normalize(self, content, 0, false))
      end
      local prefix = sub(content, 1, 2)
      group[prefix] = group[prefix] or {}
      table.insert(group[prefix], { content = content, id = a.id, lstrip = a.lstrip == true,
                                    rstrip = a.rstrip == true })
      self.added_id[a.content], self.bytes_of[a.id] = a.id, a.content
      if a.id + 1 > self.size then self.size = a.id + 1 end
    end
    for _, groups in ipairs({ by_prefix, by_prefix_normalized }) do
      for _, group in pairs(groups) do
        table.sort(group, function(x, y) return #x.content > #y.content end)
      end
    end
    if next(by_prefix) then self.added_by_prefix = by_prefix end
    if next(by_prefix_normalized) then self.added_normalized = by_prefix_normalized end
  end
  special_ids(self, path, j)
  return self
end

M.split_gpt2, M.split_llama3, M.split_qwen2 = split_gpt2, split_llama3, split.split_qwen2 -- for tests

return M

