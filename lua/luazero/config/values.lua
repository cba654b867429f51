-- config/values.lua — reading DeepSpeed JSON values: each checker returns
-- the value or raises one line starting "config: " that names the key, the
-- allowed values and what was given (as it would appear in the file).
local oneline = require("luazero.io.oneline")
local cjson = require("cjson")

local M = {}

local function fail(fmt, ...) error(oneline.of("config: " .. fmt:format(...)), 0) end

-- A value as it would appear in the JSON file.
local function show(v)
  if type(v) == "string" then return cjson.encode(v) end
  if type(v) == "number" then
    if v == math.floor(v) and math.abs(v) < 1e15 then return ("%d"):format(v) end
    return ("%.14g"):format(v)
  end
  if type(v) == "table" then return "a " .. (v[1] ~= nil and "list" or "block") end
  if v == cjson.null then return "null" end
  return tostring(v)
end

-- JSON null and "auto" (Hugging Face's placeholder) both mean "not given":
-- the default or a command-line override fills the key.
local function given(v) return v ~= nil and v ~= cjson.null and v ~= "auto" end

local function is_whole(v) return type(v) == "number" and v == math.floor(v) and v == v and
                                  v ~= math.huge and v ~= -math.huge end

local function number_at_least(key, v, min)
  if type(v) == "number" and v == math.huge then
    fail("%s must be a finite number >= %s (got %s)", key, show(min), show(v))
  end
  if type(v) ~= "number" or v ~= v or v < min then
    fail("%s must be a number >= %s (got %s)", key, show(min), show(v))
  end
  return v
end

local function whole_at_least(key, v, min)
  if not is_whole(v) or v < min then
    fail("%s must be a whole number >= %d (got %s)", key, min, show(v))
  end
  return v
end

local function positive_whole(key, v)
  if type(v) ~= "number" or v ~= v or v <= 0 or v == math.huge then
    fail("%s must be a positive number (got %s)", key, show(v))
  end
  if not is_whole(v) then fail("%s must be a whole number (got %s)", key, show(v)) end
  return v
end

local function boolean(key, v)
  if type(v) ~= "boolean" then fail("%s must be true or false (got %s)", key, show(v)) end
  return v
end

local function block(key, v)
  if type(v) ~= "table" or (next(v) ~= nil and v[1] ~= nil) then
    fail("%s must be a JSON object {...} (got %s)", key, show(v))
  end
  return v
end

-- A key that asks for nothing (false, or a block with "enabled": false) is
-- accepted silently even where luazero does not implement the feature.
local function asks_for_nothing(v)
  if v == false or v == cjson.null then return true end
  return type(v) == "table" and v.enabled == false
end

local function sorted_keys(t)
  local ks = {}
  for k in pairs(t) do ks[#ks + 1] = k end
  table.sort(ks)
  return ks
end

------------------------------------------------------------------ reading

-- The first key an object of JSON text holds twice (DeepSpeed refuses such
-- a file; a decoder keeps the last), with its line; nil if none. text is
-- valid JSON.
local function duplicate_key(text)
  local stack, i, n, line = {}, 1, #text, 1
  while i <= n do
    local c = text:sub(i, i)
    if c == '"' then
      local j = i + 1
      while true do
        local q = text:find('["\\]', j)
        if text:sub(q, q) == "\\" then j = q + 2 else j = q break end
      end
      local top = stack[#stack]
      if top and top.object and top.want_key then
        local key = text:sub(i + 1, j - 1)
        if top.keys[key] then return key, line end
        top.keys[key], top.want_key = true, false
      end
      i = j
    elseif c == "{" or c == "[" then
      stack[#stack + 1] = { object = c == "{", keys = {}, want_key = c == "{" }
    elseif c == "}" or c == "]" then
      stack[#stack] = nil
    elseif c == "," then
      local top = stack[#stack]
      if top and top.object then top.want_key = true end
    elseif c == "\n" then
      line = line + 1
    end
    i = i + 1
  end
end

local function read_json(path)
  local f, err = io.open(path, "rb")
  if not f then
    fail("%s: cannot read it (%s)", path, (err or ""):gsub("^[^:]*: ", ""))
  end
  local text, rerr = f:read("*a")
  f:close()
  if not text then fail("%s: cannot read it (%s)", path, tostring(rerr)) end
  if text:sub(1, 3) == "\239\187\191" then
    fail("%s: starts with a UTF-8 byte order mark (EF BB BF), which JSON does not allow; save " ..
         "the file as UTF-8 without it", path)
  end
  local ok, decoded = pcall(cjson.decode, text)
  if not ok then
    local why = tostring(decoded):gsub("^.-:%d+: ", "")
    local at = tonumber(why:match("at character (%d+)"))
    if at then -- (the line and column of cjson's character offset)
      local before = text:sub(1, at)
      why = ("%s: line %d, column %d"):format(why, select(2, before:gsub("\n", "")) + 1,
                                              #before - (before:match(".*\n()") or 1) + 1)
    end
    fail("%s: not valid JSON (%s)", path, why)
  end
  local dup, dup_line = duplicate_key(text)
  if dup then
    fail('%s: line %d: key "%s" is given twice in one object; keep one (DeepSpeed refuses ' ..
         "the file too)", path, dup_line, dup)
  end
  if type(decoded) ~= "table" or (next(decoded) ~= nil and decoded[1] ~= nil) then
    fail("%s: the top level must be a JSON object {...} (got %s)", path, show(decoded))
  end
  return decoded
end
M.read_json = read_json

local function deep_copy(v)
  if type(v) ~= "table" then return v end
  local c = {}
  for k, x in pairs(v) do c[k] = deep_copy(x) end
  return c
end

M.fail, M.show, M.given, M.is_whole = fail, show, given, is_whole
M.number_at_least, M.whole_at_least, M.positive_whole = number_at_least, whole_at_least,
                                                        positive_whole
M.boolean, M.block, M.asks_for_nothing, M.sorted_keys = boolean, block, asks_for_nothing,
                                                        sorted_keys
M.deep_copy = deep_copy

-- The edits (letters inserted, deleted, replaced, or two neighbours
-- swapped) that take a to b.
local function edits(a, b)
  local d = {}
  for i = 0, #a do d[i] = { [0] = i } end
  for j = 0, #b do d[0][j] = j end
  for i = 1, #a do
    for j = 1, #b do
      local cost = a:byte(i) == b:byte(j) and 0 or 1
      d[i][j] = math.min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost)
      if i > 1 and j > 1 and a:byte(i) == b:byte(j - 1) and a:byte(i - 1) == b:byte(j) then
        d[i][j] = math.min(d[i][j], d[i - 2][j - 2] + 1)
      end
    end
  end
  return d[#a][#b]
end

-- The key of `known` (a set of the keys a section reads) that k is likely a
-- misspelling of: the nearest, at most two edits away (one for a key of
-- under six letters); nil for none.
local function closest(k, known)
  if type(k) ~= "string" then return nil end
  local best, best_d = nil, math.huge
  for _, c in ipairs(sorted_keys(known)) do
    local d = edits(k, c)
    if d < best_d then best, best_d = c, d end
  end
  if best and best_d > 0 and best_d <= (#best < 6 and 1 or 2) then return best end
end

M.closest = closest

-- " (did you mean <prefix><key>?)" for closest's key; "" for none.
function M.did_you_mean(k, known, prefix)
  local best = closest(k, known)
  return best and (" (did you mean %s%s?)"):format(prefix or "", best) or ""
end

-- Refuses key k of a block (prefix: "zero_optimization.") when it is a
-- likely misspelling of one of the block's keys `known` (a set) and none of
-- `real` (keys DeepSpeed has that are no misspelling, themselves misspelt
-- too): ignored, it would leave the run without what it meant (a stage, an
-- offload, an lr).
function M.refuse_misspelt(k, known, prefix, real)
  if real and real[k] then return end
  local both = known
  if real then
    both = {}
    for c in pairs(known) do both[c] = true end
    for c in pairs(real) do both[c] = true end
  end
  local best = closest(k, both)
  if best then
    fail("%s%s is not a key there; did you mean %s%s? (a misspelt key would be ignored and the " ..
         "run go on without it)", prefix, k, prefix, best)
  end
end

return M
