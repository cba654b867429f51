-- test_chat_template.lua — lua/luazero/chat_template.lua and luazero.jinja
-- without Python: the chat templates of Llama 3, Zephyr/TinyLlama, ChatML,
-- Llama 2, Mistral, Qwen2.5, Qwen3, Gemma 2/3, Phi-3 and Mistral v0.3
-- (tests/fixtures/chat/*/tokenizer_config.json) against
-- the strings jinja2 renders for transformers' apply_chat_template (copied
-- here; tests/ref/test_chat_template.py compares with transformers itself),
-- the assistant spans, whitespace control, and the one-line refusals.
local cjson = require("cjson")
local chat_template = require("luazero.chat_template")
local jinja = require("luazero.jinja")

local T = {}

local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests/lua"
local FIXTURES = here .. "/../fixtures/chat/"

local function same(got, want)
  local a, b = cjson.encode(got), cjson.encode(want)
  assert(a == b, ("\nexpected: %s\n     got: %s"):format(b, a))
end

local SHORT = {
  { role = "system", content = "You are terse." },
  { role = "user", content = "Hi there" },
  { role = "assistant", content = "Hello!" },
}
local LONG = {
  { role = "user", content = "  spaced question \n" },
  { role = "assistant", content = " answer with\ttabs  " },
  { role = "user", content = "again? 日本語 😀" },
  { role = "assistant", content = "Yes.\n\nTwo lines." },
}

-- The span texts of a rendering.
local function span_texts(text, spans)
  local out = {}
  for i, s in ipairs(spans) do
    assert(s.role == "assistant" and s.first <= s.last, cjson.encode(s))
    out[i] = text:sub(s.first + 1, s.last)
  end
  return out
end

-- ct renders messages (with opts) as want_text, with the assistant spans
-- want_spans; returns the spans.
local function renders(ct, messages, opts, want_text, want_spans)
  local text, spans = ct:render(messages, opts)
  same(text, want_text)
  same(span_texts(text, spans), want_spans)
  return spans
end

function T.llama3()
  local ct = chat_template.load(FIXTURES .. "llama3")
  renders(ct, SHORT, nil,
          "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>" ..
          "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>" ..
          "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>",
          { "Hello!<|eot_id|>" })
  local spans = renders(ct, LONG, { add_generation_prompt = true },
          "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nspaced question<|eot_id|>" ..
          "<|start_header_id|>assistant<|end_header_id|>\n\nanswer with\ttabs<|eot_id|>" ..
          "<|start_header_id|>user<|end_header_id|>\n\nagain? 日本語 😀<|eot_id|>" ..
          "<|start_header_id|>assistant<|end_header_id|>\n\nYes.\n\nTwo lines.<|eot_id|>" ..
          "<|start_header_id|>assistant<|end_header_id|>\n\n",
          { "answer with\ttabs<|eot_id|>", "Yes.\n\nTwo lines.<|eot_id|>" })
  assert(spans[1].message == 2 and spans[2].message == 4)
end

function T.zephyr_trim_and_lstrip_blocks()
  local ct = chat_template.load(FIXTURES .. "zephyr")
  renders(ct, SHORT, nil,
          "<|system|>\nYou are terse.</s>\n<|user|>\nHi there</s>\n<|assistant|>\nHello!</s>\n",
          { "Hello!</s>" })
  local text = ct:render(LONG, { add_generation_prompt = true })
  same(text, "<|user|>\n  spaced question \n</s>\n<|assistant|>\n answer with\ttabs  </s>\n" ..
             "<|user|>\nagain? 日本語 😀</s>\n<|assistant|>\nYes.\n\nTwo lines.</s>\n<|assistant|>\n")
end

function T.chatml()
  local ct = chat_template.load(FIXTURES .. "chatml")
  renders(ct, LONG, nil,
          "<|im_start|>user\n  spaced question \n<|im_end|>\n<|im_start|>assistant\n answer with" ..
          "\ttabs  <|im_end|>\n<|im_start|>user\nagain? 日本語 😀<|im_end|>\n<|im_start|>assistant\n" ..
          "Yes.\n\nTwo lines.<|im_end|>\n",
          { " answer with\ttabs  <|im_end|>", "Yes.\n\nTwo lines.<|im_end|>" })
  assert(ct.bos_token == nil and ct.eos_token == "<|im_end|>")
end

function T.llama2_slices_strip_and_system()
  local ct = chat_template.load(FIXTURES .. "llama2")
  renders(ct, SHORT, nil,
          "<s>[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nHi there [/INST] Hello! </s>",
          { " Hello! </s>" })
  renders(ct, LONG, nil,
          "<s>[INST] spaced question [/INST] answer with\ttabs </s><s>[INST] again? 日本語 😀 " ..
          "[/INST] Yes.\n\nTwo lines. </s>",
          { " answer with\ttabs </s>", " Yes.\n\nTwo lines. </s>" })
  renders(ct, { { role = "user", content = "" }, { role = "assistant", content = "" } }, nil,
          "<s>[INST]  [/INST]  </s>", { "  </s>" })
end

function T.refused_roles_name_the_file()
  local ct = chat_template.load(FIXTURES .. "mistral")
  local ok, err = pcall(ct.render, ct, SHORT)
  assert(not ok and err:find("mistral/tokenizer_config.json: the template refuses these messages " ..
                             "(Conversation roles must alternate", 1, true), err)
  assert(not err:find("\n"), err)
  same(ct:render(LONG), "<s>[INST]   spaced question \n [/INST] answer with\ttabs  </s>[INST] " ..
                        "again? 日本語 😀 [/INST]Yes.\n\nTwo lines.</s>")
  ok, err = pcall(ct.render, ct, { { content = "x" } })
  assert(not ok and err:find('messages[1] needs a string "role"', 1, true), err)
end

function T.unsupported_constructs_are_named()
  local cases = {
    { "{% macro m() %}x{% endmacro %}", "{% macro %} is not supported" },
    { "{{ x | wordwrap }}", "the filter |wordwrap is not supported" },
    { "{% for m in messages %}", "{% endfor %} is missing" },
    { "{{ 'a' ", "not closed with }}" },
    { "{% set x %}y{% endset %}", "(a block set) is not supported" },
    { "{% if true %}{% break %}{% endif %}", "{% break %} outside a {% for %}" },
    -- jinja2's sandbox (transformers') caps ranges at 100000 items: refused, not built
    { "{% for i in range(100000000) %}{% endfor %}", "range(0, 100000000, 1) would make " ..
      "100000000 items, more than the 100000 jinja2's sandbox allows" },
    { "{% for i in range(1, 5, 0) %}{% endfor %}", "range() step must not be zero" },
  }
  for _, c in ipairs(cases) do
    local ok, err = pcall(function()
      chat_template.new(c[1], { name = "t.json" }):render({ { role = "user", content = "x" } })
    end)
    assert(not ok and err:find("chat_template: t.json: ", 1, true) and err:find(c[2], 1, true) and
           not err:find("\n"), tostring(err))
  end
  local ok, err = pcall(chat_template.load, FIXTURES .. "nowhere")
  assert(not ok and err:find("nowhere/tokenizer_config.json: cannot read it", 1, true), err)
end

local function folder_with(files)
  local dir = os.tmpname()
  os.remove(dir)
  assert(os.execute("mkdir -p '" .. dir .. "'"))
  for name, text in pairs(files) do
    local f = assert(io.open(dir .. "/" .. name, "wb"))
    f:write(text)
    f:close()
  end
  return dir
end

function T.template_lists_and_jinja_files()
  local listed = folder_with({ ["tokenizer_config.json"] = cjson.encode({
    eos_token = { content = "</s>", special = true },
    chat_template = { { name = "tool_use", template = "tools" },
                      { name = "default", template = "{{ messages[0].content ~ eos_token }}" } } }) })
  same(chat_template.load(listed):render({ { role = "user", content = "hi" } }), "hi</s>")
  local jinja_file = folder_with({ ["tokenizer_config.json"] = cjson.encode({ eos_token = "<e>" }),
                                   ["chat_template.jinja"] = "{% for m in messages %}{{ m.role }}:" ..
                                     "{{ m.content }}{{ eos_token }}\n{% endfor %}" })
  same(chat_template.load(jinja_file):render({ { role = "user", content = "a" },
                                                { role = "assistant", content = "b" } }),
       "user:a<e>\nassistant:b<e>\n")
  local none = folder_with({ ["tokenizer_config.json"] = cjson.encode({ eos_token = "<e>" }) })
  local ok, err = pcall(chat_template.load, none)
  assert(not ok and err:find('has no "chat_template" string', 1, true), err)
end

-- A span is where the text differs from the rendering with the content
-- replaced: what the template writes from the content goes with it; a
-- template that writes the content twice has no span.
function T.spans_are_where_the_content_changes_the_text()
  local ct = chat_template.new("{% for m in messages %}{{ m.content }}{% if m.content | length > 3 %}" ..
                               " (long){% endif %}{{ eos_token }}{% endfor %}",
                               { name = "t.json", eos_token = "</s>" })
  local msgs = { { role = "user", content = "hello" }, { role = "assistant", content = "hi" } }
  renders(ct, msgs, nil, "hello (long)</s>hi</s>", { "hi</s>" })
  renders(ct, { msgs[1], { role = "assistant", content = "well" } }, nil,
          "hello (long)</s>well (long)</s>", { "well" }) -- the marker is long too
  local text, spans = ct:render(msgs, { spans = false })
  same({ text, spans }, { "hello (long)</s>hi</s>", {} })
  local twice = chat_template.new("{% for m in messages %}{{ m.content }}{{ m.content }}{% endfor %}",
                                  { name = "t.json" })
  local ok, err = pcall(twice.render, twice, msgs)
  assert(not ok and err:find("chat_template: t.json: assistant message 2 is not written once", 1, true) and
         not err:find("\n"), err)
  -- Qwen3: the reasoning of the last turn is part of its span, its <think>
  -- opening too (what the model writes after the generation prompt), older
  -- ones are dropped; the same reasoning as reasoning_content, the same span
  local qwen3 = chat_template.load(FIXTURES .. "qwen3")
  local conv = { { role = "user", content = "1?" },
                 { role = "assistant", content = "<think>\nr1\n</think>\n\nA1" },
                 { role = "user", content = "2?" },
                 { role = "assistant", content = "<think>\nr2\n</think>\n\nA2" } }
  local want = "<|im_start|>user\n1?<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n" ..
               "<|im_start|>user\n2?<|im_end|>\n<|im_start|>assistant\n<think>\nr2\n</think>\n\n" ..
               "A2<|im_end|>\n"
  renders(qwen3, conv, nil, want, { "A1<|im_end|>", "<think>\nr2\n</think>\n\nA2<|im_end|>" })
  conv[4] = { role = "assistant", content = "A2", reasoning_content = "r2" }
  renders(qwen3, conv, nil, want, { "A1<|im_end|>", "<think>\nr2\n</think>\n\nA2<|im_end|>" })
end

-- An assistant message's tool calls are its output: the span covers them
-- with its end of turn (Qwen2.5: the content, each <tool_call> with its
-- arguments in the line's key order and {} as written, then <|im_end|>);
-- a template that writes no content beside the calls (Mistral v0.3) gets
-- what the message adds to the conversation before it, not a refusal.
function T.tool_calls_are_part_of_the_assistant_span()
  local json = require("luazero.jinja.json")
  local line = '{"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", ' ..
    '"content": "Let me check.", "tool_calls": [{"type": "function", "function": {"name": ' ..
    '"get_weather", "arguments": {"unit": "celsius", "city": "Zurich"}}}, {"type": "function", ' ..
    '"function": {"name": "now", "arguments": {}}}]}, {"role": "tool", "content": "21"}, ' ..
    '{"role": "assistant", "content": "21 C."}]}'
  local qwen = chat_template.load(FIXTURES .. "qwen2.5")
  local text, spans = qwen:render(json.decode(line).messages)
  same(span_texts(text, spans), {
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"unit": "celsius", ' ..
    '"city": "Zurich"}}\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n' ..
    '</tool_call><|im_end|>', "21 C.<|im_end|>" })
  local mistral = chat_template.load(FIXTURES .. "mistral-v0.3")
  local m = json.decode(('{"messages": [{"role": "user", "content": "Weather?"}, {"role": ' ..
    '"assistant", "content": "", "tool_calls": [{"id": "call00001", "type": "function", ' ..
    '"function": {"name": "get_weather", "arguments": {"city": "Zurich"}}}]}, {"role": "tool", ' ..
    '"tool_call_id": "call00001", "content": "21"}, {"role": "assistant", "content": "21 C."}]}'))
  text, spans = mistral:render(m.messages)
  same(span_texts(text, spans), {
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Zurich"}, "id": ' ..
    '"call00001"}]</s>', " 21 C.</s>" })
end

-- A JSON Lines file of tool calls reads as the template reads JSON (the
-- arguments' key order, {} not []), and its tool-call turn trains.
function T.jsonl_tool_calls_keep_their_json()
  local line = '{"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", ' ..
    '"content": "", "tool_calls": [{"type": "function", "function": {"name": "get_weather", ' ..
    '"arguments": {"unit": "celsius", "city": "Zurich"}}}, {"type": "function", "function": ' ..
    '{"name": "now", "arguments": {}}}]}]}\n'
  local path = os.tmpname()
  local f = assert(io.open(path, "wb")); f:write(line); f:close()
  local qwen = chat_template.load(FIXTURES .. "qwen2.5")
  local c = require("luazero.data.instruct").tokenize_jsonl(path, {
    template = function() return qwen end })
  os.remove(path)
  local n, bytes, trained = c.count, {}, 0
  for i = 0, n - 1 do bytes[#bytes + 1] = string.char(c.ids[i]); trained = trained + c.w[i] end
  local text = table.concat(bytes)
  assert(text:find('"arguments": {"unit": "celsius", "city": "Zurich"}}', 1, true) and
         text:find('"arguments": {}}', 1, true), text)
  assert(trained > 0, "the tool-call turn trains nothing")
end

function T.extra_variables_as_keyword_arguments()
  local ct = chat_template.new("{{ bos_token }}{{ date_string | default('no date') }}|" ..
                               "{% for t in tools %}{{ t | tojson }}{% endfor %}",
                               { name = "t.json", bos_token = "<s>" })
  same(ct:render({}), "<s>no date|")
  -- the caller's variables win over the special tokens, as in apply_chat_template(**kwargs)
  same(ct:render({}, { vars = { date_string = "1 Jan", bos_token = "<b>",
                                tools = { { name = "f", required = { "x" } } } } }),
       '<b>1 Jan|{"name": "f", "required": ["x"]}')
end

function T.token_mask_is_overlap()
  local spans = { { first = 5, last = 10, role = "assistant" }, { first = 20, last = 22, role = "assistant" } }
  same(chat_template.token_mask(spans, { 0, 4, 7, 10, 12, 19, 22 }, 25), { 0, 1, 1, 0, 0, 1, 0 })
  -- a token of no bytes (a prepended "▁" alone) counts as one byte
  same(chat_template.token_mask(spans, { 0, 5, 5, 9 }, 15), { 0, 1, 1, 1 })
  same(chat_template.token_mask({}, { 0, 1 }, 2), { 0, 0 })
end

-- The templates of Qwen2.5 (tools), Qwen3 (thinking), Gemma 3, Phi-3 and
-- Mistral v0.3 (tools),
-- against transformers 5.23's renderings (tests/ref/test5_chat_template.py
-- compares with it over many more conversations). Messages and tools are read
-- as JSON keeping their key order, which tojson writes.
function T.qwen_gemma_phi3_mistral3()
  local json = require("luazero.jinja.json")
  local tools = json.decode('[{"type": "function", "function": {"name": "now", "description": ' ..
                            '"The time.", "parameters": {"type": "object", "properties": {}, ' ..
                            '"required": []}}}]')
  local calls = json.decode('[{"role": "user", "content": "Time?"}, {"role": "assistant", ' ..
                            '"content": "", "tool_calls": [{"type": "function", "function": ' ..
                            '{"name": "now", "arguments": {"tz": "UTC", "fmt": "%H"}}}]}, ' ..
                            '{"role": "tool", "content": "12"}, {"role": "assistant", "content": "Noon."}]')
  local qwen25 = chat_template.load(FIXTURES .. "qwen2.5")
  same(qwen25:render(calls, { vars = { tools = tools }, spans = false }),
       "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n" ..
       "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are " ..
       "provided with function signatures within <tools></tools> XML tags:\n<tools>\n" ..
       '{"type": "function", "function": {"name": "now", "description": "The time.", "parameters": ' ..
       '{"type": "object", "properties": {}, "required": []}}}\n</tools>\n\nFor each function call, ' ..
       "return a json object with function name and arguments within <tool_call></tool_call> XML " ..
       'tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n' ..
       "</tool_call><|im_end|>\n<|im_start|>user\nTime?<|im_end|>\n<|im_start|>assistant\n" ..
       '<tool_call>\n{"name": "now", "arguments": {"tz": "UTC", "fmt": "%H"}}\n</tool_call>' ..
       "<|im_end|>\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n" ..
       "<|im_start|>assistant\nNoon.<|im_end|>\n")
  local qwen3 = chat_template.load(FIXTURES .. "qwen3")
  same(qwen3:render({ SHORT[2] }, { add_generation_prompt = true,
                                    vars = { enable_thinking = false } }),
       "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
  same(qwen3:render({ SHORT[2], { role = "assistant", content = "<think>\nhm\n</think>\n\nHello!" } },
                    { spans = false }),
       "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<think>\nhm\n</think>\n\n" ..
       "Hello!<|im_end|>\n")
  renders(chat_template.load(FIXTURES .. "gemma3"), SHORT, { add_generation_prompt = true },
          "<bos><start_of_turn>user\nYou are terse.\n\nHi there<end_of_turn>\n<start_of_turn>model\n" ..
          "Hello!<end_of_turn>\n<start_of_turn>model\n", { "Hello!<end_of_turn>" })
  renders(chat_template.load(FIXTURES .. "phi3"), SHORT, nil,
          "<|system|>\nYou are terse.<|end|>\n<|user|>\nHi there<|end|>\n<|assistant|>\nHello!" ..
          "<|end|>\n<|endoftext|>", { "Hello!<|end|>" })
  local mistral = chat_template.load(FIXTURES .. "mistral-v0.3")
  local turns = json.decode('[{"role": "system", "content": "Be brief."}, {"role": "user", ' ..
                            '"content": "Time?"}, {"role": "assistant", "tool_calls": [{"id": ' ..
                            '"call00001", "type": "function", "function": {"name": "now", ' ..
                            '"arguments": {"tz": "UTC"}}}]}, {"role": "tool", "tool_call_id": ' ..
                            '"call00001", "content": "12"}, {"role": "assistant", "content": ' ..
                            '" Noon. "}, {"role": "user", "content": "Thanks"}]')
  local text, spans = mistral:render(turns, { vars = { tools = tools } })
  same(text, '<s>[INST] Time?[/INST][TOOL_CALLS] [{"name": "now", "arguments": {"tz": "UTC"}, ' ..
             '"id": "call00001"}]</s>[TOOL_RESULTS] {"content": 12, "call_id": "call00001"}' ..
             '[/TOOL_RESULTS] Noon.</s>[AVAILABLE_TOOLS] [{"type": "function", "function": ' ..
             '{"name": "now", "description": "The time.", "parameters": {"type": "object", ' ..
             '"properties": {}, "required": []}}}][/AVAILABLE_TOOLS][INST] Be brief.\n\nThanks[/INST]')
  same(span_texts(text, spans), { " Noon.</s>" })
  local ok, err = pcall(chat_template.load(FIXTURES .. "gemma2").render,
                        chat_template.load(FIXTURES .. "gemma2"), SHORT)
  assert(not ok and err:find("the template refuses these messages (System role not supported)",
                             1, true) and not err:find("\n"), err)
end

-- JSON as Python's json.loads reads it: key order, {} apart from [], null as
-- None, escapes and surrogate pairs; an error is one line with its line number.
function T.json_keeps_order()
  local json = require("luazero.jinja.json")
  local v = json.decode(' {"z": 1, "a": [true, null, {}], "m": "\\u00e9\\ud83d\\ude00\\n\\"", "e": -2.5e-1}')
  same(jinja.render(jinja.compile("{{ v | tojson }}|{{ v.keys() | list }}|{{ v.a[1] is none }}"),
                    { v = v }),
       '{"z": 1, "a": [true, null, {}], "m": "é😀\\n\\"", "e": -0.25}|[\'z\', \'a\', \'m\', \'e\']|True')
  for _, bad in ipairs({ '{"a": 1,\n "b" 2}', '[1, 2', '{"a": 1} x', '"\\q"' }) do
    local ok, err = pcall(json.decode, bad)
    assert(not ok and err:find("^json: line %d+: ") and not err:find("\n"), tostring(err))
  end
  local ok, err = pcall(json.decode, '{"a": 1,\n "b" 2}')
  assert(not ok and err:find("json: line 2: expected : after an object key", 1, true), err)
end

local function render(src, vars) return jinja.render(jinja.compile(src), vars or {}) end

function T.jinja_expressions()
  same(render("{{ 'a' ~ 1 ~ none }}|{{ 7 // 2 }} {{ -7 % 3 }} {{ 2 ** 3 }}|{{ 'x' if 0 else 'y' }}"),
       "a1None|3 2 8|y")
  same(render("{{ [1, 2, 3][1:] }}{{ 'héllo'[1:3] }}{{ 'abc'[::-1] }}{{ [1,2,3][-1] }}"),
       "[2, 3]élcba3")
  same(render("{{ '  a b \\t' | trim | upper }}{{ 'abc' | length }}{{ '日本' | length }}" ..
              "{{ ('a' in 'cat') ~ (3 not in [1, 2]) }}"), "A B32TrueTrue")
  same(render("{{ x is defined }}{{ y is not defined }}{{ none is none }}{{ m.role }}{{ m['role'] }}",
              { x = 1, m = { role = "user" } }), "TrueTrueTrueuseruser")
  same(render("{{ 'a\\u00e9\\x41\\n' }}{{ \"q'\" }}{{ '\\u3000x\\u3000'.strip() }}"), "aéA\nq'x")
  -- tojson is transformers' (4.43 and later): json.dumps without ensure_ascii,
  -- keys in their written order, no HTML escapes; its keyword arguments too.
  same(render("{{ {'b': 1, 'a': [true, none, \"<é😀'&>\\n\"], 'c': {}} | tojson }}"),
       '{"b": 1, "a": [true, null, "<é😀\'&>\\n"], "c": {}}')
  same(render("{{ {'b': 1.5, 'a': 'é'} | tojson(indent=2, sort_keys=true, ensure_ascii=true) }}"),
       '{\n  "a": "\\u00e9",\n  "b": 1.5\n}')
  same(render("{{ {'b': [], 'a': 0.1} | tojson(separators=(',', ':')) }}"), '{"b":[],"a":0.1}')
  -- numbers as the JSON wrote them, as Python's json.loads then dumps does:
  -- whole floats keep their point, big integers their digits
  local decoded = require("luazero.jinja.json").decode(
    '{"t": 1.0, "l": [100.0, -0.0, 1e3, 1e16, 12345678901234567890, 7, 0.1, 1e-05]}')
  same(render("{{ x | tojson }}", { x = decoded }),
       '{"t": 1.0, "l": [100.0, -0.0, 1000.0, 1e+16, 12345678901234567890, 7, 0.1, 1e-05]}')
  -- Python's str of a float and repr of a string (a template printing a
  -- list of content parts): the fewest digits, the quote Python picks
  same(render("{{ x }}|{{ 0.1 }}|{{ 1 / 3 }}", { x = { "it's\tok", 'a"b', "x'y\"z" } }),
       "[\"it's\\tok\", 'a\"b', 'x\\'y\"z']|0.1|0.3333333333333333")
  -- jinja2's title, int toward zero, a tuple of suffixes, join by attribute
  same(render("{{ \"it's a x-ray (big)\" | title }}|{{ -3.7 | int }}|" ..
              "{{ 'abc'.endswith(('x', 'c')) }}|{{ xs | join(', ', attribute='n') }}",
              { xs = { { n = "a" }, { n = "b" } } }),
       "It's A X-Ray (Big)|-3|True|a, b")
  -- positionally in transformers' order: ensure_ascii, then indent
  same(render("{{ ['é'] | tojson(true) }}|{{ ['é'] | tojson(false, 1) }}"),
       '["\\u00e9"]|[\n "é"\n]')
  local json = require("luazero.jinja.json")
  local tools = json.decode('[{"type": "function", "function": {"name": "f", "parameters": ' ..
                            '{"type": "object", "properties": {}, "required": []}}}]')
  same(render("{{ tools[0] | tojson }}|{% for k in tools[0] %}{{ k }}{% endfor %}|" ..
              "{{ tools[0].function.parameters.items() | list | length }}", { tools = tools }),
       '{"type": "function", "function": {"name": "f", "parameters": {"type": "object", ' ..
       '"properties": {}, "required": []}}}|typefunction|3')
  same(render("{{ x | default('d') }}{{ '' | default('e', true) }}{{ [3, 4] | join('-') }}"), "de3-4")
  -- Python's bool is an int in comparisons
  same(render("{{ true == 1 }}{{ false == 0 }}{{ true == 2 }}{{ 1 == true }}{{ 0 != false }}"),
       "TrueTrueFalseTrueFalse")
  local ms = { { role = "user", content = "A" }, { role = "assistant", content = "B", tool = true },
               { role = "user", content = "C" } }
  same(render("{{ ['a', 'code', 'b'] | reject('equalto', 'code') | join(', ') }}|" ..
              "{{ ms | selectattr('role', 'equalto', 'user') | map(attribute='content') | join }}|" ..
              "{{ [1, 0, 2] | select | list }}|{{ ms | rejectattr('tool') | list | length }}|" ..
              "{{ ['x', 'y', 'x'] | unique | join }}|{{ ms | map(attribute='zz', default='d') | join }}|" ..
              "{{ [' a ', 'b '] | map('trim') | join('.') }}", { ms = ms }),
       "a, b|AC|[1, 2]|2|xy|ddd|a.b")
end

function T.jinja_statements_and_whitespace()
  same(render("{% for x in xs if x > 1 %}{{ loop.index0 }}{{ x }}{% if loop.last %}.{% endif %}" ..
              "{% else %}none{% endfor %}", { xs = { 1, 2, 3 } }), "0213.")
  same(render("{% for x in xs %}{% else %}none{% endfor %}", { xs = {} }), "none")
  -- loopcontrols, which transformers' renderer loads
  same(render("{% for x in xs %}{% if x == 2 %}{% continue %}{% endif %}{{ x }}" ..
              "{% if x == 3 %}{% break %}{% endif %}{% endfor %}", { xs = { 1, 2, 3, 4 } }), "13")
  same(render("{{ strftime_now('%Y') | length }}"), "4")
  -- transformers' {% generation %} (its assistant mask): the body as it is
  same(render("{% for x in xs %}<{% generation %}{{ x }}{% if x == 2 %}{% break %}{% endif %}" ..
              "{% endgeneration %}>{% endfor %}", { xs = { 1, 2, 3 } }), "<1><2")
  same(render("{% set ns = namespace(n=0) %}{% for x in [1, 2] %}{% set ns.n = ns.n + x %}" ..
              "{% set local = 5 %}{% endfor %}{{ ns.n }}{{ local }}"), "3")
  same(render("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}", { d = { b = 2, a = 1 } }),
       "a=1;b=2;")
  -- lstrip_blocks and trim_blocks; {%- -%} and {{- -}} strip all blanks; one
  -- trailing newline of the template goes.
  same(render("a\n  {% if true %}\n  b\n  {% endif %}\nc  {{- ' d ' -}}  \n e\n"), "a\n  b\nc d e")
  same(render("x  {%+ if true %}y{% endif +%}\nz"), "x  y\nz")
  same(render("{# a comment #}\n  {#- another -#}  q"), "q")
end

return T
