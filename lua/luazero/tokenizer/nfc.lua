-- tokenizer/nfc.lua — Unicode Normalization Form C (canonical decomposition,
-- canonical ordering, canonical composition; UAX #15) over UTF-8 text, as a
-- tokenizer.json "NFC" normalizer runs it, keeping where each byte of the
-- result came from: a composed character starts where its first part did.
-- The data is luazero.unicode_nfc (tools/gen-unicode-nfc.py).
local data = require("luazero.unicode_nfc")
local split = require("luazero.tokenizer.split")

local N = {}

local code_point, utf8_char = split.code_point, split.utf8_char
local concat = table.concat
local CCC, DECOMP, COMPOSE = data.ccc, data.decomp, data.compose
local KEY = 0x110000

-- Hangul syllables, by arithmetic (The Unicode Standard, 3.12).
local S_BASE, L_BASE, V_BASE, T_BASE = 0xAC00, 0x1100, 0x1161, 0x11A7
local L_COUNT, V_COUNT, T_COUNT = 19, 21, 28
local N_COUNT = V_COUNT * T_COUNT
local S_COUNT = L_COUNT * N_COUNT

local function compose(a, b)
  if a >= L_BASE and a < L_BASE + L_COUNT and b >= V_BASE and b < V_BASE + V_COUNT then
    return S_BASE + ((a - L_BASE) * V_COUNT + (b - V_BASE)) * T_COUNT
  end
  if a >= S_BASE and a < S_BASE + S_COUNT and (a - S_BASE) % T_COUNT == 0 and
     b > T_BASE and b < T_BASE + T_COUNT then
    return a + (b - T_BASE)
  end
  return COMPOSE[a * KEY + b]
end

-- Appends the full canonical decomposition of cp to cps, with each part's
-- change as tokenizers counts it: 0 for the first, 1 (inserted) for the rest.
local function decompose(cp, cps, change)
  local n = #cps
  if cp >= S_BASE and cp < S_BASE + S_COUNT then
    local s = cp - S_BASE
    local t = s % T_COUNT
    cps[n + 1], change[n + 1] = L_BASE + math.floor(s / N_COUNT), 0
    cps[n + 2], change[n + 2] = V_BASE + math.floor((s % N_COUNT) / T_COUNT), 1
    if t ~= 0 then cps[n + 3], change[n + 3] = T_BASE + t, 1 end
    return
  end
  local d = DECOMP[cp]
  if not d then
    cps[n + 1], change[n + 1] = cp, 0
    return
  end
  for i = 1, #d do cps[n + i], change[n + i] = d[i], i == 1 and 0 or 1 end
end

-- s in NFC, and when want_map the original offset (start + the 0-based byte
-- of s) of each byte of the result. Offsets follow tokenizers' alignments,
-- which are positional: a character of the result not inserted takes the
-- place of the next original character (and a composite drops the ones it
-- absorbed), an inserted one the place of the original character before it;
-- so marks put into canonical order keep the offsets of the places they
-- move to. Text without a byte >= 0x80 is already NFC.
function N.normalize(s, start, want_map)
  if not s:find("[\128-\255]") then
    if not want_map then return s end
    local map = {}
    for k = 1, #s do map[k] = start + k - 1 end
    return s, map
  end
  local cps, change, starts = {}, {}, {}
  local p, n = 1, #s
  while p <= n do
    local cp, l, raw = code_point(s, p)
    starts[#starts + 1] = start + p - 1
    if raw then -- a byte of no character: kept as it is (-byte), a starter
      cps[#cps + 1], change[#change + 1] = -raw, 0
    else
      decompose(cp, cps, change)
    end
    p = p + l
  end
  local m = #cps
  -- Canonical ordering: each run of non-starters stably sorted by class.
  for i = 2, m do
    local c = CCC[cps[i]]
    if c then
      local j = i
      while j > 1 do
        local pc = CCC[cps[j - 1]]
        if not pc or pc <= c then break end
        cps[j], cps[j - 1] = cps[j - 1], cps[j]
        change[j], change[j - 1] = change[j - 1], change[j]
        j = j - 1
      end
    end
  end
  -- Canonical composition: a character joins the last starter unless a
  -- character of the same or a higher class (or a starter) stands between.
  local starter, last_class, w = nil, -1, 0
  for i = 1, m do
    local cp, c = cps[i], CCC[cps[i]] or 0
    local joined = starter and (last_class < c or (last_class == 0 and w == starter)) and
                   cp > 0 and cps[starter] > 0 and compose(cps[starter], cp)
    if joined then
      cps[starter], change[starter] = joined, change[starter] + change[i] - 1
    else
      w = w + 1
      cps[w], change[w] = cp, change[i]
      if c == 0 then starter = w end
      last_class = c
    end
  end
  local out, map, at = {}, want_map and {} or nil, 1 -- at: the next original character
  for i = 1, w do
    local ch = cps[i] < 0 and string.char(-cps[i]) or utf8_char(cps[i])
    out[i] = ch
    if map then
      local from
      if change[i] > 0 then
        from = starts[at - 1] or start
      else
        from = starts[at] or starts[#starts]
        at = at + 1 - change[i]
      end
      local k = #map
      for b = 1, #ch do map[k + b] = from end
    end
  end
  return concat(out), map
end

N.unicode_version = data.unicode_version
return N
