-- tests/ref/chat_render.lua — the luazero side of tests/ref/test_chat_template.py
-- and test5_chat_template.py: renders each case of CASES.json with the chat
-- template of an HF FOLDER, with add_generation_prompt off and on, tokenizes
-- the text with FOLDER/tokenizer.json, and writes OUT.json: a list of
-- { text, spans, ids, starts, mask } or { error } per case and setting, in
-- that order (an empty list is written as {}). A case is a list of messages,
-- or { "messages": [...], "vars": {...}, "spans": false } (vars: more template
-- variables, as apply_chat_template's keyword arguments; spans false: no
-- assistant spans). The JSON is read keeping each object's key order, as
-- Python does.
--   luazero tests/ref/chat_render.lua FOLDER CASES.json OUT.json
local cjson = require("cjson")
local chat_template = require("luazero.chat_template")
local json = require("luazero.jinja.json")
local tokenizer = require("luazero.tokenizer")

assert(#arg == 3, "usage: luazero tests/ref/chat_render.lua FOLDER CASES.json OUT.json")
local ct = chat_template.load(arg[1])
local tok = tokenizer.load(arg[1] .. "/tokenizer.json")
local f = assert(io.open(arg[2], "rb"), "chat_render.lua: cannot read " .. arg[2])
local cases = json.decode(f:read("*a"))
f:close()

local out = {}
for _, case in ipairs(cases) do
  local messages, vars, want_spans = case, nil, true
  if case.messages then messages, vars, want_spans = case.messages, case.vars, case.spans ~= false end
  for _, agp in ipairs({ false, true }) do
    local ok, text, spans = pcall(ct.render, ct, messages,
                                  { add_generation_prompt = agp, vars = vars, spans = want_spans })
    if ok then
      local ids, starts = tok:encode(text, { offsets = true })
      out[#out + 1] = { text = text, spans = spans, ids = ids, starts = starts,
                        mask = chat_template.token_mask(spans, starts, #text) }
    else
      out[#out + 1] = { error = text }
    end
  end
end
f = assert(io.open(arg[3], "wb"), "chat_render.lua: cannot write " .. arg[3])
f:write(cjson.encode(out))
f:close()
