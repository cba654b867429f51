-- tokenizer/split.lua — the characters under a tokenizer.json: UTF-8 code
-- points, GPT-2's bytes-to-unicode mapping, and the pre-tokenizer splits of
-- byte-level BPE, GPT-2's pattern
--   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
-- and Llama 3's and Qwen2's (below), done by hand over code points. \p{L} and \p{N} come
-- from Unicode's general categories (luazero.unicode_classes), \s is
-- Unicode's White_Space.
local bit = require("bit")
local classes = require("luazero.unicode_classes")

local byte, char, sub, concat = string.byte, string.char, string.sub, table.concat
local band, bor, lshift = bit.band, bit.bor, bit.lshift

local OTHER, LETTER, NUMBER, SPACE = 0, 1, 2, 3

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

local function cont(c) return c and c >= 0x80 and c < 0xC0 end

-- The length in bytes of the well-formed UTF-8 character at byte p of s
-- (RFC 3629: no overlong forms, surrogates or code points past U+10FFFF),
-- or 1 where the bytes there are not one (a byte of its own).
local function char_len(s, p)
  local b = byte(s, p)
  if b < 0x80 then return 1 end
  local b1, b2, b3 = byte(s, p + 1, p + 3)
  if b >= 0xC2 and b < 0xE0 then return cont(b1) and 2 or 1 end
  if b >= 0xE0 and b < 0xF0 then
    local lo, hi = b == 0xE0 and 0xA0 or 0x80, b == 0xED and 0xA0 or 0xC0
    return b1 and b1 >= lo and b1 < hi and cont(b2) and 3 or 1
  end
  if b >= 0xF0 and b < 0xF5 then
    local lo, hi = b == 0xF0 and 0x90 or 0x80, b == 0xF4 and 0x90 or 0xC0
    return b1 and b1 >= lo and b1 < hi and cont(b2) and cont(b3) and 4 or 1
  end
  return 1
end

-- The code point at byte p of s and its length in bytes. A byte that does
-- not begin a well-formed character is one of its own: U+FFFD for the
-- character classes (what decoding with errors="replace" reads there), and
-- the byte itself as the third value, so what rewrites the text (NFC)
-- writes that byte back unchanged and its neighbours stay theirs.
local function code_point(s, p)
  local b = byte(s, p)
  if b < 0x80 then return b, 1 end
  local l = char_len(s, p)
  if l == 1 then return 0xFFFD, 1, b end
  local b1, b2, b3 = byte(s, p + 1, p + 3)
  if l == 4 then
    return bor(lshift(band(b, 7), 18), lshift(band(b1, 63), 12), lshift(band(b2, 63), 6),
               band(b3, 63)), 4
  elseif l == 3 then
    return bor(lshift(band(b, 15), 12), lshift(band(b1, 63), 6), band(b2, 63)), 3
  end
  return bor(lshift(band(b, 31), 6), band(b1, 63)), 2
end

local function utf8_char(cp)
  if cp < 0x80 then return char(cp) end
  if cp < 0x800 then return char(0xC0 + math.floor(cp / 64), 0x80 + cp % 64) end
  if cp < 0x10000 then
    return char(0xE0 + math.floor(cp / 4096), 0x80 + math.floor(cp / 64) % 64, 0x80 + cp % 64)
  end
  return char(0xF0 + math.floor(cp / 262144), 0x80 + math.floor(cp / 4096) % 64,
              0x80 + math.floor(cp / 64) % 64, 0x80 + cp % 64)
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

-- The byte after the run of class k that starts at byte r (r <= n + 1), of
-- at most `most` code points (any number when nil).
local function run_end(s, r, n, k, most)
  local count = 0
  while r <= n and count ~= most do
    local c, l = code_point(s, r)
    if class_of(c) ~= k then break end
    r, count = r + l, count + 1
  end
  return r
end

-- The byte after the contraction ('s 't 'm 'd 're 've 'll) at p, or nil;
-- fold: any letter case, as Llama 3's (?i:...).
local function contraction_end(s, p, fold)
  local b1 = byte(s, p + 1)
  if b1 and CONTRACTION1[fold and bor(b1, 32) or b1] then return p + 2 end
  local two = sub(s, p + 1, p + 2)
  if CONTRACTION2[fold and two:lower() or two] then return p + 3 end
end

-- Calls emit(s, i, j) for each piece s:sub(i, j) of s: a contraction first
-- (any letter case with fold), else up to piece_end(s, p, n, c, l), the byte
-- after the piece that starts at byte p with code point c of l bytes.
local function each_piece(s, emit, fold, piece_end)
  local n, p = #s, 1
  while p <= n do
    local c, l = code_point(s, p)
    local q = c == APOSTROPHE and contraction_end(s, p, fold) or piece_end(s, p, n, c, l)
    emit(s, p, q - 1)
    p = q
  end
end

-- GPT-2's split: the byte after the piece at p.
local function gpt2_piece_end(s, p, n, c, l)
  local k, r = class_of(c), p + l
  if c == SPACE_BYTE and r <= n then -- " ?" before a run of letters, numbers or others
    local c2, l2 = code_point(s, r)
    local k2 = class_of(c2)
    if k2 ~= SPACE then k, r = k2, r + l2 end
  end
  if k ~= SPACE then return run_end(s, r, n, k) end
  -- \s+(?!\S) leaves the last blank before a non-blank to the next piece
  local last = p
  while r <= n do
    local c2, l2 = code_point(s, r)
    if class_of(c2) ~= SPACE then break end
    last, r = r, r + l2
  end
  if r <= n and last > p then return last end
  return r
end

-- Calls emit(s, i, j) for each piece s:sub(i, j) of GPT-2's split of s.
local function split_gpt2(s, emit) each_piece(s, emit, false, gpt2_piece_end) end

-- Llama 3's pattern, for a Split pre-tokenizer before ByteLevel:
--   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
--   ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
local LLAMA3_PATTERN = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|" ..
  "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
local CR, LF = 13, 10

local function is_newline(c) return c == CR or c == LF end

-- Llama 3's split (numbers in runs of up to 3, or of 1 with Qwen2's
-- \p{N}): the byte after the piece at p.
local function llama3_piece_end(s, p, n, c, l, more_digits)
  local k, r = class_of(c), p + l
  if k ~= LETTER and k ~= NUMBER and not is_newline(c) and r <= n then
    local c2, l2 = code_point(s, r) -- [^\r\n\p{L}\p{N}]?\p{L}+
    if class_of(c2) == LETTER then k, r = LETTER, r + l2 end
  end
  if k == LETTER then return run_end(s, r, n, LETTER) end
  if k == NUMBER then return run_end(s, r, n, NUMBER, more_digits or 2) end -- \p{N}{1,3}
  if c == SPACE_BYTE and r <= n then -- " ?" before a run of others
    local c2, l2 = code_point(s, r)
    if class_of(c2) == OTHER then k, r = OTHER, r + l2 end
  end
  if k == OTHER then
    r = run_end(s, r, n, OTHER)
    while r <= n and is_newline(byte(s, r)) do r = r + 1 end
    return r
  end
  -- a run of blanks: up to its last newline, else as GPT-2's
  local last, after_newline = p, is_newline(c) and r or nil
  while r <= n do
    local c2, l2 = code_point(s, r)
    if class_of(c2) ~= SPACE then break end
    last, r = r, r + l2
    if is_newline(c2) then after_newline = r end
  end
  if after_newline then return after_newline end
  if r <= n and last > p then return last end
  return r
end

local function split_llama3(s, emit) each_piece(s, emit, true, llama3_piece_end) end

-- Qwen2's pattern (Qwen2, Qwen2.5, Qwen3): Llama 3's with one digit a piece.
local QWEN2_PATTERN = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|" ..
  "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"

local function qwen2_piece_end(s, p, n, c, l) return llama3_piece_end(s, p, n, c, l, 0) end

local function split_qwen2(s, emit) each_piece(s, emit, true, qwen2_piece_end) end

-- The Split patterns (before a ByteLevel without its own regex) done here,
-- by their exact text in tokenizer.json.
local SPLIT_PATTERNS = { [LLAMA3_PATTERN] = split_llama3, [QWEN2_PATTERN] = split_qwen2 }

return { code_point = code_point, char_len = char_len, utf8_char = utf8_char, unbyte = unbyte, split_gpt2 = split_gpt2,
         split_llama3 = split_llama3, split_qwen2 = split_qwen2, LLAMA3_PATTERN = LLAMA3_PATTERN,
         QWEN2_PATTERN = QWEN2_PATTERN, SPLIT_PATTERNS = SPLIT_PATTERNS }
