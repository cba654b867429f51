-- jinja/lexer.lua — a template's source cut into text, {{ }} and {% %}
-- pieces, with jinja2's whitespace control as transformers sets it
-- (trim_blocks, lstrip_blocks, {%- -%}, {%+ +%}, one trailing newline
-- dropped), and the tokens inside each tag.
local fail = require("luazero.jinja.values").fail

local sub, byte, char, concat = string.sub, string.byte, string.char, table.concat


local lex_expr -- forward

-- Splits source into a list of { "text", s } / { "var", tokens } / { "block", tokens }.
local function lex(src)
  if sub(src, -1) == "\n" then src = sub(src, 1, -2) end -- keep_trailing_newline=False
  local out, pos, n, line_starting = {}, 1, #src, true
  while pos <= n do
    local a = src:find("{[{%%#]", pos)
    local text = sub(src, pos, (a or n + 1) - 1)
    if not a then
      out[#out + 1] = { "text", text }
      break
    end
    local kind, sign = sub(src, a + 1, a + 1), sub(src, a + 2, a + 2)
    if sign == "-" then
      text = text:gsub("%s+$", "")
    elseif sign ~= "+" and kind ~= "{" then -- lstrip_blocks
      local l_pos = 0
      for q = #text, 1, -1 do if sub(text, q, q) == "\n" then l_pos = q break end end
      if (l_pos > 0 or line_starting) and sub(text, l_pos + 1):match("^%s+$") then
        text = sub(text, 1, l_pos)
      end
    end
    if text ~= "" then out[#out + 1] = { "text", text } end
    local body = a + 2 + ((sign == "-" or sign == "+") and 1 or 0)
    local close_strip, after
    if kind == "#" then
      local e = src:find("#}", body, true)
      if not e then fail("a {# comment is not closed with #}") end
      close_strip, after = sub(src, e - 1, e - 1) == "-", e + 2
      if sub(src, e - 1, e - 1) == "+" then close_strip = "+" end
    else
      local closer = kind == "{" and "}}" or "%}"
      local toks, e = lex_expr(src, body, closer)
      local last = toks[#toks]
      if last and last[1] == "op" and (last[2] == "-" or last[2] == "+") and
         last.at == e - 1 then -- the "-" of -}} / -%}
        close_strip = last[2] == "-" and true or "+"
        toks[#toks] = nil
      end
      out[#out + 1] = { kind == "{" and "var" or "block", toks, at = a }
      after = e + 2
    end
    local ended_line = false
    if close_strip == true then
      local ws = src:match("^%s*", after)
      ended_line = ws:sub(-1) == "\n"
      after = after + #ws
    elseif kind ~= "{" and close_strip ~= "+" and sub(src, after, after) == "\n" then -- trim_blocks
      after, ended_line = after + 1, true
    end
    line_starting = ended_line
    pos = after
  end
  return out
end

local ESCAPES = { n = "\n", t = "\t", r = "\r", ["\\"] = "\\", ["'"] = "'", ['"'] = '"',
                  a = "\a", b = "\b", f = "\f", v = "\v", ["0"] = "\0" }

local function utf8_of(cp)
  if cp < 0x80 then return char(cp) end
  if cp < 0x800 then return char(0xC0 + math.floor(cp / 64), 0x80 + cp % 64) end
  if cp < 0x10000 then
    return char(0xE0 + math.floor(cp / 4096), 0x80 + math.floor(cp / 64) % 64, 0x80 + cp % 64)
  end
  return char(0xF0 + math.floor(cp / 262144), 0x80 + math.floor(cp / 4096) % 64,
              0x80 + math.floor(cp / 64) % 64, 0x80 + cp % 64)
end

-- Python's unicode-escape of a string literal's body, in one pass.
local function unescape(s)
  if not s:find("\\", 1, true) then return s end
  local out, i, n = {}, 1, #s
  while i <= n do
    local c = sub(s, i, i)
    if c ~= "\\" or i == n then
      out[#out + 1] = c
      i = i + 1
    else
      local e = sub(s, i + 1, i + 1)
      local width = (e == "x" and 2) or (e == "u" and 4) or (e == "U" and 8) or nil
      local hex = width and sub(s, i + 2, i + 1 + width)
      if width and #hex == width and hex:match("^%x+$") then
        out[#out + 1] = utf8_of(tonumber(hex, 16))
        i = i + 2 + width
      elseif ESCAPES[e] then
        out[#out + 1] = ESCAPES[e]
        i = i + 2
      else
        out[#out + 1] = "\\" .. e
        i = i + 2
      end
    end
  end
  return concat(out)
end

local OPS2 = { ["=="] = true, ["!="] = true, ["<="] = true, [">="] = true, ["//"] = true,
               ["**"] = true }
local OPS1 = "+-*/%~|.,:()[]{}=<>!"

-- Tokens of an expression from byte p up to closer ("}}" or "%}") outside
-- brackets; returns the tokens and the byte where closer starts.
function lex_expr(src, p, closer)
  local toks, depth, n = {}, 0, #src
  while true do
    p = src:match("^%s*()", p)
    if p > n then fail(("a tag is not closed with %s"):format(closer)) end
    if depth == 0 and sub(src, p, p + 1) == closer then return toks, p end
    local c = sub(src, p, p)
    if c:match("[%a_]") then
      local w = src:match("^[%w_]+", p)
      toks[#toks + 1] = { "name", w, at = p }
      p = p + #w
    elseif c:match("%d") then
      local w = src:match("^%d[%d_]*%.?[%d_]*", p)
      if sub(w, -1) == "." then w = sub(w, 1, -2) end
      toks[#toks + 1] = { "num", tonumber((w:gsub("_", ""))), at = p }
      p = p + #w
    elseif c == "'" or c == '"' then
      local q = p + 1
      while true do
        local d = sub(src, q, q)
        if d == "" then fail("a string literal is not closed") end
        if d == "\\" then q = q + 2 elseif d == c then break else q = q + 1 end
      end
      toks[#toks + 1] = { "str", unescape(sub(src, p + 1, q - 1)), at = p }
      p = q + 1
    else
      local op = sub(src, p, p + 1)
      if not OPS2[op] then op = c end
      if not OPS2[op] and not OPS1:find(op, 1, true) then
        fail(("the character %q in a tag is not Jinja"):format(op))
      end
      if op == "(" or op == "[" or op == "{" then depth = depth + 1 end
      if op == ")" or op == "]" or op == "}" then depth = depth - 1 end
      toks[#toks + 1] = { "op", op, at = p }
      p = p + #op
    end
  end
end

return { lex = lex }
