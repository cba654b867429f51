-- jinja/parser.lua — the pieces of jinja/lexer.lua parsed into a tree of
-- statements (text, {{ }}, if, for, set) and expressions, with jinja2's
-- operator precedence (filters and tests bind tighter than arithmetic).
local values = require("luazero.jinja.values")

local fail, NONE, UNDEF = values.fail, values.NONE, values.UNDEF


local Parser = {}
Parser.__index = Parser

function Parser:peek(k) return self.toks[self.i + (k or 0)] end

function Parser:is(kind, value, k)
  local t = self:peek(k)
  return t ~= nil and t[1] == kind and (value == nil or t[2] == value)
end

function Parser:next() self.i = self.i + 1 return self.toks[self.i - 1] end

function Parser:expect(kind, value)
  if not self:is(kind, value) then
    local t = self:peek()
    fail(("expected %s but found %s in %s"):format(value or kind, t and tostring(t[2]) or "the end",
                                                  self.where))
  end
  return self:next()
end

function Parser:accept(kind, value)
  if self:is(kind, value) then return self:next() end
end

function Parser:expression()
  local e = self:or_expr()
  if self:accept("name", "if") then
    local cond = self:or_expr()
    local other = { "lit", UNDEF }
    if self:accept("name", "else") then other = self:expression() end
    return { "cond", cond, e, other }
  end
  return e
end

-- operand (op operand)*, left-associative, where op is a `kind` token whose
-- text `ops` maps to its node's tag (true: "arith" with the operator).
function Parser:chain(kind, ops, operand)
  local e = operand(self)
  while self:is(kind) and ops[self:peek()[2]] do
    local op = self:next()[2]
    local tag = ops[op]
    if tag == true then e = { "arith", op, e, operand(self) } else e = { tag, e, operand(self) } end
  end
  return e
end

local OR, AND, TILDE = { ["or"] = "or" }, { ["and"] = "and" }, { ["~"] = "tilde" }
local ADD, MUL, POW = { ["+"] = true, ["-"] = true },
                      { ["*"] = true, ["/"] = true, ["//"] = true, ["%"] = true }, { ["**"] = true }

function Parser:or_expr() return self:chain("name", OR, Parser.and_expr) end

function Parser:and_expr() return self:chain("name", AND, Parser.not_expr) end

function Parser:not_expr()
  if self:accept("name", "not") then return { "not", self:not_expr() } end
  return self:compare()
end

local COMPARE = { ["=="] = true, ["!="] = true, ["<"] = true, [">"] = true, ["<="] = true,
                  [">="] = true }

function Parser:compare()
  local e = self:math1()
  while true do
    if self:is("op") and COMPARE[self:peek()[2]] then
      e = { "cmp", self:next()[2], e, self:math1() }
    elseif self:accept("name", "in") then
      e = { "in", e, self:math1() }
    elseif self:is("name", "not") and self:is("name", "in", 1) then
      self.i = self.i + 2
      e = { "not", { "in", e, self:math1() } }
    else
      return e
    end
  end
end

function Parser:math1() return self:chain("op", ADD, Parser.concat_expr) end

function Parser:concat_expr() return self:chain("op", TILDE, Parser.math2) end

function Parser:math2() return self:chain("op", MUL, Parser.pow) end

local function filtered_unary(self) return self:unary(true) end

function Parser:pow() return self:chain("op", POW, filtered_unary) end

function Parser:unary(with_filter)
  local e
  if self:accept("op", "-") then
    e = { "neg", self:unary(false) }
  elseif self:accept("op", "+") then
    e = self:unary(false)
  else
    e = self:postfix(self:primary())
  end
  if with_filter then e = self:filters(e) end
  return e
end

function Parser:args()
  local args, kwargs = {}, {}
  while not self:accept("op", ")") do
    if self:is("name") and self:is("op", "=", 1) then
      local k = self:next()[2]
      self:next()
      kwargs[k] = self:expression()
    else
      args[#args + 1] = self:expression()
    end
    if not self:is("op", ")") then self:expect("op", ",") end
  end
  return args, kwargs
end

function Parser:primary()
  local t = self:next()
  if not t then fail("an expression ends early in " .. self.where) end
  if t[1] == "str" then
    local s = t[2]
    while self:is("str") do s = s .. self:next()[2] end
    return { "lit", s }
  elseif t[1] == "num" then
    return { "lit", t[2] }
  elseif t[1] == "name" then
    local w = t[2]
    if w == "true" or w == "True" then return { "lit", true } end
    if w == "false" or w == "False" then return { "lit", false } end
    if w == "none" or w == "None" then return { "lit", NONE } end
    return { "var", w }
  elseif t[2] == "(" then
    local e = self:expression()
    if self:is("op", ",") then
      local items = { e }
      while self:accept("op", ",") and not self:is("op", ")") do items[#items + 1] = self:expression() end
      e = { "list", items }
    end
    self:expect("op", ")")
    return e
  elseif t[2] == "[" then
    local items = {}
    while not self:accept("op", "]") do
      items[#items + 1] = self:expression()
      if not self:is("op", "]") then self:expect("op", ",") end
    end
    return { "list", items }
  elseif t[2] == "{" then
    local keys, values = {}, {}
    while not self:accept("op", "}") do
      keys[#keys + 1] = self:expression()
      self:expect("op", ":")
      values[#values + 1] = self:expression()
      if not self:is("op", "}") then self:expect("op", ",") end
    end
    return { "dict", keys, values }
  end
  fail(("unexpected %s in %s"):format(tostring(t[2]), self.where))
end

function Parser:postfix(e)
  while true do
    if self:accept("op", ".") then
      local name = self:next()
      if not name or (name[1] ~= "name" and name[1] ~= "num") then
        fail("expected a name after . in " .. self.where)
      end
      e = { "attr", e, { "lit", name[2] } }
    elseif self:accept("op", "[") then
      local parts, cur = {}, nil
      local slice = false
      for _ = 1, 3 do
        cur = nil
        if not self:is("op", ":") and not self:is("op", "]") then cur = self:expression() end
        parts[#parts + 1] = cur or false
        if not self:accept("op", ":") then break end
        slice = true
      end
      self:expect("op", "]")
      if slice then e = { "slice", e, parts[1], parts[2], parts[3] } else e = { "item", e, parts[1] } end
    elseif self:accept("op", "(") then
      local args, kwargs = self:args()
      e = { "call", e, args, kwargs }
    else
      return e
    end
  end
end

function Parser:filters(e)
  while true do
    if self:accept("op", "|") then
      local name = self:expect("name")[2]
      local args, kwargs = {}, {}
      if self:accept("op", "(") then args, kwargs = self:args() end
      e = { "filter", name, e, args, kwargs }
    elseif self:accept("name", "is") then
      local negate = self:accept("name", "not") ~= nil
      local name = self:expect("name")[2]
      local args = {}
      if self:accept("op", "(") then
        args = self:args()
      elseif self:is("str") or self:is("num") or (self:is("name") and not self:is("name", "and") and
              not self:is("name", "or") and not self:is("name", "else") and not self:is("name", "if")) then
        args = { self:primary() }
      end
      e = { "test", name, e, args }
      if negate then e = { "not", e } end
    else
      return e
    end
  end
end

-- A for/set target: a name, a tuple of names, or namespace.attr.
function Parser:target()
  local names = { self:expect("name")[2] }
  if self:accept("op", ".") then return { "attr", names[1], self:expect("name")[2] } end
  while self:accept("op", ",") do names[#names + 1] = self:expect("name")[2] end
  if #names == 1 then return { "name", names[1] } end
  return { "tuple", names }
end

function Parser:done()
  if self:peek() then
    fail(("unexpected %s at the end of %s"):format(tostring(self:peek()[2]), self.where))
  end
end

local UNSUPPORTED = { macro = true, call = true, filter = true, raw = true, include = true,
                      import = true, from = true, extends = true, block = true, with = true,
                      autoescape = true, ["do"] = true }

-- Parses the pieces from lex into a tree of statements.
local function parse(pieces)
  local k = 0
  local function block_parser(piece)
    return setmetatable({ toks = piece[2], i = 1, where = "a tag" }, Parser)
  end
  local body
  local loops = 0 -- how many {% for %} bodies enclose the statement being parsed
  -- Statements until one of the keywords in stop; returns the list and the keyword.
  function body(stop)
    local list = {}
    while true do
      k = k + 1
      local piece = pieces[k]
      if not piece then
        if stop then fail(("{%% %s %%} is missing at the end of the template"):format(stop[1])) end
        return list
      end
      if piece[1] == "text" then
        list[#list + 1] = { "text", piece[2] }
      elseif piece[1] == "var" then
        local p = block_parser(piece)
        p.where = "{{ }}"
        local e = p:expression()
        p:done()
        list[#list + 1] = { "out", e }
      else
        local p = block_parser(piece)
        local kw = p:expect("name")[2]
        p.where = "{% " .. kw .. " %}"
        if stop then
          for _, s in ipairs(stop) do
            if kw == s then return list, kw, p end
          end
        end
        if kw == "if" then
          local node = { "if", {} }
          local cond = p:expression()
          p:done()
          while true do
            local stmts, ended, q = body({ "endif", "elif", "else" })
            node[2][#node[2] + 1] = { cond, stmts }
            if ended == "endif" then q:done() break end
            if ended == "else" then
              q:done()
              local rest = body({ "endif" })
              node[2][#node[2] + 1] = { { "lit", true }, rest }
              break
            end
            cond = q:expression()
            q:done()
          end
          list[#list + 1] = node
        elseif kw == "for" then
          local target = p:target()
          p:expect("name", "in")
          local iter = p:or_expr()
          local filter
          if p:accept("name", "if") then filter = p:expression() end
          if p:accept("name", "recursive") then fail("{% for ... recursive %} is not supported") end
          p:done()
          loops = loops + 1
          local stmts, ended, q = body({ "endfor", "else" })
          loops = loops - 1
          q:done()
          local otherwise
          if ended == "else" then
            otherwise = body({ "endfor" })
          end
          list[#list + 1] = { "for", target, iter, filter, stmts, otherwise }
        elseif kw == "generation" then
          -- transformers' AssistantTracker: the body renders as it is (the
          -- assistant mask transformers records from it, spans do here)
          p:done()
          local stmts, _, q = body({ "endgeneration" })
          q:done()
          list[#list + 1] = { "block", stmts }
        elseif kw == "set" then
          local target = p:target()
          if not p:accept("op", "=") then
            fail("{% set " .. (target[2] or "") .. " %}...{% endset %} (a block set) is not supported")
          end
          local e = p:expression()
          p:done()
          list[#list + 1] = { "set", target, e }
        elseif kw == "break" or kw == "continue" then -- transformers loads loopcontrols
          if loops == 0 then fail(("{%% %s %%} outside a {%% for %%}"):format(kw)) end
          p:done()
          list[#list + 1] = { kw }
        elseif UNSUPPORTED[kw] then
          fail(("{%% %s %%} is not supported"):format(kw))
        else
          fail(("{%% %s %%} is not a statement here"):format(kw))
        end
      end
    end
  end
  return body(nil)
end

return { parse = parse }
