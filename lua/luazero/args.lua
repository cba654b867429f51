-- args.lua — command-line flags for scripts: "--name value" or "--name=value",
-- typed, with defaults. Errors are plain one-line strings naming the flag.
--
--   local flags = args.parse(arg, {
--     { "steps", "int", 100, "optimizer steps" },
--     { "lr", "number", nil, "peak learning rate" },
--     { "model", "string", "gpt2-nano", "model size" },
--     { "checkpoint-activations", "flag", false, "switch: on when given" },
--     { "keep", "int", 0, "checkpoints kept", min = 0, needs = "save" },
--   })
--
-- Beside the four fields a flag declares what it takes and what it needs;
-- one check (M.check, run by parse) refuses the flags that break it with
-- one line naming the flag and the fix:
--   required = "what it names"     the flag must be given
--   min, max = n                   inclusive bounds (min may be a function
--                                  of the flags: its bound for this run)
--   over = n                       an exclusive lower bound
--   why = "text"                   said after a range's refusal
--   choices = { "a", "b" }         the values it takes
--   needs = "flag"                 alone it does nothing: that flag must be
--                                  set (its `arg` says what to add)
--   needs = { flag = "f" | ok = function(flags), says = "text" }
--                                  the same, `says` the refusal after the
--                                  flag (default: "without --f does
--                                  nothing: add --f ARG or drop --name"),
--                                  or a function(flags) of the whole line;
--                                  `with` = { "--flag", "value", ... }:
--                                  flags that meet an `ok`, `alone` flags
--                                  that fail it where the defaults meet it
--                                  (examples tests/lua/test_flag_schema.lua
--                                  runs)
--   aliases = { "deepspeed" }      what other tools call this flag: given,
--                                  it is refused naming this one
-- A `needs` holds only when the flag's value differs from its default:
-- the default is what it does when not given.
local M = {}

local kinds = { int = true, number = true, string = true, flag = true }
local fields = { required = "string", min = true, max = "number", over = "number",
                 why = "string", choices = "table", needs = true, arg = "string",
                 aliases = "table" }

-- The largest whole-number flag: counts and sizes reach C as int.
M.INT_MAX = 2 ^ 31 - 1

local function convert(name, kind, text)
  if kind == "string" then return text end
  if kind == "flag" then
    if text == "true" or text == "1" then return true end
    if text == "false" or text == "0" then return false end
    error(("--%s takes no value, or =true / =false (got '%s')"):format(name, text), 0)
  end
  local v = tonumber(text)
  if v == nil or v ~= v or v == math.huge or v == -math.huge then
    error(("--%s: '%s' is not a number"):format(name, text), 0)
  end
  if kind == "int" and v ~= math.floor(v) then
    error(("--%s: '%s' is not a whole number"):format(name, text), 0)
  end
  if kind == "int" and math.abs(v) > M.INT_MAX then
    error(("--%s: '%s' is out of range (a whole number of at most %d)")
          :format(name, text, M.INT_MAX), 0)
  end
  return v
end

-- argv: a list of strings; spec: { {name, kind, default, help}, ... }.
-- Returns { [name with - turned into _] = value }. "--help" returns nil and
-- the usage text. A flag given twice is an error (which one was meant?).
-- An option of the luazero executable (-n, --restarts, ...) written after
-- the script: said so, with where it goes, instead of "unknown flag".
local function own_option(argv, i)
  local own = rawget(_G, "LUAZERO_OPTIONS")
  local a = argv[i]
  if type(own) ~= "table" or own[a] == nil then return end
  local given = own[a] and argv[i + 1] and a .. " " .. argv[i + 1] or a
  error(("%s is an option of luazero itself, not of this script: give it before the script " ..
         "(luazero %s %s ...; luazero --help lists them)"):format(a, given, arg and arg[0] or "script.lua"), 0)
end

function M.parse(argv, spec)
  local by_name, out, seen, alias_of = {}, {}, {}, {}
  for _, s in ipairs(spec) do
    for _, a in ipairs(s.aliases or {}) do alias_of[a] = s[1] end
    assert(kinds[s[2]], "args: kind of --" .. s[1] .. " must be int, number, string or flag")
    -- (a second declaration would silently replace the first's default)
    assert(not by_name[s[1]], "args: --" .. s[1] .. " is declared twice")
    by_name[s[1]] = s
    out[s[1]:gsub("-", "_")] = s[3]
  end
  M.validate(spec)
  local i = 1
  while i <= #argv do
    local a = argv[i]
    if a == "--help" or a == "-h" then return nil, M.usage(spec) end
    local name, value = a:match("^%-%-([%w%-_]+)=(.*)$")
    if not name then name = a:match("^%-%-([%w%-_]+)$") end
    if not name or not by_name[name] then own_option(argv, i) end
    if not name then
      error(("unexpected argument '%s' (only flags are taken, each --name or --name VALUE; " ..
             "--help lists them)"):format(a), 0)
    end
    local s = by_name[name]
    if not s and alias_of[name] then
      error(("--%s is --%s here (--help lists the flags)"):format(name, alias_of[name]), 0)
    end
    if not s and by_name[name:gsub("_", "-")] then
      error(("unknown flag --%s; did you mean --%s? (--help lists the flags)")
            :format(name, (name:gsub("_", "-"))), 0)
    end
    if not s then
      local near = require("luazero.config.values").closest(name, by_name)
      error(("unknown flag --%s%s (--help lists the flags)")
            :format(name, near and ("; did you mean --%s?"):format(near) or ""), 0)
    end
    if value == nil and s[2] == "flag" then
      -- (a switch given a value as a word, --json 1: taken as =1)
      local nxt = argv[i + 1]
      if nxt == "1" or nxt == "0" or nxt == "true" or nxt == "false" then
        i = i + 1
        value = nxt
      else
        value = "true"
      end
    elseif value == nil then
      i = i + 1
      value = argv[i]
      if value == nil then error(("--%s needs a value"):format(name), 0) end
    end
    local given = (a:find("=", 1, true) or (s[2] == "flag" and value == "true")) and a or
                  a .. " " .. value
    if seen[name] then
      error(("--%s is given twice (%s, then %s); give it once"):format(name, seen[name], given), 0)
    end
    seen[name] = given
    out[name:gsub("-", "_")] = convert(name, s[2], value)
    i = i + 1
  end
  M.check(out, spec)
  return out
end

-- The declarations of spec checked once, where they are written: a field
-- misspelt or a `needs` naming no flag is the program's error.
function M.validate(spec)
  local names = {}
  for _, s in ipairs(spec) do names[s[1]] = true end
  for _, s in ipairs(spec) do
    for k, v in pairs(s) do
      if type(k) ~= "number" then
        local want = fields[k]
        assert(want, ("args: --%s declares an unknown field '%s'"):format(s[1], tostring(k)))
        assert(want == true or type(v) == want,
               ("args: --%s's %s must be a %s"):format(s[1], k, tostring(want)))
      end
    end
    local n = s.needs
    local target = type(n) == "string" and n or type(n) == "table" and n.flag
    assert(n == nil or type(n) == "string" or (type(n) == "table" and (n.flag or n.ok)),
           ("args: --%s's needs is a flag's name or { flag | ok, says }"):format(s[1]))
    assert(not target or names[target],
           ("args: --%s needs --%s, which is not a flag here"):format(s[1], tostring(target)))
  end
end

local function key(name) return (name:gsub("-", "_")) end

local function show(v)
  if v == "" then return "''" end
  return tostring(v)
end

-- "--lora-alpha 8": a setting without a default is named with the value
-- given (which one was meant); a count or a switch with a default by its
-- name alone.
local function named(s, v)
  if s[2] == "flag" or s[3] ~= nil then return "--" .. s[1] end
  return ("--%s %s"):format(s[1], show(v))
end

local function set(v) return v ~= nil and v ~= false end

-- The refusal of value v of flag s by its range, or nil.
local function out_of_range(s, v, flags)
  if type(v) ~= "number" then return nil end
  local min = s.min
  if type(min) == "function" then min = min(flags) end
  local bad, want
  if s.over and s.max then
    bad, want = v <= s.over or v > s.max, ("in (%s, %s]"):format(s.over, s.max)
  elseif min and s.max then
    bad, want = v < min or v > s.max, ("%s..%s"):format(min, s.max)
  elseif s.over then
    bad, want = v <= s.over, "> " .. s.over
  elseif min then
    bad, want = v < min, ">= " .. min
  elseif s.max then
    bad, want = v > s.max, "<= " .. s.max
  end
  if not bad then return nil end
  return ("--%s must be %s (got %s)%s"):format(s[1], want, show(v), s.why and (": " .. s.why) or "")
end

-- "a, b or c"
local function alternatives(list)
  if #list == 1 then return list[1] end
  return table.concat(list, ", ", 1, #list - 1) .. " or " .. list[#list]
end

-- The refusal of flag s's value for what it needs, or nil.
local function unmet(s, v, flags, by_name)
  local n = s.needs
  if n == nil or v == nil or v == s[3] then return nil end
  if type(n) == "string" then n = { flag = n } end
  if n.flag and set(flags[key(n.flag)]) then return nil end
  if n.ok and n.ok(flags) then return nil end
  if type(n.says) == "function" then return n.says(flags) end
  if n.says then return named(s, v) .. " " .. n.says end
  local want = by_name[n.flag]
  return ("%s without --%s does nothing: add --%s%s or drop --%s"):format(
    named(s, v), n.flag, n.flag, want.arg and (" " .. want.arg) or "", s[1])
end

-- flags (parse's result) against the declarations of spec: raises the one
-- line of the first flag, in spec order, that breaks one.
function M.check(flags, spec)
  local by_name = {}
  for _, s in ipairs(spec) do by_name[s[1]] = s end
  for _, s in ipairs(spec) do
    local v = flags[key(s[1])]
    if s.required and v == nil then
      error(("--%s is required: %s"):format(s[1], s.required), 0)
    end
    if v ~= nil and s.choices then
      local ok = false
      for _, c in ipairs(s.choices) do ok = ok or c == v end
      if not ok then
        error(("--%s must be %s (got %s)"):format(s[1], alternatives(s.choices), show(v)), 0)
      end
    end
    local why = out_of_range(s, v, flags) or unmet(s, v, flags, by_name)
    if why then error(why, 0) end
  end
end

function M.usage(spec)
  local lines = {}
  for _, s in ipairs(spec) do
    local default = (s[3] == nil or s[2] == "flag") and "" or (" (default " .. tostring(s[3]) .. ")")
    local shown = s[2] == "flag" and s[1] or (s[1] .. " " .. s[2]:upper())
    lines[#lines + 1] = ("  --%-20s %s%s"):format(shown, s[4] or "", default)
  end
  return table.concat(lines, "\n")
end

-- checked(fail, fn, ...): fn's results, or fail(message) when it raises
-- (the command-line tools' way of turning an error into one line + exit 2).
function M.checked(fail, fn, ...)
  local res = { pcall(fn, ...) }
  if not res[1] then fail(res[2]) end
  return unpack(res, 2, table.maxn(res))
end

return M
