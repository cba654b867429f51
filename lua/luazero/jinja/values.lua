-- jinja/values.lua — Python's semantics for the values a chat template
-- handles: None and undefined, str() and repr(), truth, len(), indexing and
-- slicing by code point, attributes and the string and dict methods, ==, in,
-- arithmetic, comparisons, and the tests, filters and globals of luazero.jinja.
local cjson = require("cjson")
local decimal = require("luazero.io.decimal")

local V = {}

local NONE = setmetatable({}, { __tostring = function() return "None" end })
local UNDEF = setmetatable({}, { __tostring = function() return "" end })
-- ORDER[t]: the keys of a dict in the order they were written (jinja/json.lua
-- records it; a dict without one iterates in sorted key order). A table in
-- ORDER is a dict even when empty.
local ORDER = setmetatable({}, { __mode = "k" })
-- NUMTEXT[t][key]: how JSON text wrote a number that a Lua number cannot
-- tell apart (jinja/json.lua records it): "float" for a whole number written
-- as one (1.0, 1e3: Python's json.loads makes a float, which tojson writes
-- back as 1.0, 1000.0), or the digits of an integer past 2^53 (Python's is
-- exact). tojson writes the value so while it is the one read.
local NUMTEXT = setmetatable({}, { __mode = "k" })

local function fail(msg) error(msg, 0) end

--------------------------------------------------------------- strings (Python semantics)

local sub, byte, char, concat = string.sub, string.byte, string.char, table.concat

-- Python's str.isspace code points, as UTF-8.
local SPACES = {}
for _, b in ipairs({ 9, 10, 11, 12, 13, 28, 29, 30, 31, 32 }) do SPACES[char(b)] = true end
for _, cp in ipairs({ 0x85, 0xA0, 0x1680, 0x2000, 0x2001, 0x2002, 0x2003, 0x2004, 0x2005,
                      0x2006, 0x2007, 0x2008, 0x2009, 0x200A, 0x2028, 0x2029, 0x202F, 0x205F,
                      0x3000 }) do
  if cp < 0x800 then
    SPACES[char(0xC0 + math.floor(cp / 64), 0x80 + cp % 64)] = true
  else
    SPACES[char(0xE0 + math.floor(cp / 4096), 0x80 + math.floor(cp / 64) % 64, 0x80 + cp % 64)] = true
  end
end

local function char_len(b)
  if not b or b < 0xC0 then return 1 elseif b < 0xE0 then return 2 elseif b < 0xF0 then return 3 end
  return 4
end

-- The code points of s as a list of UTF-8 strings.
local function chars(s)
  local out, p, n = {}, 1, #s
  while p <= n do
    local l = char_len(byte(s, p))
    out[#out + 1] = sub(s, p, p + l - 1)
    p = p + l
  end
  return out
end

-- Python's str.strip / lstrip / rstrip: whitespace, or the characters of set.
local function strip(s, set, left, right)
  local cs, drop = chars(s), SPACES
  if set ~= nil and set ~= NONE then
    drop = {}
    for _, c in ipairs(chars(set)) do drop[c] = true end
  end
  local i, j = 1, #cs
  if left then while i <= j and drop[cs[i]] do i = i + 1 end end
  if right then while j >= i and drop[cs[j]] do j = j - 1 end end
  return concat(cs, "", i, j)
end

local function is_list(t)
  return type(t) == "table" and not ORDER[t] and (t[1] ~= nil or next(t) == nil)
end

local function by_name(a, b) return tostring(a) < tostring(b) end

-- The keys of dict d: in their written order, then any others sorted.
local function keys_of(d)
  local out, seen = {}, {}
  for _, k in ipairs(ORDER[d] or {}) do
    if d[k] ~= nil and not seen[k] then out[#out + 1], seen[k] = k, true end
  end
  local rest = {}
  for k in pairs(d) do
    if not seen[k] and k ~= "__namespace" then rest[#rest + 1] = k end
  end
  table.sort(rest, by_name)
  for _, k in ipairs(rest) do out[#out + 1] = k end
  return out
end

-- Python's repr of a float: the fewest digits that read back the same, in
-- positional form from 1e-4 to below 1e16 (with ".0" when whole), else
-- d.ddde+XX.
local function float_repr(v)
  if v ~= v then return "NaN" end
  if v == math.huge then return "Infinity" elseif v == -math.huge then return "-Infinity" end
  local s
  for p = 0, 17 do
    s = ("%." .. p .. "e"):format(v)
    if tonumber(s) == v then break end
  end
  local sign, m, e = s:match("^(-?)([%d%.]+)e([-+]%d+)$")
  local digits, exp = m:gsub("%.", ""), tonumber(e)
  digits = digits:gsub("(%d)0+$", "%1")
  if exp >= -4 and exp < 16 then
    if exp < 0 then return sign .. "0." .. ("0"):rep(-exp - 1) .. digits end
    local int = digits:sub(1, exp + 1)
    int = int .. ("0"):rep(exp + 1 - #int)
    local frac = digits:sub(exp + 2)
    return sign .. int .. "." .. (frac == "" and "0" or frac)
  end
  local mant = digits:sub(1, 1) .. (#digits > 1 and ("." .. digits:sub(2)) or "")
  return ("%s%se%s%02d"):format(sign, mant, exp < 0 and "-" or "+", math.abs(exp))
end

local repr

-- Python's str() of a value, as {{ }} prints it.
local function str(v)
  local t = type(v)
  if t == "string" then return v end
  if v == nil or v == UNDEF then return "" end
  if v == NONE or v == cjson.null then return "None" end
  if t == "boolean" then return v and "True" or "False" end
  if t == "number" then
    if v == math.floor(v) and math.abs(v) < 2 ^ 53 then return ("%d"):format(v) end
    return float_repr(v)
  end
  return repr(v)
end

-- Python's repr of a string: in single quotes, or double ones when it holds
-- a single quote and no double one; backslash, the quote, \t \n \r and the
-- other ASCII control characters escaped (\xNN).
local REPR_ESC = { ["\\"] = "\\\\", ["\t"] = "\\t", ["\n"] = "\\n", ["\r"] = "\\r" }
local function repr_string(v)
  local q = (v:find("'", 1, true) and not v:find('"', 1, true)) and '"' or "'"
  return q .. v:gsub("[%c\\'\"]", function(c)
    if c == q then return "\\" .. c end
    if c == "'" or c == '"' then return c end
    return REPR_ESC[c] or ("\\x%02x"):format(c:byte())
  end) .. q
end

function repr(v)
  if type(v) == "string" then return repr_string(v) end
  if type(v) ~= "table" or v == NONE or v == UNDEF then return str(v) end
  local parts = {}
  if is_list(v) then
    for i = 1, #v do parts[i] = repr(v[i]) end
    return "[" .. concat(parts, ", ") .. "]"
  end
  for i, k in ipairs(keys_of(v)) do parts[i] = repr(k) .. ": " .. repr(v[k]) end
  return "{" .. concat(parts, ", ") .. "}"
end

local function truthy(v)
  if v == nil or v == false or v == NONE or v == UNDEF or v == cjson.null or v == "" or v == 0 then
    return false
  end
  if type(v) == "table" and not v.__namespace and next(v) == nil then return false end
  return true
end

local function length(v)
  if type(v) == "string" then return #chars(v) end
  if type(v) == "table" then
    if is_list(v) then return #v end
    local n = 0
    for _ in pairs(v) do n = n + 1 end
    return n
  end
  fail(("length of %s: it has no length"):format(repr(v)))
end

local function to_index(v, n, what)
  if type(v) ~= "number" or v % 1 ~= 0 then fail(what .. " must be an integer (got " .. repr(v) .. ")") end
  if v < 0 then v = v + n end
  return v
end

local function python_slice(n, a, b, c)
  c = c or 1
  if c == 0 then fail("a slice step cannot be zero") end
  local function clamp(v, default)
    if v == nil then return default end
    v = to_index(v, n, "a slice bound")
    if c > 0 then return math.max(0, math.min(v, n)) end
    return math.max(-1, math.min(v, n - 1))
  end
  local i = clamp(a, c > 0 and 0 or n - 1)
  local j = clamp(b, c > 0 and n or -1)
  local out = {}
  while (c > 0 and i < j) or (c < 0 and i > j) do
    out[#out + 1] = i
    i = i + c
  end
  return out
end

local function getitem(obj, key)
  if type(obj) == "table" and obj ~= NONE and obj ~= UNDEF then
    if is_list(obj) and type(key) == "number" then
      local i = to_index(key, #obj, "a list index")
      local v = obj[i + 1]
      if v == nil then return UNDEF end
      return v == cjson.null and NONE or v
    end
    local v = obj[key]
    if v == nil then return UNDEF end
    return v == cjson.null and NONE or v
  elseif type(obj) == "string" and type(key) == "number" then
    local cs = chars(obj)
    return cs[to_index(key, #cs, "a string index") + 1] or UNDEF
  elseif obj == UNDEF then
    fail(("cannot take [%s] of an undefined value"):format(repr(key)))
  end
  return UNDEF
end

-- Whether test holds for p, or for any of a tuple p (str.startswith's and
-- endswith's argument).
local function any_of(p, test)
  if type(p) ~= "table" then return test(p) end
  for _, x in ipairs(p) do
    if test(x) then return true end
  end
  return false
end

local STRING_METHODS = {
  strip = function(s, set) return strip(s, set, true, true) end,
  lstrip = function(s, set) return strip(s, set, true, false) end,
  rstrip = function(s, set) return strip(s, set, false, true) end,
  upper = function(s) return s:upper() end,
  lower = function(s) return s:lower() end,
  title = function(s) return (s:lower():gsub("(%a)([%w]*)", function(a, b) return a:upper() .. b end)) end,
  capitalize = function(s) return s:sub(1, 1):upper() .. s:sub(2):lower() end,
  startswith = function(s, p) return any_of(p, function(x) return sub(s, 1, #x) == x end) end,
  endswith = function(s, p)
    return any_of(p, function(x) return x == "" or sub(s, -#x) == x end)
  end,
  replace = function(s, a, b)
    local out, i = {}, 1
    if a == "" then fail("str.replace with an empty pattern is not supported") end
    while true do
      local p = s:find(a, i, true)
      if not p then break end
      out[#out + 1] = sub(s, i, p - 1) .. b
      i = p + #a
    end
    out[#out + 1] = sub(s, i)
    return concat(out)
  end,
  split = function(s, sep)
    local out = {}
    if sep == nil or sep == NONE then
      for w in s:gmatch("%S+") do out[#out + 1] = w end
      return out
    end
    local i = 1
    while true do
      local p = s:find(sep, i, true)
      if not p then break end
      out[#out + 1] = sub(s, i, p - 1)
      i = p + #sep
    end
    out[#out + 1] = sub(s, i)
    return out
  end,
}

local DICT_METHODS = {
  items = function(d)
    local out = {}
    for i, k in ipairs(keys_of(d)) do out[i] = { k, d[k] } end
    return out
  end,
  keys = function(d) return keys_of(d) end,
  values = function(d)
    local out = {}
    for i, k in ipairs(keys_of(d)) do out[i] = d[k] end
    return out
  end,
  get = function(d, k, default)
    local v = d[k]
    if v == nil then return default == nil and NONE or default end
    return v
  end,
}

local function bound(f, obj)
  return { __callable = function(args) return f(obj, unpack(args)) end }
end

local function getattr(obj, name)
  if type(obj) == "string" then
    local f = STRING_METHODS[name]
    if f then return bound(f, obj) end
    return UNDEF
  end
  if obj == UNDEF then fail(("cannot take .%s of an undefined value"):format(name)) end
  if type(obj) == "table" and obj ~= NONE then
    local v = obj[name]
    if v ~= nil then return v == cjson.null and NONE or v end
    if not is_list(obj) and DICT_METHODS[name] then return bound(DICT_METHODS[name], obj) end
  end
  return UNDEF
end

local function equal(a, b)
  if a == b then return true end
  if (a == NONE or a == cjson.null) and (b == NONE or b == cjson.null) then return true end
  -- (Python's bool is an int: True == 1, False == 0)
  if type(a) == "boolean" and type(b) == "number" then return (a and 1 or 0) == b end
  if type(b) == "boolean" and type(a) == "number" then return (b and 1 or 0) == a end
  if type(a) ~= "table" or type(b) ~= "table" or a == NONE or b == NONE or a == UNDEF or
     b == UNDEF then
    return false
  end
  local la, lb = is_list(a), is_list(b)
  if la and lb and #a == #b then
    for i = 1, #a do if not equal(a[i], b[i]) then return false end end
    return true
  end
  if la or lb then return false end
  -- dicts, as Python compares them: the same keys, equal values (Mistral's
  -- template finds the last user message by ==)
  for k, v in pairs(a) do if b[k] == nil or not equal(v, b[k]) then return false end end
  for k in pairs(b) do if a[k] == nil then return false end end
  return true
end

local function contains(container, item)
  if type(container) == "string" then
    if type(item) ~= "string" then fail("'in <string>' needs a string on the left") end
    return container:find(item, 1, true) ~= nil
  end
  if type(container) == "table" and container ~= NONE and container ~= UNDEF then
    if is_list(container) then
      for _, v in ipairs(container) do if equal(v, item) then return true end end
      return false
    end
    return container[item] ~= nil
  end
  fail(("'in' needs a string, list or dict on the right (got %s)"):format(repr(container)))
end

local function number(v, what)
  if type(v) == "boolean" then return v and 1 or 0 end
  if type(v) ~= "number" then fail(("%s needs numbers (got %s)"):format(what, repr(v))) end
  return v
end

local function arith(op, a, b)
  if op == "+" then
    if type(a) == "string" and type(b) == "string" then return a .. b end
    if is_list(a) and is_list(b) and a ~= NONE and b ~= NONE and a ~= UNDEF and b ~= UNDEF then
      local out = {}
      for _, v in ipairs(a) do out[#out + 1] = v end
      for _, v in ipairs(b) do out[#out + 1] = v end
      return out
    end
    if (type(a) == "string") ~= (type(b) == "string") then
      fail(("cannot add %s and %s (a string and a non-string); use ~ to join them as text")
           :format(repr(a), repr(b)))
    end
  end
  if op == "*" and type(a) == "string" and type(b) == "number" then return a:rep(b) end
  local x, y = number(a, "'" .. op .. "'"), number(b, "'" .. op .. "'")
  if op == "+" then return x + y elseif op == "-" then return x - y
  elseif op == "*" then return x * y elseif op == "**" then return x ^ y end
  if y == 0 then fail("division by zero") end
  if op == "/" then return x / y elseif op == "//" then return math.floor(x / y) end
  return x - math.floor(x / y) * y -- Python's %
end

local function compare(op, a, b)
  if op == "==" then return equal(a, b) end
  if op == "!=" then return not equal(a, b) end
  if type(a) ~= type(b) or (type(a) ~= "number" and type(a) ~= "string") then
    fail(("cannot compare %s %s %s"):format(repr(a), op, repr(b)))
  end
  if op == "<" then return a < b elseif op == ">" then return a > b
  elseif op == "<=" then return a <= b end
  return a >= b
end

local TESTS = {
  defined = function(v) return v ~= UNDEF end,
  undefined = function(v) return v == UNDEF end,
  none = function(v) return v == NONE or v == cjson.null end,
  string = function(v) return type(v) == "string" end,
  number = function(v) return type(v) == "number" end,
  integer = function(v) return type(v) == "number" and v % 1 == 0 end,
  boolean = function(v) return type(v) == "boolean" end,
  ["true"] = function(v) return v == true end,
  ["false"] = function(v) return v == false end,
  mapping = function(v) return type(v) == "table" and v ~= NONE and v ~= UNDEF and not is_list(v) end,
  sequence = function(v) return type(v) == "string" or (is_list(v) and v ~= NONE and v ~= UNDEF) end,
  iterable = function(v) return type(v) == "string" or (type(v) == "table" and v ~= NONE and v ~= UNDEF) end,
  even = function(v) return number(v, "is even") % 2 == 0 end,
  odd = function(v) return number(v, "is odd") % 2 == 1 end,
  divisibleby = function(v, d) return number(v, "is divisibleby") % number(d, "is divisibleby") == 0 end,
  eq = equal, equalto = equal, sameas = function(a, b) return a == b end,
  ne = function(a, b) return not equal(a, b) end,
  lt = function(a, b) return compare("<", a, b) end, gt = function(a, b) return compare(">", a, b) end,
  le = function(a, b) return compare("<=", a, b) end, ge = function(a, b) return compare(">=", a, b) end,
}

-- A string as Python's json.dumps writes it: with ensure_ascii (jinja2's
-- own tojson) every non-ASCII character as \uXXXX (surrogate pairs beyond),
-- without it (transformers' tojson) as UTF-8; html: jinja2's <, >, & and '
-- escapes.
local JSON_ESC = { ['"'] = '\\"', ["\\"] = "\\\\", ["\n"] = "\\n", ["\r"] = "\\r", ["\t"] = "\\t",
                   ["\b"] = "\\b", ["\f"] = "\\f" }
local HTML_SAFE = { ["<"] = "\\u003c", [">"] = "\\u003e", ["&"] = "\\u0026", ["'"] = "\\u0027" }
local function json_string(v, ascii, html)
  local s = v:gsub('[%z\1-\31"\\]', function(c) return JSON_ESC[c] or ("\\u%04x"):format(byte(c)) end)
  if html then s = s:gsub("[<>&']", HTML_SAFE) end
  if ascii then
    s = s:gsub("[\xC0-\xF7][\x80-\xBF]*", function(c)
      local b, cp = byte(c), 0
      local l = char_len(b)
      cp = b % (l == 2 and 32 or l == 3 and 16 or 8)
      for i = 2, #c do cp = cp * 64 + byte(c, i) % 64 end
      if cp < 0x10000 then return ("\\u%04x"):format(cp) end
      cp = cp - 0x10000
      return ("\\u%04x\\u%04x"):format(0xD800 + math.floor(cp / 1024), 0xDC00 + cp % 1024)
    end)
  end
  return '"' .. s .. '"'
end

-- A number as Python writes it: an integer without a point, else the
-- shortest text that reads back the same.
local function json_number(v)
  if v ~= v then return "NaN" end
  if v == math.huge then return "Infinity" elseif v == -math.huge then return "-Infinity" end
  return decimal.shortest(v)
end

-- A number at key k of table t, as the JSON it was read from wrote it.
local function json_number_at(t, k, v)
  local how = NUMTEXT[t] and NUMTEXT[t][k]
  if how == "float" then return float_repr(v) end
  if how and tonumber(how) == v then return how end
  return json_number(v)
end

-- json.dumps(v, ensure_ascii, indent, separators, sort_keys) as Python
-- writes it (opts: ascii, html, indent, item_sep, key_sep, sort).
local function to_json(v, opts, level)
  level = level or 0
  if v == NONE or v == UNDEF or v == nil or v == cjson.null then return "null" end
  if type(v) == "boolean" then return v and "true" or "false" end
  if type(v) == "number" then return json_number(v) end
  if type(v) == "string" then return json_string(v, opts.ascii, opts.html) end
  if type(v) ~= "table" then fail(("tojson: %s is not JSON"):format(repr(v))) end
  local indent = opts.indent
  local pad = indent and ("\n" .. (" "):rep(indent * (level + 1))) or ""
  local close = indent and ("\n" .. (" "):rep(indent * level)) or ""
  local parts = {}
  if is_list(v) then
    if #v == 0 then return "[]" end
    for i = 1, #v do
      parts[i] = pad .. (type(v[i]) == "number" and json_number_at(v, i, v[i]) or
                         to_json(v[i], opts, level + 1))
    end
    return "[" .. concat(parts, opts.item_sep) .. close .. "]"
  end
  local keys = keys_of(v)
  if #keys == 0 then return "{}" end
  if opts.sort then table.sort(keys, by_name) end
  for i, k in ipairs(keys) do
    parts[i] = pad .. json_string(tostring(k), opts.ascii, opts.html) .. opts.key_sep ..
               (type(v[k]) == "number" and json_number_at(v, k, v[k]) or
                to_json(v[k], opts, level + 1))
  end
  return "{" .. concat(parts, opts.item_sep) .. close .. "}"
end

-- The tojson filter of transformers' renderer (4.43 and later, 5.x):
-- json.dumps(x, ensure_ascii=False, indent=None, separators=None,
-- sort_keys=False): keys in their written order, UTF-8 kept, no HTML escapes;
-- positional arguments in that order (ensure_ascii first).
local function tojson(v, args, kw)
  local indent = kw.indent
  if indent == nil then indent = args[2] end
  if indent == NONE then indent = nil end
  if indent ~= nil and type(indent) ~= "number" then
    fail(("tojson: indent %s is not supported; give a number"):format(repr(indent)))
  end
  local ascii = kw.ensure_ascii
  if ascii == nil then ascii = args[1] end
  local seps = kw.separators
  if seps == nil then seps = args[3] end
  local sort = kw.sort_keys
  if sort == nil then sort = args[4] end
  local opts = { ascii = truthy(ascii), indent = indent, sort = truthy(sort),
                 item_sep = indent and "," or ", ", key_sep = ": " }
  if seps ~= nil and seps ~= NONE then
    if type(seps) ~= "table" or #seps ~= 2 or type(seps[1]) ~= "string" or type(seps[2]) ~= "string" then
      fail(("tojson: separators %s must be two strings"):format(repr(seps)))
    end
    opts.item_sep, opts.key_sep = seps[1], seps[2]
  end
  return to_json(v, opts)
end

local FILTERS = {
  trim = function(v, set) return strip(str(v), set, true, true) end,
  length = length, count = length,
  upper = function(v) return str(v):upper() end,
  lower = function(v) return str(v):lower() end,
  capitalize = function(v) return STRING_METHODS.capitalize(str(v)) end,
  -- jinja2's: each word's first letter up and the rest down, words
  -- begun by blanks, dashes and opening brackets (not by an apostrophe,
  -- which str.title begins one at)
  title = function(v)
    local text = str(v)
    return (text:lower():gsub("()(%a)", function(at, c)
      local before = at > 1 and text:sub(at - 1, at - 1) or ""
      return (before == "" or before:find("^[%s%-%({%[<]$")) and c:upper() or c
    end))
  end,
  string = function(v) return str(v) end,
  safe = function(v) return v end,
  -- Python's int(): toward zero
  int = function(v)
    local x = tonumber(v) or 0
    return x < 0 and math.ceil(x) or math.floor(x)
  end,
  float = function(v) return tonumber(v) or 0 end,
  abs = function(v) return math.abs(number(v, "abs")) end,
  default = function(v, d, boolean)
    if v == UNDEF or (boolean and not truthy(v)) then return d == nil and "" or d end
    return v
  end,
  first = function(v) return getitem(v, 0) end,
  last = function(v) return getitem(v, -1) end,
  list = function(v) return type(v) == "string" and chars(v) or v end,
  reverse = function(v)
    local items = type(v) == "string" and chars(v) or v
    local out = {}
    for i = #items, 1, -1 do out[#out + 1] = items[i] end
    return type(v) == "string" and concat(out) or out
  end,
  replace = function(v, a, b) return STRING_METHODS.replace(str(v), a, b) end,
  items = function(v) return DICT_METHODS.items(v) end,
}
FILTERS.d = FILTERS.default

-- Filters over a list, called with (value, args, kwargs).
local function test_by_name(name, what)
  local t = TESTS[name]
  if not t then fail(("the test %s in %s is not supported"):format(repr(name), what)) end
  return t
end

local function sequence(v, what)
  if type(v) == "string" then return chars(v) end
  if v == UNDEF or v == NONE then return {} end
  if type(v) ~= "table" then fail(("%s needs a list (got %s)"):format(what, repr(v))) end
  return is_list(v) and v or DICT_METHODS.keys(v)
end

local function choose(keep, by_attr)
  return function(v, args, kw)
    local what = (by_attr and (keep and "selectattr" or "rejectattr")) or (keep and "select" or "reject")
    local attr = by_attr and args[1]
    local rest = by_attr and 2 or 1
    local test = args[rest] and test_by_name(args[rest], "|" .. what) or truthy
    local out = {}
    for _, x in ipairs(sequence(v, "|" .. what)) do
      local y = attr and getattr(x, attr) or x
      if (test(y, args[rest + 1]) and true or false) == keep then out[#out + 1] = x end
    end
    return out
  end
end

local SEQ_FILTERS = {
  select = choose(true, false), reject = choose(false, false),
  selectattr = choose(true, true), rejectattr = choose(false, true),
  map = function(v, args, kw)
    local out = {}
    for i, x in ipairs(sequence(v, "|map")) do
      if kw.attribute ~= nil then
        local y = getattr(x, kw.attribute)
        if y == UNDEF and kw.default ~= nil then y = kw.default end
        out[i] = y
      else
        local f = FILTERS[args[1]]
        if not f then fail(("the filter %s in |map is not supported"):format(repr(args[1]))) end
        out[i] = f(x, unpack(args, 2))
      end
    end
    return out
  end,
  -- jinja2's join(value, d="", attribute=None)
  join = function(v, args, kw)
    local sep, attr, parts = args[1] or kw.d or "", kw.attribute, {}
    for i, x in ipairs(sequence(v, "|join")) do parts[i] = str(attr ~= nil and getattr(x, attr) or x) end
    return concat(parts, str(sep))
  end,
  unique = function(v)
    local out = {}
    for _, x in ipairs(sequence(v, "|unique")) do
      local seen = false
      for _, y in ipairs(out) do if equal(x, y) then seen = true break end end
      if not seen then out[#out + 1] = x end
    end
    return out
  end,
}

local MAX_RANGE = 100000 -- jinja2.sandbox.MAX_RANGE

local GLOBALS = {
  range = { __callable = function(args)
    local a, b, c = args[1], args[2], args[3] or 1
    if b == nil then a, b = 0, a end
    if c == 0 then fail("range() step must not be zero") end
    -- jinja2's sandbox, which transformers renders templates in, caps a
    -- range at MAX_RANGE items: the same template fails there too
    local n = math.max(0, math.ceil((b - a) / c))
    if n > MAX_RANGE then
      fail(("range(%s, %s, %s) would make %d items, more than the %d jinja2's sandbox allows " ..
            "a template; make the template's range smaller"):format(str(a), str(b), str(c), n,
            MAX_RANGE))
    end
    local out, i = {}, a
    while (c > 0 and i < b) or (c < 0 and i > b) do out[#out + 1] = i; i = i + c end
    return out
  end },
  namespace = { __callable = function(_, kwargs)
    local ns = { __namespace = true }
    for k, v in pairs(kwargs) do ns[k] = v end
    return ns
  end },
}

V.NONE, V.UNDEF, V.ORDER, V.fail, V.keys_of, V.tojson = NONE, UNDEF, ORDER, fail, keys_of, tojson
V.NUMTEXT, V.float_repr = NUMTEXT, float_repr
V.chars, V.strip, V.str, V.repr, V.truthy, V.length, V.is_list = chars, strip, str, repr, truthy, length, is_list
V.python_slice, V.getitem, V.getattr, V.arith, V.compare, V.contains, V.number =
  python_slice, getitem, getattr, arith, compare, contains, number
V.TESTS, V.FILTERS, V.SEQ_FILTERS, V.GLOBALS, V.DICT_METHODS =
  TESTS, FILTERS, SEQ_FILTERS, GLOBALS, DICT_METHODS
return V
