-- tokenizer/stream.lua — a text too long to hold encoded whole, encoded
-- piece by piece into the ids of encoding it whole (what tokenizers gives
-- for the whole text), each piece's text and ids in memory at a time.
--
--   local stream = require("luazero.tokenizer.stream")
--   local enc = stream.encoder(tok, { piece_bytes = 2 ^ 20 })
--   enc:feed(block, emit)     -- any cut of the text; emit(ids, text) per piece made
--   enc:finish(emit)          -- the rest
--
-- Where a piece may end. A cut goes where the whole text's tokens part
-- anyway: after a newline or before a space that stand between two
-- characters that are not blanks ("word\nWord", "word word"; in a long
-- stretch with neither, a character boundary the check allows): every
-- pre-tokenizer here (GPT-2's, Llama 3's and Qwen2's patterns, Metaspace,
-- Gemma's split on " ") starts a new piece of text there or keeps the blank
-- with one side. What makes it exact is not that argument but a check at
-- each cut: a window of the text around it (WINDOW bytes each side, widened
-- to a blank where one is near) is encoded whole and in two parts, and the cut
-- is taken only where the two agree; else the next place is tried.
--
-- A piece after the first is encoded behind a little of the text before it
-- (CONTEXT bytes, whole characters) and the ids of that context dropped, so
-- that it starts as it does in the middle of the text: no "▁" prepended by
-- a SentencePiece normalizer, no prefix space added, the pattern's state
-- after a newline. The ids kept are those starting at or after the cut (the
-- offsets of encode(text, {offsets = true})); one crossing it fails the cut.
local M = {}

M.PIECE_BYTES = 2 ^ 20 -- a piece's size before a cut is looked for
M.WINDOW = 256 -- bytes each side of a cut that the check encodes
M.CONTEXT = 32 -- bytes before a piece encoded with it, then dropped
local WIDEN = 4096 -- how far the window may grow to reach a blank

local sub, find, byte = string.sub, string.find, string.byte

-- The first byte of a character at or after byte p.
local function char_start(text, p)
  while p <= #text and byte(text, p) >= 0x80 and byte(text, p) < 0xC0 do p = p + 1 end
  return p
end

-- The ids of text[a, b] as they come in the middle of text: encoded behind
-- up to CONTEXT bytes before a (from a character's first byte), the
-- context's ids dropped. nil where an id crosses a (no cut there).
local function encode_from(tok, text, a, b)
  local c = math.min(char_start(text, math.max(1, a - M.CONTEXT)), a)
  local ids, starts = tok:encode(sub(text, c, b), { offsets = true })
  local skip, at = #ids, a - c
  for i = 1, #ids do
    if starts[i] >= at then
      skip = i - 1
      break
    end
  end
  -- (a token starting before a that is still followed by a token starting
  -- after it ends where a starts only if the next token starts exactly at a)
  if skip < #ids and starts[skip + 1] ~= at then return nil end
  if skip == 0 then return ids end
  local kept = {}
  for i = skip + 1, #ids do kept[i - skip] = ids[i] end
  return kept
end

local function same(x, y, z)
  if #x ~= #y + #z then return false end
  for i = 1, #y do
    if x[i] ~= y[i] then return false end
  end
  for i = 1, #z do
    if x[#y + i] ~= z[i] then return false end
  end
  return true
end

-- A window's edge near p, going back (dir -1) or on (+1): just past a blank
-- within WIDEN bytes, else (text without blanks: CJK, one long word) the
-- character boundary at p. Either way the edge is the same in the two
-- encodings a check compares.
local function edge(text, p, dir)
  local q = p
  for _ = 1, WIDEN do
    if q <= 1 or q >= #text then break end
    local c = byte(text, q)
    if c == 10 or c == 32 then return dir < 0 and q + 1 or q - 1 end
    q = q + dir
  end
  if dir < 0 then return char_start(text, p) end
  return char_start(text, p + 1) - 1 -- (the last byte of the character at p)
end

-- Whether cutting text before byte `cut` leaves the ids the same around it.
local function cut_holds(tok, text, cut)
  local a = edge(text, cut - M.WINDOW, -1)
  local b = edge(text, cut + M.WINDOW, 1)
  if a <= M.CONTEXT or a >= cut or b <= cut or b >= #text then return false end
  local whole = encode_from(tok, text, a, b)
  local left, right = encode_from(tok, text, a, cut - 1), encode_from(tok, text, cut, b)
  return whole and left and right and same(whole, left, right)
end

-- The first place from byte p on where text may be cut (the first byte of
-- the next piece), keeping WINDOW bytes and the widening after it, and the
-- byte the search reached (where the next search of a longer text goes on
-- from). Each search looks SEARCH bytes ahead, not through all that is
-- held. A stretch with no blank between characters (CJK text, a line of
-- one word) is tried at character boundaries, FALLBACK of them per stretch.
local SEARCH, FALLBACK = 65536, 16
local function next_cut(tok, text, p)
  local limit = #text - M.WINDOW - WIDEN
  while p <= limit do
    local ahead = sub(text, p, math.min(limit, p + SEARCH))
    local nl = find(ahead, "[^%s]\n[^%s]")
    local sp = not nl and find(ahead, "[^%s] [^%s]")
    if nl or sp then
      local cut = p - 1 + (nl and nl + 2 or sp + 1)
      if cut <= limit and cut_holds(tok, text, cut) then return cut, cut end
      p = cut
    else
      local cut = char_start(text, p + math.floor(#ahead / 2))
      for _ = 1, FALLBACK do
        if cut > limit then break end
        if cut_holds(tok, text, cut) then return cut, cut end
        cut = char_start(text, cut + 1)
      end
      -- (on past the stretch, less the byte a candidate's first character
      -- needs before it; past limit when the stretch reached it)
      p = p + #ahead >= limit and limit + 1 or p + #ahead - 1
    end
  end
  return nil, math.max(math.min(p, limit + 1), 1)
end

local Encoder = {}
Encoder.__index = Encoder

function M.encoder(tok, opts)
  local piece_bytes = opts and opts.piece_bytes or M.PIECE_BYTES
  return setmetatable({ tok = tok, piece_bytes = piece_bytes, try_at = piece_bytes,
                        blocks = {}, held = 0, first = true }, Encoder)
end

-- Encodes text[first, last] (the first piece of the text, or one after a
-- cut) and hands its ids on.
function Encoder:emit_piece(text, first, last, emit)
  local piece = sub(text, first, last)
  local ids
  if self.first then
    ids = self.tok:encode(piece)
  else
    ids = encode_from(self.tok, self.context .. piece, #self.context + 1, #self.context + #piece)
    if not ids then
      error("tokenizer: stream: a token crosses a checked cut; encode this text whole", 0)
    end
  end
  self.first = false
  self.context = sub(text, math.min(char_start(text, math.max(first, last - M.CONTEXT + 1)), last),
                     last)
  emit(ids, piece)
end

function Encoder:feed(block, emit)
  self.blocks[#self.blocks + 1] = block
  self.held = self.held + #block
  if self.held < self.try_at then return end
  local text, first = table.concat(self.blocks), 1
  -- cuts from about three quarters of a piece's size on, or where the last
  -- search of what is held stopped (no place searched twice)
  local ahead = math.floor(self.piece_bytes * 3 / 4)
  while #text - first + 1 >= self.piece_bytes do
    local cut, reached = next_cut(self.tok, text, math.max(first + ahead, self.searched or 0))
    if not cut then
      self.searched = reached
      break
    end
    self.searched = nil
    self:emit_piece(text, first, cut - 1, emit)
    first = cut
  end
  text = sub(text, first)
  if self.searched then self.searched = self.searched - first + 1 end
  self.blocks, self.held = { text }, #text
  -- (where what is held has no cut yet, look again after half a piece more)
  self.try_at = math.max(self.piece_bytes, #text + math.floor(self.piece_bytes / 2))
end

function Encoder:finish(emit)
  local text = table.concat(self.blocks)
  self.blocks, self.held = {}, 0
  if #text > 0 then self:emit_piece(text, 1, #text, emit) end
end

return M
