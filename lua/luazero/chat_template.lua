-- chat_template.lua — a Hugging Face model's chat template: renders a
-- conversation to the exact text transformers' apply_chat_template(...,
-- tokenize=False) gives, and says where each assistant message lies in it.
--
--   local chat_template = require("luazero.chat_template")
--   local ct = chat_template.load("path/to/hf-folder")      -- its tokenizer_config.json
--   local text, spans = ct:render({
--     { role = "system", content = "Be brief." },
--     { role = "user", content = "Hi" },
--     { role = "assistant", content = "Hello." },
--   }, { add_generation_prompt = false })
--   -- spans[1] = { first = byte0, last = byte1_exclusive, role = "assistant", message = 3 }
--   local mask = chat_template.token_mask(spans, starts, #text)  -- starts: tok:encode offsets
--
-- The template runs in luazero.jinja with the variables transformers gives
-- it: messages, add_generation_prompt, and the special tokens of the config
-- (bos_token, eos_token, unk_token, pad_token, ... as strings). A span covers
-- an assistant message's content as the template wrote it (after |trim or
-- .strip()), with the spaces and tabs the template writes just before it
-- (Llama 2's "[/INST] " + content: tokenizers glue them to the first word),
-- and the end-of-turn text right after it: the eos token or another special
-- token of added_tokens_decoder (<|eot_id|>, <|im_end|>; transformers 5
-- folders keep them in tokenizer.json's added_tokens), with the blanks
-- before it (Llama 2 writes " </s>"). It is found by rendering again with
-- that message's content replaced by a marker: the span is where the two
-- texts differ, so it also holds what the template writes from the content
-- (Qwen3's <think> block of a content that holds one); a template that does
-- not write the content exactly once is refused by name.
local cjson = require("cjson")
local jinja = require("luazero.jinja")

local M = {}

local ChatTemplate = {}
ChatTemplate.__index = ChatTemplate

local SPECIAL_KEYS = { "bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token" }

local function token_text(v)
  if type(v) == "string" then return v end
  if type(v) == "table" and type(v.content) == "string" then return v.content end
  return nil
end

-- A template from its source; opts: name (for errors), bos_token,
-- eos_token, ... (strings or {content=...}), additional_special_tokens,
-- special_tokens (a list of the strings that may end a turn).
function M.new(source, opts)
  opts = opts or {}
  local name = opts.name or "chat_template"
  local ok, compiled = pcall(jinja.compile, source)
  if not ok then
    error(("chat_template: %s: %s; rewrite the template without it (supported: for, if, set, " ..
           "expressions, filters and tests of the Jinja subset in lua/luazero/jinja.lua)")
          :format(name, tostring(compiled)), 0)
  end
  local self = setmetatable({ name = name, compiled = compiled, source = source, vars = {},
                              enders = {} }, ChatTemplate)
  for _, k in ipairs(SPECIAL_KEYS) do self.vars[k] = token_text(opts[k]) end
  if type(opts.additional_special_tokens) == "table" then
    local list = {}
    for _, t in ipairs(opts.additional_special_tokens) do list[#list + 1] = token_text(t) end
    self.vars.additional_special_tokens = list
  end
  self.bos_token, self.eos_token = self.vars.bos_token, self.vars.eos_token
  local seen = {}
  local function ender(t)
    if type(t) == "string" and t ~= "" and t ~= self.bos_token and not seen[t] then
      seen[t] = true
      self.enders[#self.enders + 1] = t
    end
  end
  ender(self.eos_token)
  for _, t in ipairs(opts.special_tokens or {}) do ender(t) end
  table.sort(self.enders, function(a, b) return #a > #b end) -- the longest first
  return self
end

-- Reads folder/tokenizer_config.json (or a tokenizer_config.json path): its
-- chat_template (a string, or the "default" of a list of { name, template },
-- or else the file chat_template.jinja beside it) and special tokens.
function M.load(folder)
  local path = folder
  if not path:match("%.json$") then path = folder .. "/tokenizer_config.json" end
  local f, err = io.open(path, "rb")
  if not f then
    error(("chat_template: %s: cannot read it (%s); give a Hugging Face folder with a " ..
           "tokenizer_config.json"):format(path, tostring(err)), 0)
  end
  local text = f:read("*a")
  f:close()
  local ok, j = pcall(cjson.decode, text)
  if not ok or type(j) ~= "table" then
    error(("chat_template: %s: is not JSON (%s); give a Hugging Face tokenizer_config.json")
          :format(path, tostring(j)), 0)
  end
  local source = j.chat_template
  if type(source) == "table" then -- a list of { name, template }: the "default" one
    local chosen
    for _, t in ipairs(source) do
      if type(t) == "table" and t.name == "default" then chosen = t.template end
    end
    source = chosen
  end
  if type(source) ~= "string" then -- newer folders keep it in chat_template.jinja
    local dir = path:match("^(.*)/[^/]*$") or "."
    local g = io.open(dir .. "/chat_template.jinja", "rb")
    if g then
      source = g:read("*a")
      g:close()
    end
  end
  if type(source) ~= "string" then
    error(("chat_template: %s: has no \"chat_template\" string (nor a chat_template.jinja " ..
           "beside it); give the folder of a chat model"):format(path), 0)
  end
  local opts = { name = path, additional_special_tokens = j.additional_special_tokens,
                 special_tokens = {} }
  for _, k in ipairs(SPECIAL_KEYS) do
    if j[k] ~= cjson.null then opts[k] = j[k] end
  end
  if type(j.added_tokens_decoder) == "table" then
    local ids = {}
    for id in pairs(j.added_tokens_decoder) do ids[#ids + 1] = tonumber(id) or 0 end
    table.sort(ids)
    for _, id in ipairs(ids) do
      local t = j.added_tokens_decoder[tostring(id)]
      if type(t) == "table" and t.special == true and type(t.content) == "string" then
        opts.special_tokens[#opts.special_tokens + 1] = t.content
      end
    end
  else -- transformers 5 keeps them in tokenizer.json only
    local dir = path:match("^(.*)/[^/]*$") or "."
    local g = io.open(dir .. "/tokenizer.json", "rb")
    local tok_ok, tj = false, nil
    if g then
      tok_ok, tj = pcall(cjson.decode, g:read("*a"))
      g:close()
    end
    if tok_ok and type(tj) == "table" and type(tj.added_tokens) == "table" then
      for _, t in ipairs(tj.added_tokens) do
        if type(t) == "table" and t.special == true and type(t.content) == "string" then
          opts.special_tokens[#opts.special_tokens + 1] = t.content
        end
      end
    end
  end
  return M.new(source, opts)
end

local function render_once(self, messages, add_generation_prompt, extra)
  local vars = {} -- as transformers: the special tokens, then the caller's (which win)
  for k, v in pairs(self.vars) do vars[k] = v end
  for k, v in pairs(extra or {}) do vars[k] = v end
  vars.messages, vars.add_generation_prompt = messages, add_generation_prompt
  return jinja.render(self.compiled, vars)
end

local function copy_messages(messages)
  local out = {}
  for i, m in ipairs(messages) do
    local c = {}
    for k, v in pairs(m) do c[k] = v end
    jinja.ORDER[c] = jinja.ORDER[m] -- the same key order, were a template to write it
    out[i] = c
  end
  return out
end

local function fail(self, msg) error(("chat_template: %s: %s"):format(self.name, msg), 0) end

local byte = string.byte

-- How many bytes a and b share at their start, and at their end.
local function common_prefix(a, b)
  local n = math.min(#a, #b)
  local lo, hi = 0, n -- whole 64-byte blocks first, then byte by byte
  while lo + 64 <= hi and a:sub(lo + 1, lo + 64) == b:sub(lo + 1, lo + 64) do lo = lo + 64 end
  while lo < n and byte(a, lo + 1) == byte(b, lo + 1) do lo = lo + 1 end
  return lo
end

local function common_suffix(a, b)
  local n, k = math.min(#a, #b), 0
  while k + 64 <= n and a:sub(#a - k - 63, #a - k) == b:sub(#b - k - 63, #b - k) do k = k + 64 end
  while k < n and byte(a, #a - k) == byte(b, #b - k) do k = k + 1 end
  return k
end

-- Where the model's own text of assistant message i begins: the end of the
-- conversation before it rendered with the generation prompt, where that
-- is a prefix of the text and the template writes a prompt (nil where not:
-- Llama 2's, which has none). Qwen3's last turn opens with "<think>\n",
-- which a rendering with the marker shares: the difference alone would
-- leave that opening untrained while training the reasoning after it.
local function generation_start(self, messages, i, vars, text)
  local before = {}
  for k = 1, i - 1 do before[k] = messages[k] end
  local aok, a = pcall(render_once, self, before, false, vars)
  local gok, g = pcall(render_once, self, before, true, vars)
  if aok and gok and #g > #a and text:sub(1, #g) == g then return #g end
end

-- The exact text of the conversation, and the assistant spans in it;
-- opts: add_generation_prompt, spans (false: no spans, and no rendering
-- again per assistant message), vars (more template variables, as
-- apply_chat_template's keyword arguments: tools, date_string, ...).
function ChatTemplate:render(messages, opts)
  opts = opts or {}
  if type(messages) ~= "table" then fail(self, "render(messages) needs a list of messages") end
  for i, m in ipairs(messages) do
    if type(m) ~= "table" or type(m.role) ~= "string" then
      fail(self, ("messages[%d] needs a string \"role\" (system, user, assistant)"):format(i))
    end
  end
  local agp = opts.add_generation_prompt == true
  local ok, text = pcall(render_once, self, messages, agp, opts.vars)
  if not ok then
    local msg = tostring(text)
    if msg:find("^raise_exception: ") then
      fail(self, ("the template refuses these messages (%s); give messages it accepts, e.g. " ..
                  "roles it knows in the order it wants"):format(msg:sub(18)))
    end
    fail(self, msg .. "; the template cannot render these messages")
  end
  local spans = {}
  for i, m in ipairs(messages) do
    -- (a message's tool calls are its output too: rendered without them,
    -- their text is part of the difference, and a template that writes no
    -- content beside them, Mistral's, needs no marker)
    local calls = type(m.tool_calls) == "table" and next(m.tool_calls) ~= nil
    local first, last, whole
    if opts.spans ~= false and m.role == "assistant" and type(m.content) == "string" then
      local marker = ("\1\1luazero-span-%d\2\2"):format(i)
      local probe = copy_messages(messages)
      probe[i].content = marker
      if calls then probe[i].tool_calls = nil end
      local mok, marked = pcall(render_once, self, probe, agp, opts.vars)
      local at = mok and marked:find(marker, 1, true)
      if calls and not at then
        -- A template that refuses the message without its calls, or writes
        -- no content beside them (Mistral's): the span is what the message
        -- adds to the conversation before it, where both renderings are the
        -- text's beginnings; else none.
        local before, upto = {}, {}
        for k = 1, i do upto[k] = messages[k]; before[k] = k < i and messages[k] or nil end
        local aok, a = pcall(render_once, self, before, false, opts.vars)
        local bok, b = pcall(render_once, self, upto, false, opts.vars)
        if aok and bok and #b > #a and text:sub(1, #a) == a and text:sub(1, #b) == b then
          first, last, whole = #a, #b, true -- (its end-of-turn text inside)
        end
      elseif not mok or not at or marked:find(marker, at + 1, true) then
        fail(self, ("assistant message %d is not written once, unchanged, by the template; " ..
                    "spans need a template that writes each assistant content once"):format(i))
      else
        -- The span is where the text differs from the rendering with the
        -- marker (whose first and last bytes no text holds): the content as
        -- written, and whatever the template writes from it (Qwen3's <think>
        -- block out of a content that holds one; the message's tool calls).
        first = common_prefix(text, marked)
        last = #text - math.min(common_suffix(text, marked), #text - first)
        local from = generation_start(self, messages, i, opts.vars, text)
        if from and from < first then first = from end
      end
    end
    if first and whole then
      spans[#spans + 1] = { first = first, last = last, role = "assistant", message = i }
    elseif first then
      -- The blanks the template writes just before the content go with it:
      -- tokenizers glue them to its first word ("▁Paris", "ĠParis").
      first = first - #(text:sub(1, first):match("[ \t]*$"))
      local rest = text:sub(last + 1)
      local blank = rest:match("^%s*")
      for _, e in ipairs(self.enders) do
        if rest:sub(#blank + 1, #blank + #e) == e then
          last = last + #blank + #e
          break
        end
      end
      spans[#spans + 1] = { first = first, last = last, role = "assistant", message = i }
    end
  end
  return text, spans
end

-- The template variables of a --chat-kwargs flag: a JSON object, as
-- apply_chat_template's keyword arguments ({"enable_thinking": false}), its
-- keys' order kept as json.loads keeps it (tojson writes tools in it).
-- `flag` names it in the error.
function M.kwargs(text, flag)
  local ok, v = pcall(require("luazero.jinja.json").decode, tostring(text))
  if not ok or type(v) ~= "table" or not tostring(text):match("^%s*{") then
    error(("%s: %s is not a JSON object of template variables (%s); give e.g. " ..
           "'{\"enable_thinking\": false}'"):format(flag, tostring(text):sub(1, 60),
                                                     ok and "not an object" or tostring(v)), 0)
  end
  return v
end

-- Which tokens an assistant span holds: mask[i] = 1 when the bytes token i
-- covers overlap a span, else 0. A token covers starts[i] up to starts[i + 1]
-- (nbytes = #text for the last; at least one byte). Overlap, not "starts
-- inside": a SentencePiece token such as "▁Hello" starts at the blank the
-- template writes before the content. starts as tokenizer:encode(text,
-- { offsets = true }) gives them.
function M.token_mask(spans, starts, nbytes)
  local mask = {}
  for i = 1, #starts do
    local a = starts[i]
    local b = math.max(starts[i + 1] or nbytes, a + 1)
    mask[i] = 0
    for _, s in ipairs(spans) do
      if a < s.last and b > s.first then
        mask[i] = 1
        break
      end
    end
  end
  return mask
end

return M
