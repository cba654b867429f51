-- tokenizer/bpe.lua — the BPE model of a tokenizer.json: a word (one
-- pre-token) to its first symbols, then the merges applied lowest rank
-- first, leftmost first among equal ranks, as tokenizers' Word::merge_all
-- does. Each symbol carries its length in bytes of the word, for offsets;
-- lead counts the bytes before the first symbol that no symbol covers.
--
-- Byte-level words start as one symbol per byte (GPT-2, Llama 3); other
-- words (SentencePiece-style: Llama 2, Mistral, TinyLlama) as one symbol per
-- UTF-8 character, a character missing from the vocabulary becoming its
-- <0xNN> byte tokens (byte_fallback) or the unknown token (merged into one
-- when fuse_unk), or nothing when the model has neither.
local B = {}

local byte, sub, floor = string.byte, string.sub, math.floor
local char_len = require("luazero.tokenizer.split").char_len

local PAIR = 2 ^ 24 -- pair key: left * PAIR + right (ids stay below 2^24)
local POS = 2 ^ 24  -- heap key: rank * POS + position
B.PAIR = PAIR

-- Short words: search the best pair each time (fast for the usual word).
local function merge_scan(model, syms, lens, n)
  local rank, result = model.merge_rank, model.merge_result
  while n > 1 do
    local best, at = math.huge, 0
    for i = 1, n - 1 do
      local r = rank[syms[i] * PAIR + syms[i + 1]]
      if r and r < best then best, at = r, i end
    end
    if at == 0 then break end
    syms[at] = result[syms[at] * PAIR + syms[at + 1]]
    lens[at] = lens[at] + lens[at + 1]
    for i = at + 1, n - 1 do syms[i], lens[i] = syms[i + 1], lens[i + 1] end
    syms[n], lens[n] = nil, nil
    n = n - 1
  end
  return n
end

-- Long words (a whole text when there is no pre-tokenizer): a heap of
-- candidate pairs over a linked list of symbols, n log n.
local function merge_heap(model, syms, lens, n)
  if n >= POS then error("tokenizer: a word of more than 16M characters: split the text", 0) end
  local rank, result = model.merge_rank, model.merge_result
  local nxt, prv, heap, hn = {}, {}, {}, 0
  local function push(key)
    hn = hn + 1
    local i = hn
    while i > 1 do
      local p = floor(i / 2)
      if heap[p] <= key then break end
      heap[i] = heap[p]
      i = p
    end
    heap[i] = key
  end
  local function pop()
    local top, last = heap[1], heap[hn]
    heap[hn] = nil
    hn = hn - 1
    if hn > 0 then
      local i = 1
      while true do
        local c = 2 * i
        if c > hn then break end
        if c < hn and heap[c + 1] < heap[c] then c = c + 1 end
        if heap[c] >= last then break end
        heap[i] = heap[c]
        i = c
      end
      heap[i] = last
    end
    return top
  end
  for i = 1, n do nxt[i], prv[i] = i + 1, i - 1 end
  nxt[n] = 0
  for i = 1, n - 1 do
    local r = rank[syms[i] * PAIR + syms[i + 1]]
    if r then push(r * POS + i) end
  end
  while hn > 0 do
    local key = pop()
    local i = key % POS
    local r = (key - i) / POS
    local a = syms[i]
    local j = a and nxt[i] or 0
    -- A stale entry (the pair at i changed since) no longer has this rank.
    if j ~= 0 and rank[a * PAIR + syms[j]] == r then
      syms[i] = result[a * PAIR + syms[j]]
      lens[i] = lens[i] + lens[j]
      syms[j] = false
      local k = nxt[j]
      nxt[i] = k
      if k ~= 0 then prv[k] = i end
      local p = prv[i]
      if p ~= 0 then
        local r2 = rank[syms[p] * PAIR + syms[i]]
        if r2 then push(r2 * POS + p) end
      end
      if k ~= 0 then
        local r2 = rank[syms[i] * PAIR + syms[k]]
        if r2 then push(r2 * POS + i) end
      end
    end
  end
  local m = 0
  for i = 1, n do
    if syms[i] then
      m = m + 1
      syms[m], lens[m] = syms[i], lens[i]
    end
  end
  for i = m + 1, n do syms[i], lens[i] = nil, nil end
  return m
end

B.merge_scan, B.merge_heap = merge_scan, merge_heap -- for tests

local function merge(model, syms, lens, n)
  if n > 48 then return merge_heap(model, syms, lens, n) end
  return merge_scan(model, syms, lens, n)
end

-- The ids and byte lengths of a byte-level word (raw bytes).
function B.byte_word(model, word)
  local whole = model.ignore_merges and model.by_bytes[word]
  if whole then return { whole }, { #word }, 0 end
  local syms, lens, n, lead = {}, {}, 0, 0
  local byte_id, unk = model.byte_id, model.unk_id
  for i = 1, #word do
    local id = byte_id[byte(word, i)] or unk
    if id then
      n = n + 1
      syms[n], lens[n] = id, 1
    elseif n > 0 then -- a byte without a token: its length goes to the symbol before
      lens[n] = lens[n] + 1
    else
      lead = lead + 1
    end
  end
  merge(model, syms, lens, n)
  return syms, lens, lead
end

-- Appends symbol sym of len bytes after the n first; returns n + 1.
local function push(syms, lens, n, sym, len)
  n = n + 1
  syms[n], lens[n] = sym, len
  return n
end

-- The ids and byte lengths of bytes `from` .. `to` of a character-level
-- word (UTF-8 text), merged.
local function char_part(model, word, from, to)
  local vocab = model.by_text
  local syms, lens, n = {}, {}, 0
  local byte_token, unk, fuse_unk = model.byte_token, model.unk_id, model.fuse_unk
  local pending_len, lead = nil, 0 -- an unknown run not yet written; bytes before any symbol
  local p, len = from, to
  while p <= len do
    local l = char_len(word, p)
    local c = sub(word, p, p + l - 1)
    local id = vocab[c]
    if id then
      if pending_len then n, pending_len = push(syms, lens, n, unk, pending_len), nil end
      n = push(syms, lens, n, id, l)
    else
      local bytes_ok = byte_token ~= nil
      if bytes_ok then
        for q = p, p + l - 1 do
          if not byte_token[byte(word, q)] then bytes_ok = false break end
        end
      end
      if bytes_ok then -- tokenizers adds them without writing a pending unknown first
        for q = p, p + l - 1 do n = push(syms, lens, n, byte_token[byte(word, q)], 1) end
      elseif unk then
        if pending_len and fuse_unk then
          pending_len = pending_len + l
        else
          if pending_len then n = push(syms, lens, n, unk, pending_len) end
          pending_len = l
        end
      elseif pending_len then -- dropped: its bytes go to the symbol before
        pending_len = pending_len + l
      elseif n > 0 then
        lens[n] = lens[n] + l
      else
        lead = lead + l
      end
    end
    p = p + l
  end
  if pending_len then n = push(syms, lens, n, unk, pending_len) end
  merge(model, syms, lens, n)
  return syms, lens, lead
end

-- The pairs of adjacent characters inside the vocabulary's tokens (made at
-- the first long word): a token, and so a merge, can span two characters
-- only if it holds them side by side.
local function char_pairs(model)
  if model.char_pairs then return model.char_pairs end
  local pairs_in = {}
  for text in pairs(model.by_text) do
    local p, prev = 1, nil
    while p <= #text do
      local l = char_len(text, p)
      local c = sub(text, p, p + l - 1)
      if prev then pairs_in[prev .. c] = true end
      prev, p = c, p + l
    end
  end
  model.char_pairs = pairs_in
  return pairs_in
end

B.LONG = 2 ^ 20 -- bytes: a longer word is merged in parts of about this size

-- Where a long word may be cut after byte `at` or later without changing
-- its tokens: before a character that is a token, after one that is, the
-- two never side by side in a token (so no merge joins them, and neither
-- is an unknown or byte-fallback character, which a cut could change).
-- Returns the first byte of the next part, or nil: none before the end.
local function safe_cut(model, word, at)
  local vocab, inside = model.by_text, char_pairs(model)
  local p = at
  while p <= #word and byte(word, p) >= 0x80 and byte(word, p) < 0xC0 do p = p + 1 end
  local l = p <= #word and char_len(word, p)
  local prev = nil
  while p <= #word do
    local c = sub(word, p, p + l - 1)
    if prev and vocab[prev] and vocab[c] and not inside[prev .. c] then return p end
    prev, p = c, p + l
    l = p <= #word and char_len(word, p)
  end
  return nil
end

-- The ids and byte lengths of a character-level word (UTF-8 text), and the
-- bytes before its first symbol. A word longer than B.LONG bytes (a whole
-- text, without a pre-tokenizer) is merged part by part, cut where no merge
-- can reach across (safe_cut): the same tokens, in memory of a part's size.
function B.char_word(model, word)
  local whole = model.ignore_merges and model.by_text[word]
  if whole then return { whole }, { #word }, 0 end
  local long = B.LONG
  if #word <= long then return char_part(model, word, 1, #word) end
  local syms, lens, lead = {}, {}, nil
  local from = 1
  while from <= #word do
    local cut = safe_cut(model, word, from + long)
    local to = cut and cut - 1 or #word
    local s, l, before = char_part(model, word, from, to)
    if lead == nil then
      lead = before
    elseif before > 0 then -- bytes that make no symbol go to the symbol before
      if #lens > 0 then lens[#lens] = lens[#lens] + before else lead = lead + before end
    end
    for i = 1, #s do syms[#syms + 1], lens[#lens + 1] = s[i], l[i] end
    from = to + 1
  end
  return syms, lens, lead
end

return B
