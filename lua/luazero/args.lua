-- args.lua — command-line flags for scripts: "--name value" or "--name=value",
-- typed, with defaults. Errors are plain one-line strings naming the flag.
--
--   local flags = args.parse(arg, {
--     { "steps", "int", 100, "optimizer steps" },
--     { "lr", "number", nil, "peak learning rate" },
--     { "model", "string", "gpt2-nano", "model size" },
--     { "checkpoint-activations", "flag", false, "switch: on when given" },
--   })
local M = {}

local kinds = { int = true, number = true, string = true, flag = true }

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
function M.parse(argv, spec)
  local by_name, out, seen = {}, {}, {}
  for _, s in ipairs(spec) do
    assert(kinds[s[2]], "args: kind of --" .. s[1] .. " must be int, number, string or flag")
    by_name[s[1]] = s
    out[s[1]:gsub("-", "_")] = s[3]
  end
  local i = 1
  while i <= #argv do
    local a = argv[i]
    if a == "--help" or a == "-h" then return nil, M.usage(spec) end
    local name, value = a:match("^%-%-([%w%-]+)=(.*)$")
    if not name then name = a:match("^%-%-([%w%-]+)$") end
    if not name then
      error(("unexpected argument '%s' (flags look like --steps 100; --help lists them)")
            :format(a), 0)
    end
    local s = by_name[name]
    if not s then error(("unknown flag --%s (--help lists the flags)"):format(name), 0) end
    if value == nil and s[2] == "flag" then
      value = "true"
    elseif value == nil then
      i = i + 1
      value = argv[i]
      if value == nil then error(("--%s needs a value"):format(name), 0) end
    end
    local given = (a:find("=", 1, true) or s[2] == "flag") and a or a .. " " .. value
    if seen[name] then
      error(("--%s is given twice (%s, then %s); give it once"):format(name, seen[name], given), 0)
    end
    seen[name] = given
    out[name:gsub("-", "_")] = convert(name, s[2], value)
    i = i + 1
  end
  return out
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
