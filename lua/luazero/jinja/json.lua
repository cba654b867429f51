-- jinja/json.lua — JSON text to the values a chat template reads, keeping
-- what Python's json.loads keeps and cjson drops: the order of an object's
-- keys (tojson writes them in that order, as transformers' tojson does) and
-- whether an empty table was {} or []. Objects are recorded in values.ORDER;
-- null is jinja's None.
local values = require("luazero.jinja.values")

local NONE, ORDER, NUMTEXT = values.NONE, values.ORDER, values.NUMTEXT
local byte, sub, char, concat = string.byte, string.sub, string.char, table.concat

local J = {}

local function fail(src, p, what)
  local line = select(2, sub(src, 1, p):gsub("\n", "")) + 1
  error(("json: line %d: %s"):format(line, what), 0)
end

local function utf8_of(cp)
  if cp < 0x80 then return char(cp) end
  if cp < 0x800 then return char(0xC0 + math.floor(cp / 64), 0x80 + cp % 64) end
  if cp < 0x10000 then
    return char(0xE0 + math.floor(cp / 4096), 0x80 + math.floor(cp / 64) % 64, 0x80 + cp % 64)
  end
  return char(0xF0 + math.floor(cp / 262144), 0x80 + math.floor(cp / 4096) % 64,
              0x80 + math.floor(cp / 64) % 64, 0x80 + cp % 64)
end

local ESC = { ['"'] = '"', ["\\"] = "\\", ["/"] = "/", b = "\b", f = "\f", n = "\n", r = "\r",
              t = "\t" }

local value

local function skip(src, p) return src:match("^[ \t\r\n]*()", p) end

local function str(src, p) -- p at the opening quote
  local out, i = {}, p + 1
  while true do
    local q = src:find('["\\]', i)
    if not q then fail(src, p, "a string is not closed") end
    out[#out + 1] = sub(src, i, q - 1)
    if sub(src, q, q) == '"' then return concat(out), q + 1 end
    local e = sub(src, q + 1, q + 1)
    if e == "u" then
      local cp = tonumber(sub(src, q + 2, q + 5), 16)
      if not cp then fail(src, q, "a \\u escape needs four hex digits") end
      i = q + 6
      if cp >= 0xD800 and cp < 0xDC00 and sub(src, i, i + 1) == "\\u" then
        local lo = tonumber(sub(src, i + 2, i + 5), 16)
        if lo and lo >= 0xDC00 and lo < 0xE000 then
          cp, i = 0x10000 + (cp - 0xD800) * 1024 + (lo - 0xDC00), i + 6
        end
      end
      out[#out + 1] = utf8_of(cp)
    elseif ESC[e] then
      out[#out + 1], i = ESC[e], q + 2
    else
      fail(src, q, "unknown escape \\" .. e)
    end
  end
end

-- Notes in NUMTEXT how the JSON wrote number v (its text lit) at key k of
-- table t, where a Lua number cannot tell: a whole float, a big integer.
local function note_number(t, k, v, lit)
  if not lit then return end
  local how
  if lit:find("[.eE]") then
    if v == math.floor(v) and v - v == 0 then how = "float" end
  elseif math.abs(v) >= 2 ^ 53 then
    how = lit
  end
  if how then
    NUMTEXT[t] = NUMTEXT[t] or {}
    NUMTEXT[t][k] = how
  end
end

function value(src, p)
  p = skip(src, p)
  local c = sub(src, p, p)
  if c == "{" then
    local obj, keys = {}, {}
    ORDER[obj] = keys
    p = skip(src, p + 1)
    if sub(src, p, p) == "}" then return obj, p + 1 end
    while true do
      if sub(src, p, p) ~= '"' then fail(src, p, "an object key must be a string") end
      local k
      k, p = str(src, p)
      p = skip(src, p)
      if sub(src, p, p) ~= ":" then fail(src, p, "expected : after an object key") end
      local v, lit
      v, p, lit = value(src, p + 1)
      if obj[k] == nil then keys[#keys + 1] = k end
      obj[k] = v
      note_number(obj, k, v, lit)
      p = skip(src, p)
      local d = sub(src, p, p)
      if d == "}" then return obj, p + 1 end
      if d ~= "," then fail(src, p, "expected , or } in an object") end
      p = skip(src, p + 1)
    end
  elseif c == "[" then
    local list = {}
    p = skip(src, p + 1)
    if sub(src, p, p) == "]" then return list, p + 1 end
    while true do
      local v, lit
      v, p, lit = value(src, p)
      list[#list + 1] = v
      note_number(list, #list, v, lit)
      p = skip(src, p)
      local d = sub(src, p, p)
      if d == "]" then return list, p + 1 end
      if d ~= "," then fail(src, p, "expected , or ] in a list") end
      p = p + 1
    end
  elseif c == '"' then
    return str(src, p)
  elseif src:find("^true", p) then return true, p + 4
  elseif src:find("^false", p) then return false, p + 5
  elseif src:find("^null", p) then return NONE, p + 4
  end
  local num = src:match("^-?%d+%.?%d*[eE]?[-+]?%d*", p)
  if num and tonumber(num) then return tonumber(num), p + #num, num end
  fail(src, p, ("unexpected %q"):format(sub(src, p, p + 9)))
end

-- The value of JSON text; errors are one line ("json: line N: ...").
function J.decode(src)
  if byte(src, 1) == 0xEF then src = sub(src, 4) end -- a UTF-8 byte order mark
  local v, p = value(src, 1)
  p = skip(src, p)
  if p <= #src then fail(src, p, "text after the JSON value") end
  return v
end

return J
