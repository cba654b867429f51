-- tokenizer/sentencepiece.lua — the text around a SentencePiece-style BPE
-- (Llama 2, Mistral, TinyLlama, Gemma) in a tokenizer.json: the normalizer
-- (Prepend, Replace, NFC — Qwen2's, before its byte-level BPE — a Sequence of
-- them), the Metaspace pre-tokenizer (" " to "▁", prepend_scheme first /
-- always / never, split at "▁"), Gemma's Split on a string, and the decoders
-- (Replace, ByteFallback, Fuse, Strip, Metaspace, a Sequence of them), as
-- tokenizers 0.19 runs them.
--
-- Normalizing keeps, when asked, where each byte of the result came from in
-- the original text (0-based), so encode can give each token's offset.
local cjson = require("cjson")
local nfc = require("luazero.tokenizer.nfc")

local S = {}

local sub, byte, concat = string.sub, string.byte, table.concat

local function fail(path, msg) error("tokenizer: " .. path .. ": " .. msg, 0) end

local function typename(v)
  if type(v) == "table" then return cjson.encode(v.type or cjson.null) end
  return cjson.encode(v == nil and cjson.null or v)
end

-- A Replace's string pattern (a Regex is refused).
local function pattern_string(path, field, spec)
  local pat = type(spec.pattern) == "table" and spec.pattern.String
  if type(pat) ~= "string" or pat == "" or type(spec.content) ~= "string" then
    fail(path, ("%s is a Replace of %s; supported: a non-empty {\"String\": ...} pattern")
               :format(field, cjson.encode(spec.pattern or cjson.null)))
  end
  return pat
end

-- The list of normalizer steps, or nil for none.
function S.normalizer(path, spec)
  if spec == nil or spec == cjson.null then return nil end
  local steps = {}
  local function add(field, n)
    if type(n) ~= "table" then fail(path, field .. " is not an object; give a tokenizer.json") end
    if n.type == "Sequence" and type(n.normalizers) == "table" then
      for i, m in ipairs(n.normalizers) do add(("%s.normalizers[%d]"):format(field, i), m) end
    elseif n.type == "Prepend" and type(n.prepend) == "string" then
      steps[#steps + 1] = { kind = "prepend", text = n.prepend }
    elseif n.type == "Replace" then
      steps[#steps + 1] = { kind = "replace", from = pattern_string(path, field, n), to = n.content }
    elseif n.type == "NFC" then
      steps[#steps + 1] = { kind = "nfc" }
    else
      fail(path, ("%s is %s; supported: null, \"NFC\", \"Prepend\", \"Replace\" (a string) " ..
                  "or a \"Sequence\" of them"):format(field, typename(n)))
    end
  end
  add("normalizer", spec)
  return steps
end

-- The Metaspace pre-tokenizer's settings.
function S.metaspace(path, field, spec)
  local rep = spec.replacement
  if type(rep) ~= "string" or rep == "" then
    fail(path, field .. ".replacement must be a character (Metaspace uses \"▁\")")
  end
  local scheme = spec.prepend_scheme
  if scheme == nil or scheme == cjson.null then
    scheme = spec.add_prefix_space == false and "never" or "always"
  end
  if scheme ~= "first" and scheme ~= "always" and scheme ~= "never" then
    fail(path, ("%s.prepend_scheme is %s; supported: \"first\", \"always\", \"never\"")
               :format(field, cjson.encode(scheme)))
  end
  return { replacement = rep, scheme = scheme, split = spec.split ~= false }
end

-- s with every from replaced by to; map (or nil) follows the bytes.
local function replace(s, map, from, to)
  if not s:find(from, 1, true) then return s, map end
  local out, omap, i = {}, map and {} or nil, 1
  while true do
    local p = s:find(from, i, true)
    local stop = p and p - 1 or #s
    out[#out + 1] = sub(s, i, stop)
    if omap then
      local m = #omap
      for k = i, stop do m = m + 1; omap[m] = map[k] end
      if p then for _ = 1, #to do m = m + 1; omap[m] = map[p] end end
    end
    if not p then break end
    out[#out + 1] = to
    i = p + #from
  end
  return concat(out), omap
end

local function prepend(s, map, text)
  if map then
    local omap, first = {}, map[1]
    for k = 1, #text do omap[k] = first end
    for k = 1, #map do omap[#text + k] = map[k] end
    map = omap
  end
  return text .. s, map
end

-- A piece of text (starting at byte offset start of the original, 0-based)
-- normalized, and its byte map when want_map.
function S.normalize(tok, s, start, want_map)
  local map
  if want_map then
    map = {}
    for k = 1, #s do map[k] = start + k - 1 end
  end
  for _, step in ipairs(tok.normalizers or {}) do
    if step.kind == "nfc" then
      if map then
        local norm, nmap = nfc.normalize(s, 0, true)
        for k = 1, #nmap do nmap[k] = map[nmap[k] + 1] end
        s, map = norm, nmap
      else
        s = nfc.normalize(s, 0, false)
      end
    elseif step.kind == "prepend" then
      if #s > 0 then s, map = prepend(s, map, step.text) end
    else
      s, map = replace(s, map, step.from, step.to)
    end
  end
  return s, map
end

-- A Split pre-tokenizer on a string, each piece ending with it (Gemma's
-- " ", MergedWithPrevious: after its Replace normalizer no " " is left, so
-- the text is one word, but the split is honoured as written).
function S.split_string(path, field, spec)
  local pat = type(spec.pattern) == "table" and spec.pattern.String
  if type(pat) ~= "string" or pat == "" or spec.behavior ~= "MergedWithPrevious" or
     spec.invert == true then
    fail(path, ("%s is a Split of %s, %s; supported: a {\"String\": ...} pattern, " ..
                "MergedWithPrevious, invert false"):format(field,
                cjson.encode(spec.pattern or cjson.null), cjson.encode(spec.behavior or cjson.null)))
  end
  return pat
end

-- Normalized text (from byte start of the original) pre-tokenized: the text
-- as the model sees it, its byte map, and the words as { i, j } ranges.
function S.pre_tokenize(tok, s, map, start)
  local sep = tok.split_string
  if sep then
    local words, i = {}, 1
    while i <= #s do
      local p = s:find(sep, i, true)
      local j = p and p + #sep - 1 or #s
      words[#words + 1] = { i, j }
      i = j + 1
    end
    return s, map, words
  end
  local ms = tok.metaspace
  if not ms then return s, map, { { 1, #s } } end
  local rep = ms.replacement
  s, map = replace(s, map, " ", rep)
  if #s > 0 and sub(s, 1, #rep) ~= rep and
     (ms.scheme == "always" or (ms.scheme == "first" and start == 0)) then
    s, map = prepend(s, map, rep)
  end
  if not ms.split then return s, map, { { 1, #s } } end
  local words, i = {}, 1
  while i <= #s do -- each word starts at a replacement (MergedWithNext)
    local p = s:find(rep, i + (sub(s, i, i + #rep - 1) == rep and #rep or 0), true)
    local j = p and p - 1 or #s
    words[#words + 1] = { i, j }
    i = j + 1
  end
  return s, map, words
end

--------------------------------------------------------------- decoding

local function each(tokens, f)
  local out = {}
  for i, t in ipairs(tokens) do out[i] = f(t, i) end
  return out
end

local REPLACEMENT_CHAR = "\239\191\189" -- U+FFFD

-- Valid UTF-8 (what Rust's String::from_utf8 accepts): true, or false and
-- the position of the first byte of the first invalid sequence.
local function valid_utf8(s)
  local i, n = 1, #s
  while i <= n do
    local b = byte(s, i)
    local l, lo = 1, 0
    if b >= 0xF5 or (b >= 0x80 and b < 0xC2) then return false, i end
    if b >= 0xF0 then l, lo = 4, 0x10000 elseif b >= 0xE0 then l, lo = 3, 0x800
    elseif b >= 0xC2 then l, lo = 2, 0x80 end
    if l > 1 then
      if i + l - 1 > n then return false, i end
      local cp = b % (l == 2 and 32 or l == 3 and 16 or 8)
      for k = i + 1, i + l - 1 do
        local c = byte(s, k)
        if c < 0x80 or c > 0xBF then return false, i end
        cp = cp * 64 + c % 64
      end
      if cp < lo or cp > 0x10FFFF or (cp >= 0xD800 and cp <= 0xDFFF) then return false, i end
    end
    i = i + l
  end
  return true
end
S.valid_utf8 = valid_utf8

-- The bytes at i that one U+FFFD replaces: the longest start of a valid
-- sequence there (its lead and the continuation bytes that fit it: E0 takes
-- A0..BF next, ED 80..9F, F0 90..BF, F4 80..8F), at least 1 — Unicode's
-- "maximal subpart", which Rust's String::from_utf8_lossy (and so the
-- tokenizers library's decode) and Python's decode("utf-8", "replace") use.
local function invalid_length(s, i)
  local b = byte(s, i)
  local need, lo, hi = 0, 0x80, 0xBF
  if b >= 0xC2 and b <= 0xDF then need = 1
  elseif b >= 0xE0 and b <= 0xEF then
    need = 2
    if b == 0xE0 then lo = 0xA0 elseif b == 0xED then hi = 0x9F end
  elseif b >= 0xF0 and b <= 0xF4 then
    need = 3
    if b == 0xF0 then lo = 0x90 elseif b == 0xF4 then hi = 0x8F end
  end
  local n = 1
  for k = 1, need do
    local c = byte(s, i + k)
    if not c or c < lo or c > hi then break end
    n, lo, hi = n + 1, 0x80, 0xBF
  end
  return n
end

-- s with each invalid sequence (its maximal subpart) replaced by one
-- U+FFFD, as the tokenizers library's decode does: valid UTF-8, what JSON
-- must hold.
function S.lossy_utf8(s)
  local out, from = {}, 1
  while true do
    local ok, at = valid_utf8(s:sub(from))
    if ok then break end
    out[#out + 1] = s:sub(from, from + at - 2)
    out[#out + 1] = REPLACEMENT_CHAR
    from = from + at - 1 + invalid_length(s, from + at - 1)
  end
  out[#out + 1] = s:sub(from)
  return table.concat(out)
end

local function byte_fallback(tokens)
  local out, bytes = {}, {}
  local function flush()
    if #bytes == 0 then return end
    local s = string.char(unpack(bytes))
    if valid_utf8(s) then
      out[#out + 1] = s
    else
      for _ = 1, #bytes do out[#out + 1] = REPLACEMENT_CHAR end
    end
    bytes = {}
  end
  for _, t in ipairs(tokens) do
    local h = #t == 6 and t:match("^<0x(%x%x)>$")
    if h then
      bytes[#bytes + 1] = tonumber(h, 16)
    else
      flush()
      out[#out + 1] = t
    end
  end
  flush()
  return out
end

local function chars(s)
  local out, p = {}, 1
  while p <= #s do
    local b = byte(s, p)
    local l = b < 0xC0 and 1 or b < 0xE0 and 2 or b < 0xF0 and 3 or 4
    out[#out + 1] = sub(s, p, p + l - 1)
    p = p + l
  end
  return out
end

-- The decoder as a function from the list of token strings to the text.
function S.decoder(path, spec)
  local steps = {}
  local function add(field, d)
    if type(d) ~= "table" then fail(path, field .. " is not an object; give a tokenizer.json") end
    if d.type == "Sequence" and type(d.decoders) == "table" then
      for i, e in ipairs(d.decoders) do add(("%s.decoders[%d]"):format(field, i), e) end
    elseif d.type == "Replace" then
      local from, to = pattern_string(path, field, d), d.content
      steps[#steps + 1] = function(tokens)
        return each(tokens, function(t) return (replace(t, nil, from, to)) end)
      end
    elseif d.type == "ByteFallback" then
      steps[#steps + 1] = byte_fallback
    elseif d.type == "Fuse" then
      steps[#steps + 1] = function(tokens) return { concat(tokens) } end
    elseif d.type == "Strip" then
      local c, first, last = d.content, tonumber(d.start) or 0, tonumber(d.stop) or 0
      steps[#steps + 1] = function(tokens)
        return each(tokens, function(t)
          local cs = chars(t)
          local i, j = 1, #cs
          while i <= first and i <= j and cs[i] == c do i = i + 1 end
          local k = 0
          while k < last and j >= i and cs[j] == c do j, k = j - 1, k + 1 end
          return concat(cs, "", i, j)
        end)
      end
    elseif d.type == "Metaspace" then
      local ms = S.metaspace(path, field, d)
      steps[#steps + 1] = function(tokens)
        return each(tokens, function(t, i)
          return (replace(t, nil, ms.replacement, (i == 1 and ms.scheme ~= "never") and "" or " "))
        end)
      end
    else
      fail(path, ("%s is %s; supported: null, \"Replace\", \"ByteFallback\", \"Fuse\", \"Strip\", " ..
                  "\"Metaspace\" or a \"Sequence\" of them"):format(field, typename(d)))
    end
  end
  if spec == nil or spec == cjson.null then
    return function(tokens) return concat(tokens, " ") end -- tokenizers joins with spaces
  end
  add("decoder", spec)
  return function(tokens)
    for _, step in ipairs(steps) do tokens = step(tokens) end
    return concat(tokens)
  end
end

return S
