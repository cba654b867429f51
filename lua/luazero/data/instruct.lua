-- data/instruct.lua — instruction data: JSON Lines examples tokenised with
-- per-token loss weights, and the instruction file that stores them.
--
-- A line is {"prompt": P, "completion": C} — tokens bos? (P .. C) eos?,
-- weight 0 on bos and tokens starting in P, 1 on those starting in C and
-- on eos — or {"messages": [{"role", "content"}, ...]}
-- rendered by the tokenizer folder's chat template (chat_template.lua):
-- a token weighs 1 when its first byte lies in an assistant span (the
-- assistant's content and the end-of-turn text after it), else 0. Blank
-- lines are skipped. Each example is a document: the batches never let one
-- attend to or predict across another.
--
-- Instruction file (little endian): a header of 256 int32 — [0] magic
-- 20240521, [1] version 1, [2] token count N, [3] document count D — then
-- N uint32 ids, N uint8 weights (0 or 1), D + 1 uint32 document starts
-- (0 first, N last, increasing), D uint32 source lines (the JSONL line each
-- document came from, for messages). docs/formats.md has the same.
local ffi = require("ffi")
local cjson = require("cjson")
local lz = require("luazero")
local files = require("luazero.data.files")

local M = {}

M.VERSION = 1

local fail = files.fail

-- A bad line: "data: FILE:LINE: what; fix".
local function line_fail(path, line, msg) error(("data: %s:%d: %s"):format(path, line, msg), 0) end

-- The byte where `text` stops being UTF-8 (1-based), or nil when it is
-- (JSON text is UTF-8; Python's json and Hugging Face's datasets refuse
-- what is not, where cjson would pass it through).
local function bad_utf8_at(text)
  if not text:find("[\128-\255]") then return nil end
  local i, n = 1, #text
  while i <= n do
    local c = text:byte(i)
    local len = c < 0x80 and 1 or (c >= 0xC2 and c <= 0xDF) and 2 or
                (c >= 0xE0 and c <= 0xEF) and 3 or (c >= 0xF0 and c <= 0xF4) and 4 or nil
    if not len or i + len - 1 > n then return i end
    for k = i + 1, i + len - 1 do
      local d = text:byte(k)
      if d < 0x80 or d > 0xBF then return i end
    end
    local d = text:byte(i + 1)
    if (c == 0xE0 and d < 0xA0) or (c == 0xED and d > 0x9F) or (c == 0xF0 and d < 0x90) or
       (c == 0xF4 and d > 0x8F) then
      return i -- overlong, a surrogate, or past U+10FFFF
    end
    i = i + len
  end
end

--------------------------------------------------------------- growing C arrays

pcall(ffi.cdef, "void *realloc(void *p, size_t n); void free(void *p);")

-- An array of `ctype` in C memory that doubles when full (freed by :free or
-- the collector).
local function growing(ctype)
  local ptr_t = ffi.typeof(ctype .. " *")
  local size = ffi.sizeof(ctype)
  local a = { n = 0, cap = 0, p = nil }
  function a.push(v)
    if a.n == a.cap then
      local cap = math.max(1024, a.cap * 2)
      local old = a.raw
      if old ~= nil then ffi.gc(old, nil) end -- realloc frees it when it moves
      local p = ffi.C.realloc(old, cap * size)
      if p == nil then
        if old ~= nil then ffi.gc(old, ffi.C.free) end
        error("data: out of memory growing an array to " .. cap * size .. " bytes", 0)
      end
      a.raw = ffi.gc(p, ffi.C.free)
      a.p, a.cap = ffi.cast(ptr_t, p), cap
    end
    a.p[a.n] = v
    a.n = a.n + 1
  end
  function a.free()
    if a.raw ~= nil then ffi.C.free(ffi.gc(a.raw, nil)) end
    a.raw, a.p, a.n, a.cap = nil, nil, 0, 0
  end
  return a
end

--------------------------------------------------------------- tokenizers

-- Without --tokenizer: one token per byte (vocabulary 256), no bos or eos,
-- no chat template.
local bytes = {
  bos_id = nil, eos_id = nil,
  encode = function(_, text)
    local ids, starts = {}, {}
    for i = 1, #text do ids[i], starts[i] = text:byte(i), i - 1 end
    return ids, starts
  end,
}

-- --tokenizer ARG: a Hugging Face tokenizer folder (its tokenizer.json, and
-- tokenizer_config.json's chat template for "messages" lines) or a
-- tokenizer.json (the template from the folder it is in). Returns the
-- tokenizer and a function that loads the chat template.
function M.open_tokenizer(arg)
  local fs = require("luazero.io.fs")
  local json, folder = arg, arg:match("^(.*)/[^/]*$") or "."
  if fs.is_dir(arg) then json, folder = arg .. "/tokenizer.json", arg end
  local tok = require("luazero.tokenizer").load(json)
  return tok, function() return require("luazero.chat_template").load(folder) end
end

--------------------------------------------------------------- one example

-- The ids of text and each one's first byte (0-based): the tokenizer's
-- offsets, or for a tokenizer without encode(text, {offsets = true}) the
-- lengths of its tokens decoded one by one, used only when they add up to
-- the text itself (a tokenizer whose decode gives each token's raw bytes;
-- one that replaces a cut character by U+FFFD is refused here).
local function encode_with_offsets(tok, text)
  local ids, starts = tok:encode(text, { offsets = true })
  if starts then return ids, starts end
  local at = 0
  starts = {}
  for i, id in ipairs(ids) do
    starts[i] = at
    local piece = tok:decode({ id })
    if text:sub(at + 1, at + #piece) ~= piece then
      error("data: the tokenizer gives no byte offsets (encode(text, {offsets = true})) and " ..
            "its tokens do not decode to the text byte for byte; use a tokenizer with offsets", 0)
    end
    at = at + #piece
  end
  return ids, starts
end

-- The text encoded whole (as tokenizers would encode prompt .. completion),
-- a token weighing 1 when its first byte lies in the completion; bos
-- before (weight 0) and eos after (weight 1) when the tokenizer has them.
local function prompt_completion(tok, obj, path, line)
  for _, k in ipairs({ "prompt", "completion" }) do
    if obj[k] == nil then
      line_fail(path, line, ('no "%s"; give {"prompt": "...", "completion": "..."}'):format(k))
    end
    if type(obj[k]) ~= "string" then
      line_fail(path, line, ('"%s" is %s, not a string; give text'):format(k,
                obj[k] == cjson.null and "null" or type(obj[k])))
    end
  end
  local text = obj.prompt .. obj.completion
  local x, starts = encode_with_offsets(tok, text)
  local ids, w = {}, {}
  if tok.bos_id then ids[1], w[1] = tok.bos_id, 0 end
  for i = 1, #x do
    ids[#ids + 1], w[#w + 1] = x[i], starts[i] >= #obj.prompt and 1 or 0
  end
  if tok.eos_id then ids[#ids + 1], w[#w + 1] = tok.eos_id, 1 end
  return ids, w
end

local function messages(tok, template, obj, path, line, vars, ordered)
  local msgs = obj.messages
  if type(msgs) ~= "table" or #msgs == 0 then
    line_fail(path, line, '"messages" is not a list of messages; give [{"role": "user", ' ..
              '"content": "..."}, {"role": "assistant", "content": "..."}]')
  end
  for i, m in ipairs(msgs) do
    if type(m) ~= "table" or type(m.role) ~= "string" or type(m.content) ~= "string" then
      line_fail(path, line, ('messages[%d] needs a "role" and a "content", both text'):format(i))
    end
  end
  local tok_ok, ct = pcall(template)
  if not tok_ok then
    -- (the line's position names the file: its own "data: FILE: " goes)
    local why = tostring(ct):gsub("^data: ", "")
    if why:sub(1, #path + 2) == path .. ": " then why = why:sub(#path + 3) end
    line_fail(path, line, why)
  end
  -- (rendered from the line read as the template reads JSON: its objects'
  -- key order and {} kept, as transformers' tojson writes a tool call's
  -- arguments; cjson loses both)
  local ok, text, spans = pcall(ct.render, ct, ordered or msgs, { add_generation_prompt = false,
                                                                vars = vars })
  if not ok then line_fail(path, line, tostring(text):gsub("^data: ", "")) end
  local ids, starts = encode_with_offsets(tok, text)
  table.sort(spans, function(a, b) return a.first < b.first end)
  local w, s = {}, 1
  for i = 1, #ids do
    local at = starts[i]
    while spans[s] and spans[s].last <= at do s = s + 1 end
    local sp = spans[s]
    w[i] = (sp and sp.first <= at and at < sp.last and (sp.role or "assistant") == "assistant")
           and 1 or 0
  end
  return ids, w
end

--------------------------------------------------------------- JSON Lines

-- Tokenises a JSONL file. opts: tokenizer (luazero.tokenizer, or nil: byte
-- level), template (a function returning the chat template, called at the
-- first "messages" line; nil: messages are refused), max_len (examples
-- longer are refused; nil: no limit), seq_flag (the flag that sets it, for
-- the message), chat_vars (more variables of the chat template, as
-- apply_chat_template's keyword arguments). Returns a corpus (kind "instruct", see M.corpus).
function M.tokenize_jsonl(path, opts)
  opts = opts or {}
  local tok = opts.tokenizer or bytes
  local ct
  local function template()
    if not ct then
      if not opts.template then
        error(("data: %s: a \"messages\" line needs a chat template: give --tokenizer " ..
               "with a Hugging Face tokenizer folder (tokenizer.json and " ..
               "tokenizer_config.json with a chat_template)"):format(path), 0)
      end
      ct = opts.template()
    end
    return ct
  end
  local f = files.open(path)
  local ids, weights, starts, lines = growing("uint32_t"), growing("uint8_t"),
                                      growing("uint32_t"), growing("uint32_t")
  local max, line = 0, 0
  local ok, err = pcall(function()
    for text in f:lines() do
      line = line + 1
      if line == 1 and text:sub(1, 3) == "\239\187\191" then
        line_fail(path, 1, "starts with a UTF-8 byte order mark (EF BB BF), which JSON Lines " ..
                  "does not allow; save the file as UTF-8 without it")
      end
      local bad = bad_utf8_at(text)
      if bad then
        line_fail(path, line, ("byte %d (0x%02X) is not UTF-8; save the file as UTF-8 or fix " ..
                  "that line"):format(bad, text:byte(bad)))
      end
      if text:find("%S") then
        local dok, obj = pcall(cjson.decode, text)
        if not dok then
          line_fail(path, line, ("not valid JSON (%s); fix the line or drop it")
                    :format(tostring(obj):gsub("^.-: ", "")))
        end
        if type(obj) ~= "table" or obj[1] ~= nil then
          line_fail(path, line, 'not a JSON object; give {"prompt": ..., "completion": ...} ' ..
                    'or {"messages": [...]}')
        end
        local x, w
        if obj.messages ~= nil then
          if obj.prompt ~= nil or obj.completion ~= nil then
            line_fail(path, line, 'has both "messages" and "prompt"/"completion"; give one form')
          end
          local jok, jobj = pcall(require("luazero.jinja.json").decode, text)
          -- a line's own "tools" (as TRL's datasets keep them per row) are
          -- the template's tools for that line, over --chat-kwargs'
          local vars = opts.chat_vars
          if jok and type(jobj) == "table" and type(jobj.tools) == "table" then
            vars = {}
            for k, v in pairs(opts.chat_vars or {}) do vars[k] = v end
            vars.tools = jobj.tools
          end
          x, w = messages(tok, template, obj, path, line, vars,
                          jok and type(jobj) == "table" and jobj.messages or nil)
        elseif obj.prompt ~= nil or obj.completion ~= nil then
          x, w = prompt_completion(tok, obj, path, line)
        else
          line_fail(path, line, 'has neither "prompt" and "completion" nor "messages"; give ' ..
                    '{"prompt": "...", "completion": "..."} or {"messages": [...]}')
        end
        local trained = 0
        for i = 2, #x do trained = trained + w[i] end
        if trained == 0 then
          line_fail(path, line, ("no token is trained (%d tokens, none from %s); add text " ..
                    "there or drop the line"):format(#x, obj.messages ~= nil and
                    "an assistant message" or "the completion"))
        end
        if opts.max_len and #x > opts.max_len then
          line_fail(path, line, ("the example is %d tokens, longer than the sequence length " ..
                    "%d; raise %s to %d or drop the line")
                    :format(#x, opts.max_len, opts.seq_flag or "--seq-len", #x))
        end
        starts.push(ids.n)
        lines.push(line)
        for i = 1, #x do
          ids.push(x[i])
          weights.push(w[i])
          if x[i] > max then max = x[i] end
        end
      end
    end
  end)
  f:close()
  if not ok then
    ids.free(); weights.free(); starts.free(); lines.free()
    error(err, 0)
  end
  if lines.n == 0 then
    fail(path, 'holds no examples; give lines {"prompt": ..., "completion": ...} or ' ..
         '{"messages": [...]}')
  end
  starts.push(ids.n)
  local c = M.corpus(path, ids.n, lines.n, function(t)
    ffi.copy(t.ids, ids.p, ids.n * 4)
    ffi.copy(t.w, weights.p, ids.n)
    ffi.copy(t.st, starts.p, starts.n * 4)
    ffi.copy(t.ln, lines.p, lines.n * 4)
  end)
  ids.free(); weights.free(); starts.free(); lines.free()
  c.max_id = max
  return c
end

--------------------------------------------------------------- the corpus

-- An instruction corpus of n tokens and d documents in C memory, filled by
-- fill(c): ids (uint32_t*, in an i32 tensor), w (uint8_t*), st (d + 1
-- document starts), ln (d source lines).
function M.corpus(path, n, d, fill)
  local c = {
    path = path, kind = "instruct", count = n, docs = d,
    tokens = lz.tensor({ math.max(n, 1) }, "i32", "workspace"),
    weights = files.bytes_tensor(n),
    starts = lz.tensor({ d + 1 }, "i32", "workspace"),
    lines = lz.tensor({ math.max(d, 1) }, "i32", "workspace"),
  }
  c.ids = ffi.cast("uint32_t *", c.tokens.data)
  c.w = ffi.cast("uint8_t *", c.weights.data)
  c.st = ffi.cast("uint32_t *", c.starts.data)
  c.ln = ffi.cast("uint32_t *", c.lines.data)
  fill(c)
  return c
end

function M.free(c)
  for _, k in ipairs({ "tokens", "weights", "starts", "lines" }) do
    if c[k] then c[k]:free() end
    c[k] = nil
  end
end

--------------------------------------------------------------- the file

-- Writes corpus c as an instruction file, whole or not at all; made_with:
-- the tokenizer's record (data/files.lua), kept in header words 4-6.
function M.write(path, c, made_with)
  local n, d = c.count, c.docs
  local header = ffi.new("int32_t[256]")
  header[0], header[1], header[2], header[3] = files.INSTRUCT_MAGIC, M.VERSION, n, d
  files.put_made_with(header, 4, made_with)
  local total = files.HEADER_BYTES + n * 5 + (d + 1) * 4 + d * 4
  require("luazero.io.atomic").build_file(path, total, function(w)
    w:write(header, files.HEADER_BYTES)
    w:write(c.ids, n * 4)
    w:write(c.w, n)
    w:write(c.st, (d + 1) * 4)
    w:write(c.ln, d * 4)
  end)
  return total
end

-- Reads an instruction file (its first KiB in head).
function M.read(path, f, size, head)
  local h = ffi.cast("const int32_t *", head)
  local version, n, d = h[1], h[2], h[3]
  if version ~= M.VERSION then
    fail(path, ("instruction file version %d is not supported (this luazero reads version " ..
                "%d); re-create it with tools/prepare-data --format jsonl"):format(version,
                M.VERSION))
  end
  if n < 1 or d < 1 then
    fail(path, ("the header says %d tokens in %d documents; an instruction file holds at " ..
                "least one; re-create it with tools/prepare-data --format jsonl"):format(n, d))
  end
  local want = files.HEADER_BYTES + n * 5 + (d + 1) * 4 + d * 4
  if size ~= want then
    fail(path, ("%d bytes, but the header's %d tokens in %d documents make %d (%s); " ..
                "re-create it with tools/prepare-data --format jsonl")
         :format(size, n, d, want, size < want and "truncated" or "bytes after the end"))
  end
  f:seek("set", files.HEADER_BYTES)
  local c = M.corpus(path, n, d, function(c)
    files.read_into(path, f, c.ids, n * 4)
    files.read_into(path, f, c.w, n)
    files.read_into(path, f, c.st, (d + 1) * 4)
    files.read_into(path, f, c.ln, d * 4)
  end)
  local bad
  if c.st[0] ~= 0 or c.st[d] ~= n then bad = "the document starts do not run from 0 to the count" end
  for i = 1, d do
    if not bad and c.st[i] <= c.st[i - 1] then
      bad = ("document %d is empty or out of order"):format(i)
    end
  end
  for i = 0, n - 1 do
    if not bad and c.w[i] > 1 then bad = ("token %d's weight is %d, not 0 or 1"):format(i, c.w[i]) end
  end
  -- as a .jsonl is read: an example none of whose targets is trained (its
  -- first token is no target) is refused
  for i = 1, d do
    if bad then break end
    local trained = 0
    for t = c.st[i - 1] + 1, c.st[i] - 1 do trained = trained + c.w[t] end
    if trained == 0 then
      bad = ("example %d (line %d of its .jsonl): no token is trained (%d tokens, all of " ..
             "weight 0); give it a completion there or drop the line"):format(i, c.ln[i - 1],
             c.st[i] - c.st[i - 1])
    end
  end
  if bad then
    M.free(c)
    fail(path, bad .. "; re-create it with tools/prepare-data --format jsonl")
  end
  c.max_id = files.max_id(c.ids, n)
  c.made_with = files.made_with_at(h, 4)
  return c
end

-- The first byte of text that is not UTF-8 (its 1-based offset), or nil.
M.bad_utf8_at = bad_utf8_at

return M
