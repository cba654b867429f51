-- jinja — the subset of Jinja that chat templates use, rendered the way
-- transformers renders them (jinja2 with trim_blocks and lstrip_blocks, a
-- raise_exception global, one trailing newline of the template dropped).
-- lexer.lua cuts the source, parser.lua builds the tree, values.lua holds
-- Python's semantics of values; this file evaluates the tree.
--
--   local jinja = require("luazero.jinja")
--   local t = jinja.compile(source)            -- errors name the construct
--   local text = jinja.render(t, { messages = {...}, bos_token = "<s>" })
--
-- Statements: for (with else, a loop filter "if", tuple targets, break and
-- continue), if / elif / else, set (a name or namespace.attr), generation
-- (transformers' assistant-mask block: its body as it is). Expressions:
-- literals (strings with Python escapes, numbers, true/false/none, lists,
-- dicts), names, .attr, [index], [a:b:c] slices, calls, filters, tests (is
-- [not] defined/none/...), not/and/or, comparisons, in / not in,
-- + - * / // % ~, x if c else y. Globals: range, namespace, raise_exception,
-- strftime_now. Values: Lua strings, numbers, booleans, tables (a list when
-- t[1] ~= nil or empty, else a dict; a dict in values.ORDER keeps its key
-- order, as jinja/json.lua reads JSON); jinja.NONE is Python's None, a
-- missing value renders as "". Errors are strings without a prefix; the
-- caller names the file. Not as Python: a float with no fraction renders
-- without one (4 / 2 is "2"), and case filters change ASCII letters only
-- (docs/formats.md).
local values = require("luazero.jinja.values")
local lex = require("luazero.jinja.lexer").lex
local parse = require("luazero.jinja.parser").parse

local M = {}

local NONE, UNDEF, fail = values.NONE, values.UNDEF, values.fail
local str, repr, truthy, is_list, chars = values.str, values.repr, values.truthy, values.is_list,
                                         values.chars
local getitem, getattr, python_slice = values.getitem, values.getattr, values.python_slice
local arith, compare, contains, number = values.arith, values.compare, values.contains, values.number
local TESTS, FILTERS, SEQ_FILTERS, GLOBALS = values.TESTS, values.FILTERS, values.SEQ_FILTERS,
                                             values.GLOBALS
local DICT_METHODS = values.DICT_METHODS
local concat = table.concat
M.NONE, M.UNDEF, M.ORDER = NONE, UNDEF, values.ORDER

function M.compile(src)
  if type(src) ~= "string" then fail("the template is not a string") end
  return { tree = parse(lex(src)) }
end

--------------------------------------------------------------- evaluation

local function lookup(scope, name)
  local s = scope
  while s do
    local v = s.vars[name]
    if v ~= nil then return v end
    s = s.parent
  end
  return UNDEF
end

local eval

local function call(f, args, kwargs)
  if type(f) == "table" and f.__callable then return f.__callable(args, kwargs) end
  fail(("%s is not callable"):format(repr(f)))
end

local function eval_args(list, scope)
  local out = {}
  for i, e in ipairs(list) do out[i] = eval(e, scope) end
  return out
end

local function eval_kwargs(map, scope)
  local out = {}
  for k, e in pairs(map) do out[k] = eval(e, scope) end
  return out
end

function eval(e, scope)
  local k = e[1]
  if k == "lit" then return e[2]
  elseif k == "var" then return lookup(scope, e[2])
  elseif k == "attr" then return getattr(eval(e[2], scope), e[3][2])
  elseif k == "item" then
    local obj, key = eval(e[2], scope), eval(e[3], scope)
    if type(obj) == "table" and not is_list(obj) and type(key) == "string" then
      return getattr(obj, key)
    end
    return getitem(obj, key)
  elseif k == "slice" then
    local obj = eval(e[2], scope)
    local a = e[3] and eval(e[3], scope) or nil
    local b = e[4] and eval(e[4], scope) or nil
    local c = e[5] and eval(e[5], scope) or nil
    if a == NONE then a = nil end
    if b == NONE then b = nil end
    if c == NONE then c = nil end
    local items = type(obj) == "string" and chars(obj) or obj
    if type(items) ~= "table" or not is_list(items) then fail("cannot slice " .. repr(obj)) end
    local out = {}
    for _, i in ipairs(python_slice(#items, a, b, c)) do out[#out + 1] = items[i + 1] end
    return type(obj) == "string" and concat(out) or out
  elseif k == "call" then
    return call(eval(e[2], scope), eval_args(e[3], scope), eval_kwargs(e[4], scope))
  elseif k == "filter" then
    if SEQ_FILTERS[e[2]] then
      return SEQ_FILTERS[e[2]](eval(e[3], scope), eval_args(e[4], scope), eval_kwargs(e[5], scope))
    end
    local args = eval_args(e[4], scope)
    local kw = eval_kwargs(e[5], scope)
    if e[2] == "tojson" then return values.tojson(eval(e[3], scope), args, kw) end
    local f = FILTERS[e[2]]
    if not f then fail(("the filter |%s is not supported"):format(e[2])) end
    if (e[2] == "default" or e[2] == "d") and kw.boolean ~= nil then args[2] = kw.boolean end
    return f(eval(e[3], scope), unpack(args))
  elseif k == "test" then
    local f = TESTS[e[2]]
    if not f then fail(("the test 'is %s' is not supported"):format(e[2])) end
    return f(eval(e[3], scope), unpack(eval_args(e[4], scope)))
  elseif k == "not" then return not truthy(eval(e[2], scope))
  elseif k == "and" then
    local a = eval(e[2], scope)
    if not truthy(a) then return a end
    return eval(e[3], scope)
  elseif k == "or" then
    local a = eval(e[2], scope)
    if truthy(a) then return a end
    return eval(e[3], scope)
  elseif k == "cond" then
    if truthy(eval(e[2], scope)) then return eval(e[3], scope) end
    return eval(e[4], scope)
  elseif k == "cmp" then return compare(e[2], eval(e[3], scope), eval(e[4], scope))
  elseif k == "in" then return contains(eval(e[3], scope), eval(e[2], scope))
  elseif k == "arith" then return arith(e[2], eval(e[3], scope), eval(e[4], scope))
  elseif k == "tilde" then return str(eval(e[2], scope)) .. str(eval(e[3], scope))
  elseif k == "neg" then return -number(eval(e[2], scope), "'-'")
  elseif k == "list" then return eval_args(e[2], scope)
  elseif k == "dict" then
    local out, keys = {}, {}
    for i, ke in ipairs(e[2]) do
      local key = eval(ke, scope)
      if out[key] == nil then keys[#keys + 1] = key end
      out[key] = eval(e[3][i], scope)
    end
    values.ORDER[out] = keys -- Python's dicts keep the order they were written in
    return out
  end
  error("jinja: unknown node " .. tostring(k))
end

local exec

local function assign(target, value, scope)
  if target[1] == "name" then
    scope.vars[target[2]] = value
  elseif target[1] == "tuple" then
    if type(value) ~= "table" or #value ~= #target[2] then
      fail(("cannot unpack %s into %d names"):format(repr(value), #target[2]))
    end
    for i, name in ipairs(target[2]) do scope.vars[name] = value[i] end
  else
    local ns = lookup(scope, target[2])
    if type(ns) ~= "table" or not ns.__namespace then
      fail(("{%% set %s.%s %%} needs %s to be a namespace()"):format(target[2], target[3], target[2]))
    end
    ns[target[3]] = value
  end
end

-- Runs statements; returns "break" or "continue" when one of them is met.
function exec(list, scope, out)
  for _, s in ipairs(list) do
    local k = s[1]
    if k == "break" or k == "continue" then
      return k
    elseif k == "block" then
      local signal = exec(s[2], scope, out)
      if signal then return signal end
    elseif k == "text" then
      out[#out + 1] = s[2]
    elseif k == "out" then
      out[#out + 1] = str(eval(s[2], scope))
    elseif k == "if" then
      for _, branch in ipairs(s[2]) do
        if truthy(eval(branch[1], scope)) then
          local signal = exec(branch[2], scope, out)
          if signal then return signal end
          break
        end
      end
    elseif k == "set" then
      assign(s[2], eval(s[3], scope), scope)
    elseif k == "for" then
      local seq = eval(s[3], scope)
      if type(seq) == "string" then
        seq = chars(seq)
      elseif seq == UNDEF or seq == NONE then
        seq = {}
      elseif type(seq) ~= "table" then
        fail(("{%% for %%} over %s, which is not a list"):format(repr(seq)))
      elseif not is_list(seq) then
        seq = DICT_METHODS.keys(seq)
      end
      local items = seq
      if s[4] then
        items = {}
        for _, v in ipairs(seq) do
          local probe = { vars = {}, parent = scope }
          assign(s[2], v, probe)
          if truthy(eval(s[4], probe)) then items[#items + 1] = v end
        end
      end
      local n = #items
      for i, v in ipairs(items) do
        local inner = { vars = {}, parent = scope }
        assign(s[2], v, inner)
        inner.vars.loop = { index = i, index0 = i - 1, revindex = n - i + 1, revindex0 = n - i,
                            first = i == 1, last = i == n, length = n,
                            previtem = i > 1 and items[i - 1] or UNDEF,
                            nextitem = i < n and items[i + 1] or UNDEF }
        if exec(s[5], inner, out) == "break" then break end
      end
      if n == 0 and s[6] then exec(s[6], scope, out) end
    end
  end
end

-- Renders a compiled template with the variables in vars.
function M.render(template, vars)
  local globals = { vars = {} }
  for k, v in pairs(GLOBALS) do globals.vars[k] = v end
  globals.vars.raise_exception = { __callable = function(args)
    fail("raise_exception: " .. str(args[1]))
  end }
  -- transformers' strftime_now(format): the local time now (Llama 3.1's date)
  globals.vars.strftime_now = { __callable = function(args)
    if type(args[1]) ~= "string" then fail("strftime_now(format) needs a format string") end
    return os.date(args[1])
  end }
  local scope = { vars = {}, parent = globals }
  for k, v in pairs(vars or {}) do scope.vars[k] = v end
  local out = {}
  exec(template.tree, scope, out)
  return concat(out)
end

M.strip, M.str = values.strip, str -- for tests
return M
