-- tests/fuzz/mutate.lua — seeded mutations of a reader's input: bytes
-- (flips, interesting values, deletions, insertions, truncations, splices
-- with another seed), JSON (a value turned into the wrong type, a huge or
-- negative number, deep nesting, a long string, a key dropped or added),
-- a safetensors header (the JSON inside, its length kept or fixed) and a
-- token file's int32 header. The same seed gives the same input.
--
--   local mutate = require("mutate")          -- package.path: tests/fuzz
--   local r = mutate.rng(seed)                -- r(n): 1..n
--   local text = mutate.json(r, seed_text, others)
local bit = require("bit")
local ffi = require("ffi")
local cjson = require("cjson")

local M = {}

-- xorshift32: r(n) gives a whole number in 1..n.
function M.rng(seed)
  local s = bit.tobit((seed * 2654435761 + 12345) % 4294967296)
  if s == 0 then s = 1 end
  return function(n)
    s = bit.bxor(s, bit.lshift(s, 13))
    s = bit.bxor(s, bit.rshift(s, 17))
    s = bit.bxor(s, bit.lshift(s, 5))
    return (s % n) + 1
  end
end

local INTERESTING_BYTES = { 0, 255, 127, 128, 1, 34, 44, 45, 48, 57, 58, 91, 93, 123, 125, 92 }
local INTERESTING_INTS = { 0, 1, -1, 2, 3, 255, 256, 65535, 65536, 2 ^ 31 - 1, -2 ^ 31, 2 ^ 16 + 1,
                           20240520, 20240521, 1024, 4096 }

-- One byte-level change of s; others: the target's other seeds, for splices.
local function byte_step(r, s, others)
  local n = #s
  local k = r(8)
  local at = n > 0 and r(n) or 1
  if k == 1 and n > 0 then -- flip a bit
    local b = bit.bxor(s:byte(at), bit.lshift(1, r(8) - 1))
    return s:sub(1, at - 1) .. string.char(b) .. s:sub(at + 1)
  elseif k == 2 and n > 0 then -- an interesting byte
    return s:sub(1, at - 1) .. string.char(INTERESTING_BYTES[r(#INTERESTING_BYTES)]) .. s:sub(at + 1)
  elseif k == 3 and n > 0 then -- delete a run
    local len = r(r(2) == 1 and 16 or math.max(1, math.floor(n / 4)))
    return s:sub(1, at - 1) .. s:sub(at + len)
  elseif k == 4 then -- insert random bytes
    local t = {}
    for i = 1, r(8) do t[i] = string.char(r(256) - 1) end
    return s:sub(1, at - 1) .. table.concat(t) .. s:sub(at)
  elseif k == 5 then -- truncate
    return s:sub(1, at - 1)
  elseif k == 6 and #others > 0 then -- splice: our head, another seed's tail
    local o = others[r(#others)]
    return s:sub(1, at - 1) .. o:sub(#o > 0 and r(#o) or 1)
  elseif k == 7 and n > 0 then -- repeat a run
    local len = r(math.min(n - at + 1, 64))
    return s:sub(1, at + len - 1) .. s:sub(at, at + len - 1):rep(r(4)) .. s:sub(at + len)
  else -- swap two runs
    local b = n > 0 and r(n) or 1
    if b < at then at, b = b, at end
    return s:sub(1, at - 1) .. s:sub(b, b) .. s:sub(at + 1, b - 1) .. s:sub(at, at) .. s:sub(b + 1)
  end
end

function M.bytes(r, s, others)
  for _ = 1, r(4) do s = byte_step(r, s, others or {}) end
  return s
end

-------------------------------------------------------------------- JSON

-- A table's keys in one order whatever the string hashes (LuaJIT seeds
-- them per process): numbers, then strings, each sorted.
local function keys_of(t)
  local ks = {}
  for k in pairs(t) do ks[#ks + 1] = k end
  table.sort(ks, function(a, b)
    if type(a) ~= type(b) then return type(a) == "number" end
    return a < b
  end)
  return ks
end

-- Every table in a decoded value, with its keys: { {t, key}, ... }. A
-- table met again (a mutation may copy a subtree into itself) is not
-- walked twice.
local function slots(v, out, depth, seen)
  if type(v) ~= "table" or depth > 40 or seen[v] then return out end
  seen[v] = true
  for _, k in ipairs(keys_of(v)) do
    out[#out + 1] = { v, k }
    slots(v[k], out, depth + 1, seen)
  end
  return out
end

-- JSON text of v with its keys sorted (cjson's follow the hashes); nil for
-- a cycle or past depth 200.
local function encode(v, depth)
  if depth > 200 then return nil end
  if type(v) ~= "table" then return cjson.encode(v) end
  local ks, n = keys_of(v), #v
  local parts = {}
  local array = #ks == n
  for i, k in ipairs(ks) do
    local x = encode(v[k], depth + 1)
    if not x then return nil end
    parts[i] = array and x or cjson.encode(tostring(k)) .. ":" .. x
  end
  if array and n > 0 then return "[" .. table.concat(parts, ",") .. "]" end
  return "{" .. table.concat(parts, ",") .. "}"
end

-- A value that is wrong for most fields; raw JSON text is put in as a
-- placeholder string, swapped in after encoding.
local function wrong_value(r, old, raw)
  local function rawtext(t)
    raw[#raw + 1] = t
    return "\1RAW" .. #raw .. "\1"
  end
  local k = r(22)
  if k == 1 then return "x"
  elseif k == 2 then return ""
  elseif k == 3 then return r(2) == 1
  elseif k == 4 then return cjson.null
  elseif k == 5 then return {}
  elseif k == 6 then return { 1, "a", {} }
  elseif k == 7 then return INTERESTING_INTS[r(#INTERESTING_INTS)]
  elseif k == 8 then return -INTERESTING_INTS[r(#INTERESTING_INTS)]
  elseif k == 9 then return ({ 1.5, -0.5, 1e-300, 2 ^ 53 + 2, 2 ^ 63, 2 ^ 64, 1e308, -1e308 })[r(8)]
  elseif k == 10 then return rawtext(({ "1e999", "-1e999", "-0", "1E400", "0.0000001e-999",
                                        "18446744073709551617", "123456789012345678901234567890" })[r(7)])
  elseif k == 11 then -- deep nesting, past cjson's limit or near it
    local d = ({ 999, 1001, 5000, 200 })[r(4)]
    return rawtext(("["):rep(d) .. ("]"):rep(d))
  elseif k == 12 then return ("A"):rep(r(2) == 1 and 100000 or 300)
  elseif k == 13 then -- a long array
    local t = {}
    for i = 1, ({ 1000, 20000 })[r(2)] do t[i] = i % 7 end
    return t
  elseif k == 14 and type(old) == "number" then return old * ({ 2, -1, 1000, 65536 })[r(4)]
  elseif k == 15 and type(old) == "number" then return old + ({ 1, -1, 0.5 })[r(3)]
  elseif k == 16 and type(old) == "string" then return old .. old
  elseif k == 17 and type(old) == "string" then return old:sub(1, math.floor(#old / 2))
  elseif k == 18 and type(old) == "table" then return #old > 0 and old[1] or next(old) and old
  elseif k == 19 and type(old) == "string" then
    return ({ "\0", "\255\254", "\192\128", "\237\160\128", "a\nb", "\\u0000" })[r(6)]
  elseif k == 20 and type(old) == "table" and #old > 0 then
    local t = {}
    for i = #old, 1, -1 do t[#t + 1] = old[i] end
    return t
  end
  return cjson.null
end

-- One change to a decoded JSON value (in place); returns it (the root may
-- be replaced).
local function json_step(r, root, raw)
  local all = slots(root, {}, 0, {})
  if #all == 0 then return wrong_value(r, root, raw) end
  local slot = all[r(#all)]
  local t, key = slot[1], slot[2]
  local k = r(10)
  if k <= 6 then
    t[key] = wrong_value(r, t[key], raw)
  elseif k == 7 then -- drop the key
    if type(key) == "number" then table.remove(t, key) else t[key] = nil end
  elseif k == 8 then -- an unknown key, or another element
    if type(key) == "number" then t[#t + 1] = t[key] else t[key .. "_x" .. r(9)] = t[key] end
  elseif k == 9 then -- swap with another slot's value
    local o = all[r(#all)]
    t[key], o[1][o[2]] = o[1][o[2]], t[key]
  else -- the value's copy somewhere else (a subtree where a leaf was)
    local o = all[r(#all)]
    o[1][o[2]] = t[key]
  end
  return root
end

-- A JSON text mutated as JSON (when it decodes) or as bytes; seal(text),
-- when given, fixes what a checksum or length would otherwise refuse first.
function M.json(r, text, others, seal)
  local ok, v = pcall(cjson.decode, text)
  if not ok or r(5) == 1 then return M.bytes(r, text, others) end
  local raw = {}
  for _ = 1, r(3) do v = json_step(r, v, raw) end
  local eok, out = pcall(encode, v, 0)
  if not eok or not out then return M.bytes(r, text, others) end
  out = out:gsub('"\1RAW(%d+)\1"', function(i) return raw[tonumber(i)] end)
  if seal and r(4) > 1 then out = seal(out) end
  if r(4) == 1 then out = M.bytes(r, out, {}) end
  return out
end

M.encode = function(v) return encode(v, 0) end

-------------------------------------------------------------- safetensors

local function u64(n) return ffi.string(ffi.new("uint64_t[1]", n), 8) end

-- A safetensors file: its header mutated as JSON (the length fixed, mostly)
-- or the whole file as bytes; sometimes the data cut or grown.
function M.safetensors(r, s, others)
  if #s < 8 or r(4) == 1 then return M.bytes(r, s, others) end
  local n = tonumber(ffi.cast("const uint64_t *", ffi.cast("const char *", s))[0])
  if n > #s - 8 then return M.bytes(r, s, others) end
  local header, data = s:sub(9, 8 + n), s:sub(9 + n)
  header = M.json(r, header, {})
  local k = r(8)
  if k == 1 then data = data:sub(1, r(#data + 1) - 1)
  elseif k == 2 then data = data .. ("\0"):rep(r(16))
  end
  local len = #header
  if r(10) == 1 then len = ({ len + 1, len - 1, 0, 2 ^ 40, 100000001, #s })[r(6)] end
  return u64(math.max(0, len)) .. header .. data
end

-------------------------------------------------------------- JSON Lines

-- JSON Lines: one line mutated as JSON, or the whole text as bytes.
function M.jsonl(r, s, others)
  if r(4) == 1 then return M.bytes(r, s, others) end
  local lines = {}
  for l in (s .. "\n"):gmatch("([^\n]*)\n") do lines[#lines + 1] = l end
  local i = r(#lines)
  lines[i] = M.json(r, lines[i], {})
  return table.concat(lines, "\n")
end

-------------------------------------------------------------- token files

-- A token file: an int32 of its header (mostly magic, version or count)
-- set to an interesting value, the tokens cut or grown, or bytes.
function M.token_file(r, s, others)
  if #s < 1024 or r(3) == 1 then return M.bytes(r, s, others) end
  local header = ffi.new("int32_t[256]")
  ffi.copy(header, s, 1024)
  local body = s:sub(1025)
  for _ = 1, r(2) do
    local i = r(4) == 1 and r(256) - 1 or r(3) - 1
    local k = r(4)
    if k == 1 then header[i] = INTERESTING_INTS[r(#INTERESTING_INTS)]
    elseif k == 2 then header[i] = header[i] + r(5) - 3
    elseif k == 3 then header[i] = -header[i]
    else header[i] = bit.tobit(header[i] * ({ 2, 256, 65536 })[r(3)])
    end
  end
  local k = r(6)
  if k == 1 then body = body:sub(1, r(#body + 1) - 1)
  elseif k == 2 then body = body .. body:sub(1, r(64))
  elseif k == 3 then body = M.bytes(r, body, {})
  end
  return ffi.string(header, 1024) .. body
end

return M
