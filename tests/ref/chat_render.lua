-- tests/ref/chat_render.lua — the luazero side of tests/ref/test_chat_template.py:
-- renders each conversation of CONVERSATIONS.json (a list of message lists)
-- with the chat template of an HF FOLDER, with add_generation_prompt off and
-- on, tokenizes the text with FOLDER/tokenizer.json, and writes OUT.json: a
-- list of { text, spans, ids, starts, mask } or { error } per conversation and
-- setting, in that order (an empty list is written as {}).
--   luazero tests/ref/chat_render.lua FOLDER CONVERSATIONS.json OUT.json
local cjson = require("cjson")
local chat_template = require("luazero.chat_template")
local tokenizer = require("luazero.tokenizer")

assert(#arg == 3, "usage: luazero tests/ref/chat_render.lua FOLDER CONVERSATIONS.json OUT.json")
local ct = chat_template.load(arg[1])
local tok = tokenizer.load(arg[1] .. "/tokenizer.json")
local f = assert(io.open(arg[2], "rb"), "chat_render.lua: cannot read " .. arg[2])
local conversations = cjson.decode(f:read("*a"))
f:close()

local out = {}
for _, messages in ipairs(conversations) do
  for _, agp in ipairs({ false, true }) do
    local ok, text, spans = pcall(ct.render, ct, messages, { add_generation_prompt = agp })
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
