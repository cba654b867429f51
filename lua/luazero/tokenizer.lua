-- tokenizer.lua — a Hugging Face tokenizer.json byte-level BPE tokenizer
-- (the kind GPT-2 uses): encode text to ids and decode ids to text.
--
--   local tokenizer = require("luazero.tokenizer")
--   local tok = tokenizer.load("tokenizer.json")
--   local ids = tok:encode("Hello world")   -- { 15496, 995 }, 0-based ids
--   local text = tok:decode(ids)
--   tok:vocab_size()                       -- largest id + 1
--
-- Supported: model.type "BPE" (vocab, merges as "a b" strings or [a, b]
-- lists, ignore_merges, unk_token), no normalizer, the ByteLevel
-- pre-tokenizer (GPT-2's split, add_prefix_space, use_regex) or Llama 3's
-- Sequence [Split (its pattern), ByteLevel], a ByteLevel or absent decoder,
-- and added_tokens, which are matched in the text before pre-tokenization
-- (leftmost, then longest). A post-processor (ByteLevel, TemplateProcessing)
-- adds nothing: encode gives the text's ids alone, as tokenizers'
-- encode(text, add_special_tokens=False). Anything else is refused naming the
-- field.
--
-- The split is GPT-2's pattern
--   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
-- done by hand over UTF-8 code points. \p{L} and \p{N} come from Unicode's
-- general categories (luazero.unicode_classes), \s is Unicode's White_Space.
local bit = require("bit")
local cjson = require("cjson")
local classes = require("luazero.unicode_classes")

local byte, char, sub, concat = string.byte, string.char, string.sub, table.concat
local band, bor, lshift = bit.band, bit.bor, bit.lshift

local M = {}

local OTHER, LETTER, NUMBER, SPACE = 0, 1, 2, 3

local function fail(path, msg) error("tokenizer: " .. path .. ": " .. msg, 0) end

--------------------------------------------------------------- characters

-- Unicode White_Space, the code points \s matches.
local WHITE = { [0x85] = true, [0xA0] = true, [0x1680] = true, [0x2028] = true,
                [0x2029] = true, [0x202F] = true, [0x205F] = true, [0x3000] = true }
for cp = 0x2000, 0x200A do WHITE[cp] = true end

local ascii_class = {}
for b = 0, 127 do
  local c = char(b)
  ascii_class[b] = c:match("%a") and LETTER or c:match("%d") and NUMBER or
                   (b == 32 or (b >= 9 and b <= 13)) and SPACE or OTHER
end

local starts, kinds = classes.starts, classes.classes
local class_cache = {}

local function class_of(cp)
  if cp < 128 then return ascii_class[cp] end
  local k = class_cache[cp]
  if k then return k end
  if WHITE[cp] then
    k = SPACE
  else
    local lo, hi = 1, #starts -- the last start <= cp
    while lo < hi do
      local mid = math.floor((lo + hi + 1) / 2)
      if starts[mid] <= cp then lo = mid else hi = mid - 1 end
    end
    k = kinds[lo]
  end
  class_cache[cp] = k
  return k
end

-- The code point at byte p of s and its length in bytes. A malformed byte
-- counts as a one-byte code point of its own value (it is still encoded).
local function code_point(s, p)
  local b = byte(s, p)
  if b < 0x80 then return b, 1 end
  if b >= 0xF0 then
    local b1, b2, b3 = byte(s, p + 1, p + 3)
    if b3 then
      return bor(lshift(band(b, 7), 18), lshift(band(b1, 63), 12), lshift(band(b2, 63), 6),
                 band(b3, 63)), 4
    end
  elseif b >= 0xE0 then
    local b1, b2 = byte(s, p + 1, p + 2)
    if b2 then return bor(lshift(band(b, 15), 12), lshift(band(b1, 63), 6), band(b2, 63)), 3 end
  elseif b >= 0xC0 then
    local b1 = byte(s, p + 1)
    if b1 then return bor(lshift(band(b, 31), 6), band(b1, 63)), 2 end
  end
  return b, 1
end

local function utf8_char(cp)
  if cp < 0x80 then return char(cp) end
  if cp < 0x800 then return char(0xC0 + math.floor(cp / 64), 0x80 + cp % 64) end
  return char(0xE0 + math.floor(cp / 4096), 0x80 + math.floor(cp / 64) % 64, 0x80 + cp % 64)
end

-- GPT-2's bytes-to-unicode: printable bytes stand for themselves, the others
-- for 256, 257, ... in byte order. unicode_byte is the inverse, by UTF-8 text.
local unicode_byte = {}
do
  local n = 0
  for b = 0, 255 do
    local printable = (b >= 33 and b <= 126) or (b >= 161 and b <= 172) or (b >= 174)
    local cp = b
    if not printable then cp = 256 + n; n = n + 1 end
    unicode_byte[utf8_char(cp)] = b
  end
end

-- A vocabulary entry in byte-level text back to the raw bytes it stands for;
-- a character outside the mapping stays as its own UTF-8 bytes.
local function unbyte(s)
  local out, p, n = {}, 1, #s
  while p <= n do
    local _, l = code_point(s, p)
    local c = sub(s, p, p + l - 1)
    local b = unicode_byte[c]
    out[#out + 1] = b and char(b) or c
    p = p + l
  end
  return concat(out)
end

--------------------------------------------------------------- pre-tokenizer

local APOSTROPHE, SPACE_BYTE = 39, 32
local CONTRACTION1 = { [115] = true, [116] = true, [109] = true, [100] = true } -- s t m d
local CONTRACTION2 = { ["re"] = true, ["ve"] = true, ["ll"] = true }

-- The byte after the run of class k that starts at byte r (r <= n + 1).
local function run_end(s, r, n, k)
  while r <= n do
    local c, l = code_point(s, r)
    if class_of(c) ~= k then break end
    r = r + l
  end
  return r
end

-- Calls emit(s, i, j) for each piece s:sub(i, j) of GPT-2's split of s.
local function split_gpt2(s, emit)
  local n, p = #s, 1
  while p <= n do
    local c, l = code_point(s, p)
    local q -- first byte after the piece
    if c == APOSTROPHE then
      local b1 = byte(s, p + 1)
      if b1 and CONTRACTION1[b1] then
        q = p + 2
      elseif CONTRACTION2[sub(s, p + 1, p + 2)] then
        q = p + 3
      end
    end
    if not q then
      local k, r = class_of(c), p + l
      if c == SPACE_BYTE and r <= n then -- " ?" before a run of letters, numbers or others
        local c2, l2 = code_point(s, r)
        local k2 = class_of(c2)
        if k2 ~= SPACE then k, r = k2, r + l2 end
      end
      if k ~= SPACE then
        r = run_end(s, r, n, k)
        q = r
      else -- \s+(?!\S) leaves the last blank before a non-blank to the next piece
        local last = p
        while r <= n do
          local c2, l2 = code_point(s, r)
          if class_of(c2) ~= SPACE then break end
          last, r = r, r + l2
        end
        if r <= n and last > p then q = last else q = r end
      end
    end
    emit(s, p, q - 1)
    p = q
  end
end

-- Llama 3's pattern, for a Split pre-tokenizer before ByteLevel:
--   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
--   ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
local LLAMA3_PATTERN = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|" ..
  "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
local CR, LF = 13, 10

local function is_newline(c) return c == CR or c == LF end

local function split_llama3(s, emit)
  local n, p = #s, 1
  while p <= n do
    local c, l = code_point(s, p)
    local k, r = class_of(c), p + l
    local q
    if c == APOSTROPHE then
      local b1 = byte(s, p + 1)
      if b1 and CONTRACTION1[bor(b1, 32)] then
        q = p + 2
      elseif CONTRACTION2[sub(s, p + 1, p + 2):lower()] then
        q = p + 3
      end
    end
    if not q and k ~= LETTER and k ~= NUMBER and not is_newline(c) and r <= n then
      local c2, l2 = code_point(s, r) -- [^\r\n\p{L}\p{N}]?\p{L}+
      if class_of(c2) == LETTER then k, r = LETTER, r + l2 end
    end
    if q then -- a contraction
    elseif k == LETTER then
      r = run_end(s, r, n, LETTER)
      q = r
    elseif k == NUMBER then
      for _ = 2, 3 do
        if r > n then break end
        local c2, l2 = code_point(s, r)
        if class_of(c2) ~= NUMBER then break end
        r = r + l2
      end
      q = r
    else
      if c == SPACE_BYTE and r <= n then -- " ?" before a run of others
        local c2, l2 = code_point(s, r)
        if class_of(c2) == OTHER then k, r = OTHER, r + l2 end
      end
      if k == OTHER then
        r = run_end(s, r, n, OTHER)
        while r <= n and is_newline(byte(s, r)) do r = r + 1 end
        q = r
      else -- a run of blanks: up to its last newline, else as GPT-2's
        local last, after_newline = p, is_newline(c) and r or nil
        while r <= n do
          local c2, l2 = code_point(s, r)
          if class_of(c2) ~= SPACE then break end
          last, r = r, r + l2
          if is_newline(c2) then after_newline = r end
        end
        if after_newline then
          q = after_newline
        elseif r <= n and last > p then
          q = last
        else
          q = r
        end
      end
    end
    emit(s, p, q - 1)
    p = q
  end
end

--------------------------------------------------------------- BPE

local Tokenizer = {}
Tokenizer.__index = Tokenizer

local PAIR = 2 ^ 24 -- pair key: left * PAIR + right (ids stay below 2^24)

-- Ids of one pre-token (raw bytes), appended to out; cached by its bytes.
local function bpe(self, word, out)
  local cached = self.cache[word]
  if not cached then
    local whole = self.ignore_merges and self.by_bytes[word]
    if whole then
      cached = { whole }
    else
      local syms, n = {}, 0
      local byte_id, unk = self.byte_id, self.unk_id
      for i = 1, #word do
        local id = byte_id[byte(word, i)] or unk
        if id then n = n + 1; syms[n] = id end
      end
      local rank, result = self.merge_rank, self.merge_result
      while n > 1 do
        local best, at = math.huge, 0
        for i = 1, n - 1 do
          local r = rank[syms[i] * PAIR + syms[i + 1]]
          if r and r < best then best, at = r, i end
        end
        if at == 0 then break end
        syms[at] = result[syms[at] * PAIR + syms[at + 1]]
        for i = at + 1, n - 1 do syms[i] = syms[i + 1] end
        syms[n] = nil
        n = n - 1
      end
      cached = syms
    end
    self.cache_size = self.cache_size + 1
    if self.cache_size > self.cache_limit then self.cache, self.cache_size = {}, 0 end
    self.cache[word] = cached
  end
  local m = #out
  for i = 1, #cached do out[m + i] = cached[i] end
end

-- Encodes a stretch of text without added tokens.
local function encode_plain(self, s, out)
  if #s == 0 then return end
  if self.add_prefix_space and byte(s, 1) ~= SPACE_BYTE then s = " " .. s end
  if not self.split then return bpe(self, s, out) end
  self.split(s, function(t, i, j) bpe(self, sub(t, i, j), out) end)
end

-- Where added tokens occur in text: leftmost first, the longest at a place.
local function find_added(self, text)
  local hits = {}
  for prefix, group in pairs(self.added_by_prefix) do
    local init = 1
    while true do
      local p = text:find(prefix, init, true)
      if not p then break end
      for _, a in ipairs(group) do -- longest first
        if sub(text, p, p + #a.content - 1) == a.content then
          hits[#hits + 1] = { p, #a.content, a.id }
          break
        end
      end
      init = p + 1
    end
  end
  table.sort(hits, function(x, y) return x[1] < y[1] or (x[1] == y[1] and x[2] > y[2]) end)
  return hits
end

function Tokenizer:encode(text)
  if type(text) ~= "string" then
    error("tokenizer: encode(text) needs a string (got " .. type(text) .. ")", 2)
  end
  local out, p = {}, 1
  if self.added_by_prefix then
    for _, h in ipairs(find_added(self, text)) do
      if h[1] >= p then
        encode_plain(self, sub(text, p, h[1] - 1), out)
        out[#out + 1] = h[3]
        p = h[1] + h[2]
      end
    end
  end
  encode_plain(self, sub(text, p), out)
  return out
end

function Tokenizer:decode(ids)
  local parts, bytes_of = {}, self.bytes_of
  for i = 1, #ids do
    local b = bytes_of[ids[i]]
    if not b then
      error(("tokenizer: decode: id %s at position %d is not in the vocabulary (0..%d)")
            :format(tostring(ids[i]), i, self.size - 1), 2)
    end
    parts[i] = b
  end
  return concat(parts)
end

function Tokenizer:vocab_size() return self.size end

-- The id of a token given as its text (an added token or raw bytes), or nil.
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
  for _, field in ipairs({ "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback",
                           "dropout" }) do
    if is_set(model[field]) then
      fail(path, ("model.%s is %s; supported: null (byte-level BPE without it)")
                 :format(field, cjson.encode(model[field])))
    end
  end
  check_type(path, "normalizer", j.normalizer, {}, true)
  local pre, split = j.pre_tokenizer, split_gpt2
  -- Llama 3: Sequence [Split(its pattern, Isolated), ByteLevel(use_regex false)].
  if type(pre) == "table" and pre.type == "Sequence" and type(pre.pretokenizers) == "table" and
     #pre.pretokenizers == 2 then
    local sp, bl = pre.pretokenizers[1], pre.pretokenizers[2]
    local pattern = type(sp) == "table" and type(sp.pattern) == "table" and sp.pattern.Regex
    if not (sp.type == "Split" and pattern == LLAMA3_PATTERN and sp.behavior == "Isolated" and
            sp.invert ~= true and type(bl) == "table" and bl.type == "ByteLevel" and
            bl.use_regex == false) then
      fail(path, "pre_tokenizer is a Sequence other than Llama 3's; supported: \"ByteLevel\", " ..
                 "or Sequence [Split (Llama 3's pattern, Isolated), ByteLevel (use_regex false)]")
    end
    pre, split = bl, split_llama3
  end
  check_type(path, "pre_tokenizer", pre, { "ByteLevel" }, false)
  if pre.use_regex == false and split == split_gpt2 then split = nil end
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
  check_type(path, "decoder", j.decoder, { "ByteLevel" }, true)

  local self = setmetatable({
    add_prefix_space = pre.add_prefix_space == true,
    split = split,
    ignore_merges = model.ignore_merges == true,
    cache = {}, cache_size = 0, cache_limit = 2 ^ 20,
    by_bytes = {}, bytes_of = {}, byte_id = {}, merge_rank = {}, merge_result = {},
    added_id = {}, size = 0,
  }, Tokenizer)

  if type(model.vocab) ~= "table" then fail(path, "model.vocab is missing; give a BPE vocabulary") end
  local by_text = model.vocab
  for t, id in pairs(by_text) do
    if type(id) ~= "number" or id < 0 or id >= PAIR or id % 1 ~= 0 then
      fail(path, ("model.vocab[%q] is %s; ids are integers 0..%d"):format(t, tostring(id), PAIR - 1))
    end
    local b = unbyte(t)
    self.by_bytes[b], self.bytes_of[id] = id, b
    if id + 1 > self.size then self.size = id + 1 end
  end
  for b = 0, 255 do self.byte_id[b] = self.by_bytes[char(b)] end
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
    local key = ia * PAIR + ib
    if not self.merge_rank[key] then self.merge_rank[key], self.merge_result[key] = rank, ic end
  end

  local added = j.added_tokens
  if added ~= nil and added ~= cjson.null then
    local by_prefix = {}
    for i, a in ipairs(added) do
      if type(a) ~= "table" or type(a.content) ~= "string" or a.content == "" or
         type(a.id) ~= "number" then
        fail(path, ("added_tokens[%d] needs a non-empty \"content\" and an \"id\""):format(i))
      end
      for _, field in ipairs({ "single_word", "lstrip", "rstrip" }) do
        if a[field] == true then
          fail(path, ("added_tokens[%d] (%s) has %s true; supported: false")
                     :format(i, a.content, field))
        end
      end
      local prefix = sub(a.content, 1, 2)
      by_prefix[prefix] = by_prefix[prefix] or {}
      table.insert(by_prefix[prefix], { content = a.content, id = a.id })
      self.added_id[a.content], self.bytes_of[a.id] = a.id, a.content
      if a.id + 1 > self.size then self.size = a.id + 1 end
    end
    for _, group in pairs(by_prefix) do
      table.sort(group, function(x, y) return #x.content > #y.content end)
    end
    if next(by_prefix) then self.added_by_prefix = by_prefix end
  end
  return self
end

M.split_gpt2, M.split_llama3 = split_gpt2, split_llama3 -- for tests

return M
