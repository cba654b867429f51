-- scripts/generate.lua — continues prompts with a trained model, decoding
-- one token per step against a key/value cache (docs/generate.md).
--   luazero scripts/generate.lua --load runs/ck --prompt "ROMEO:" --max-new-tokens 200
--   luazero scripts/generate.lua --hf tinyllama --prompts prompts.txt --temperature 0.8 --top-p 0.9
--   luazero scripts/generate.lua --hf base --adapters lora-out --chat --prompts chats.jsonl --out out.jsonl
-- Flags: luazero scripts/generate.lua --help.
local cjson = require("cjson")
local data = require("luazero.data")
local generate = require("luazero.generate")
local exits = require("luazero.run.exits")
local run_flags = require("luazero.run.flags")
local inputs = require("luazero.run.inputs")
local atomic = require("luazero.io.atomic")
local paths = require("luazero.io.paths")
local run_text = require("luazero.run.text")
local fs = require("luazero.io.fs")
local valid_utf8 = require("luazero.tokenizer.sentencepiece").valid_utf8
local exists, is_dir = fs.exists, fs.is_dir

-- The sampling flags: greedy decoding (--temperature 0) takes the likeliest
-- token, which none of them changes.
local SAMPLING = { ok = function(f) return f.temperature > 0 end, with = { "--temperature", "0.8" },
                   says = "does nothing with greedy decoding (--temperature 0): add " ..
                          "--temperature T (above 0) to sample, or drop it" }

local spec = run_flags.spec(run_flags.weights("config.json, *.safetensors, tokenizer.json"), {
  { "tokenizer", "string", nil, "a tokenizer.json or the folder holding it (default: the model folder's; none: bytes are tokens)" },
  { "chat", "flag", false, "render each prompt with the folder's chat template (tokenizer_config.json)" },
  { "chat-kwargs", "string", nil, "with --chat: more variables of the chat template, a JSON object as apply_chat_template's keyword arguments (e.g. '{\"enable_thinking\": false}')",
    needs = "chat" },
  { "prompt", "string", nil, "one prompt (text; with --chat the user's message)" },
  { "prompts", "string", nil, "a file of prompts: one per line, or JSON Lines ({\"prompt\": ...}, {\"prompt_ids\": [...]} or, with --chat, {\"messages\": [...]})" },
  { "prompt-ids", "string", nil, "one prompt as token ids, comma-separated" },
  { "max-new-tokens", "int", 64, "new tokens per prompt (at most)", min = 1 },
  { "temperature", "number", 0, "0: greedy (the likeliest token); above 0: sample at that temperature",
    min = 0, why = "0 is greedy" },
  { "top-k", "int", 0, "with --temperature: sample among the k likeliest tokens (0: all)",
    min = 0, why = "0 keeps all tokens", needs = SAMPLING },
  { "top-p", "number", 1, "with --temperature: sample among the likeliest tokens whose probabilities reach p (1: all)",
    over = 0, max = 1, needs = SAMPLING },
  { "seed", "int", 1337, "with --temperature: seed of the sampling", needs = SAMPLING },
  { "stop", "string", nil, "end a completion where this text appears (the text is cut off)" },
  { "batch", "int", 8, "prompts decoded together", min = 1 },
  { "dtype", "string", nil, "fp32 or bf16 (default: a checkpoint's, else fp32)",
    choices = { "fp32", "bf16" } },
  { "kv-dtype", "string", "fp32", "the key/value cache: fp32, or bf16 for half its memory",
    choices = { "fp32", "bf16" } },
  { "out", "string", nil, "write one JSON object per prompt to this file (JSON Lines)" },
  { "stats", "flag", false, "say on stderr how fast the prompts and the new tokens went" },
})

local ex = exits.new({ script = "generate" })
local fail, checked = ex.user_error, ex.checked

local function read_json(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local text = f:read("*a")
  f:close()
  local ok, j = pcall(cjson.decode, text)
  return ok and type(j) == "table" and j or nil
end

-- The ids of a config.json field: a number or a list of them.
local function id_set(v, set)
  if type(v) == "number" then set[v] = true
  elseif type(v) == "table" then for _, x in ipairs(v) do id_set(x, set) end end
  return set
end

-- Prompts: { text = ..., messages = ... } each, in order.
local function read_prompts(flags)
  local list = {}
  if flags.prompt then list[#list + 1] = { text = flags.prompt } end
  if flags.prompt_ids then
    local ids = {}
    -- every comma separates two ids: "1,,2" is a slip, not 1,2
    for n in (flags.prompt_ids .. ","):gmatch("([^,]*),") do
      local v = tonumber(n)
      if not v or v ~= math.floor(v) or v < 0 then
        fail(("--prompt-ids %s: %s is not a token id; give whole numbers, comma-separated")
             :format(flags.prompt_ids, n:find("%S") and ("'" .. n .. "'") or "an empty entry"))
      end
      ids[#ids + 1] = v
    end
    list[#list + 1] = { ids = ids }
  end
  if flags.prompts then
    local f, why = io.open(flags.prompts, "rb")
    if not f then fail(("--prompts %s: cannot read it (%s)"):format(flags.prompts, why)) end
    local n = 0
    for line in f:lines() do
      n = n + 1
      if n == 1 and line:sub(1, 3) == "\239\187\191" then
        fail(("--prompts %s: starts with a UTF-8 byte order mark (EF BB BF), which would be " ..
              "part of the first prompt; save the file as UTF-8 without it"):format(flags.prompts))
      end
      local utf8_ok, at = valid_utf8(line)
      if not utf8_ok then
        fail(("--prompts %s: line %d is not UTF-8 (byte %d of the line is 0x%02X); save the " ..
              "file as UTF-8"):format(flags.prompts, n, at, line:byte(at)))
      end
      if line:find("%S") then
        local ok, j = false, nil
        if line:match("^%s*{") then ok, j = pcall(cjson.decode, line) end
        local object = ok and type(j) == "table" and (j.prompt ~= nil or j.messages ~= nil or
                                                      type(j.prompt_ids) == "table")
        -- (a .jsonl file's lines are objects; elsewhere a line that is not one,
        -- "{" or not, is a prompt as written)
        if not object and line:match("^%s*{") and data.is_jsonl(flags.prompts) then
          fail(("--prompts %s: line %d is not a JSON object with \"prompt\", \"messages\" " ..
                "or \"prompt_ids\""):format(flags.prompts, n))
        end
        if object then
          if j.messages and not flags.chat then
            fail(("--prompts %s: line %d holds messages; add --chat to render them with the " ..
                  "chat template"):format(flags.prompts, n))
          end
          for k, v in ipairs(type(j.prompt_ids) == "table" and j.prompt_ids or {}) do
            if type(v) ~= "number" or v ~= math.floor(v) or v < 0 then
              fail(("--prompts %s: line %d: prompt_ids[%d] is %s, not a token id; give whole " ..
                    "numbers"):format(flags.prompts, n, k - 1, cjson.encode(v)))
            end
          end
          -- (messages as the template reads JSON: key order and {} kept)
          local jok, jj = pcall(require("luazero.jinja.json").decode, line)
          local msgs = j.messages and jok and type(jj) == "table" and jj.messages or j.messages
          list[#list + 1] = { text = j.prompt, messages = msgs,
                              ids = j.prompt_ids and { unpack(j.prompt_ids) } }
        else
          list[#list + 1] = { text = line }
        end
      end
    end
    f:close()
  end
  if #list == 0 then fail("no prompt: give --prompt TEXT, --prompts FILE or --prompt-ids LIST") end
  return list
end

-- Every file the run touches (io/paths.lua): --out must not be an input.
local function touches(flags)
  local p = run_flags.weights_paths(paths.new(), flags)
  p:read("--prompts", flags.prompts)
  p:read("--tokenizer", flags.tokenizer, { whole = flags.tokenizer and is_dir(flags.tokenizer) })
  return p:write("--out", flags.out)
end

local function parse(argv)
  local flags = run_flags.parse(ex, argv, spec,
                                "luazero scripts/generate.lua (--load DIR | --hf DIR) --prompt TEXT [flags]")
  if not flags then return nil end
  -- An empty --stop is found at once: every completion would be cut to nothing.
  if flags.stop == "" then
    fail("--stop '' matches at every position and would cut every completion to nothing: " ..
         "give the text to stop at, or drop --stop")
  end
  checked(function() touches(flags):check() end)
  -- (--out is written after every completion: a path it cannot take fails now)
  if flags.out then require("luazero.run.outputs").check_writable(ex, "--out", flags.out) end
  return flags
end

-- The text side: encode(text) -> ids, decode(ids) -> text, the eos ids,
-- and the chat template (with --chat).
local function text_side(flags, w)
  local side = { eos = {} }
  local dir = w.dir
  -- a tokenizer.json or a Hugging Face folder, as train and eval take it
  local tok_path = flags.tokenizer or (dir and exists(dir .. "/tokenizer.json") and dir)
  local V = w.cfg.vocab
  -- (else the one a checkpoint's data was read with, which its manifest names)
  local trained = not tok_path and w.manifest and type(w.manifest.extra) == "table" and
                  type(w.manifest.extra.data) == "table" and w.manifest.extra.data.tokenizer
  if type(trained) == "string" then
    if not exists(trained) then
      fail(("--load %s was trained on data read with the tokenizer %s, which is not there " ..
            "now; give --tokenizer (that tokenizer.json or its folder)"):format(flags.load, trained))
    end
    tok_path = trained
    io.stderr:write(("generate: text read and written with the tokenizer the checkpoint " ..
                     "trained with (%s)\n"):format(trained))
  end
  if tok_path then
    local tok = inputs.tokenizer(ex, tok_path)
    -- (another tokenizer than the model folder's own must fit its vocabulary)
    if flags.tokenizer then
      inputs.check_tokenizer_vocab(ex, tok, tok_path, V, "the weights in " ..
                                   (flags.hf or flags.load))
    end
    side.tok = tok
    side.encode = function(text) return tok:encode(text) end
    side.decode = function(ids) return run_text.decode(tok, ids) end
    if tok.eos_id then side.eos[tok.eos_id] = true end
    side.bos = tok.bos_id
  elseif V >= 256 then
    if V > 256 and flags.hf then
      io.stderr:write(("generate: %s holds no tokenizer.json: text is read and written as " ..
                       "bytes (ids 0-255), which a model of %d ids trained with a tokenizer " ..
                       "takes for other tokens; give --tokenizer (its tokenizer.json or " ..
                       "folder)\n"):format(flags.hf, V))
    end
    side.encode = function(text)
      local ids = {}
      for i = 1, #text do ids[i] = text:byte(i) end
      return ids
    end
    side.decode = data.decode_bytes
  end
  if dir then
    local c = read_json(dir .. "/config.json") or {}
    id_set(c.eos_token_id, side.eos)
    -- (generation_config.json's, which transformers' generate stops at too:
    -- Llama 3 Instruct's <|eot_id|> is there)
    local gc = read_json(dir .. "/generation_config.json") or {}
    id_set(gc.eos_token_id, side.eos)
    -- (its sampling settings, which transformers' generate() takes by
    -- default: said where this run decodes greedily instead)
    if gc.do_sample == true and flags.temperature == 0 then
      local s = { "--temperature " .. tostring(type(gc.temperature) == "number" and gc.temperature or 1) }
      -- (transformers' top_k is 50 where the file gives none)
      local k = gc.top_k == nil and 50 or gc.top_k
      if type(k) == "number" and k > 0 then s[#s + 1] = "--top-k " .. k end
      if type(gc.top_p) == "number" and gc.top_p < 1 then s[#s + 1] = "--top-p " .. gc.top_p end
      io.stderr:write(("generate: %s/generation_config.json asks for sampling (do_sample true), " ..
                       "as transformers' generate() would run it; this run decodes greedily: add " ..
                       "%s to sample\n"):format(dir, table.concat(s, " ")))
    end
    side.bos = side.bos or (type(c.bos_token_id) == "number" and c.bos_token_id or nil)
    local tc = read_json(dir .. "/tokenizer_config.json") or {}
    -- The special tokens transformers' tokenizer(prompt) adds: a BOS where
    -- tokenizer_config.json says add_bos_token, else what tokenizer.json's
    -- post-processor template puts around one sequence (Llama 3's BOS).
    if type(tc.add_bos_token) == "boolean" then
      side.prefix, side.suffix = (tc.add_bos_token and side.bos) and { side.bos } or {}, {}
    elseif side.tok then
      side.prefix, side.suffix = side.tok.single_prefix, side.tok.single_suffix
    end
  end
  if flags.chat then
    if not dir then
      fail("--chat needs the model's Hugging Face folder (--hf, or a LoRA checkpoint's base) " ..
           "for its tokenizer_config.json")
    end
    local ok, ct = pcall(require, "luazero.chat_template")
    if not ok then
      fail("--chat: this build has no luazero.chat_template; render the prompts yourself and " ..
           "give them as text")
    end
    side.template = checked(ct.load, dir)
    side.chat_vars = flags.chat_kwargs and checked(ct.kwargs, flags.chat_kwargs, "--chat-kwargs")
  end
  return side
end

-- Each prompt's ids (and the text they came from); ids given as such must
-- be below the model's vocabulary V.
local function prompt_ids(list, side, flags, V)
  local out = {}
  for i, p in ipairs(list) do
    if p.ids then
      for _, id in ipairs(p.ids) do
        if id >= V then
          fail(("%s: token id %d is not below the model's vocabulary %d"):format(
               flags.prompt_ids and "--prompt-ids" or ("--prompts %s: prompt %d"):format(
               flags.prompts, i), id, V))
        end
      end
      out[i] = p.ids
    else
      if not side.encode then
        fail("the model's vocabulary is below 256 and no tokenizer.json was given: use " ..
             "--prompt-ids, or --tokenizer FILE")
      end
      local text = p.text
      if flags.chat then
        local messages = p.messages or { { role = "user", content = p.text } }
        -- (the text alone: no assistant spans, which a template may not give)
        text = checked(side.template.render, side.template, messages,
                       { add_generation_prompt = true, vars = side.chat_vars, spans = false })
      end
      out[i] = side.encode(text)
      if not flags.chat and side.prefix then
        local ids = {}
        for _, id in ipairs(side.prefix) do ids[#ids + 1] = id end
        -- (one BOS where the text begins with it already)
        local from = (#side.prefix == 1 and out[i][1] == side.prefix[1]) and 2 or 1
        for k = from, #out[i] do ids[#ids + 1] = out[i][k] end
        for _, id in ipairs(side.suffix) do ids[#ids + 1] = id end
        out[i] = ids
      end
    end
    if #out[i] == 0 then fail(("prompt %d encodes to no tokens"):format(i)) end
  end
  return out
end

local function main(argv)
  local flags = parse(argv)
  if not flags then return end
  local list = read_prompts(flags)
  local w = inputs.weights(ex, flags, { dtype = flags.dtype, seed = flags.seed })
  local side = text_side(flags, w)
  local prompts = prompt_ids(list, side, flags, w.cfg.vocab)
  -- --stop: the completion so far, decoded, holds the text.
  local stop
  if flags.stop then
    if not side.decode then fail("--stop needs a tokenizer (or a byte vocabulary) to read text") end
    stop = function(_, ids) return side.decode(ids):find(flags.stop, 1, true) ~= nil end
  end
  local stats = flags.stats and {} or nil
  local outs = checked(generate.run, w.model, prompts, {
    max_new = flags.max_new_tokens, temperature = flags.temperature, top_k = flags.top_k,
    top_p = flags.top_p, seed = flags.seed, eos = side.eos, stop = stop, batch = flags.batch,
    kv_dtype = flags.kv_dtype == "bf16" and "bf16" or "f32", stats = stats,
  })
  -- --out: whole or not at all, written once every completion is known
  local log = flags.out and {}
  for i, o in ipairs(outs) do
    local text
    if side.decode then
      text = side.decode(o.ids)
      if o.reason == "stop" then text = text:sub(1, text:find(flags.stop, 1, true) - 1) end
    end
    if #outs > 1 then print(("--- %d (%s)"):format(i, o.reason)) end
    print(text or table.concat(o.ids, " "))
    if log then
      -- (JSON holds UTF-8: bytes a byte vocabulary or a cut character left
      -- invalid become U+FFFD there, as the tokenizers library decodes them)
      local valid = text and require("luazero.tokenizer.sentencepiece").lossy_utf8(text)
      log[#log + 1] = cjson.encode({ prompt = list[i].text, messages = list[i].messages,
                                     prompt_ids = prompts[i], ids = o.ids, completion = valid,
                                     finish = o.reason }) .. "\n"
    end
  end
  if log then ex.checked_write(atomic.write, flags.out, table.concat(log)) end
  -- (a completion cut by the model's context, not --max-new-tokens: said,
  -- since the text alone does not show it)
  local cut = {}
  for i, o in ipairs(outs) do if o.reason == "context" then cut[#cut + 1] = tostring(i) end end
  if #cut > 0 then
    io.stderr:write(("generate: %s %s stopped at the model's context of %d tokens, before " ..
                     "--max-new-tokens %d\n"):format(#cut == 1 and "completion" or "completions",
                                                     table.concat(cut, ", "), w.cfg.context,
                                                     flags.max_new_tokens))
  end
  if stats then
    local function rate(n, secs) return secs > 0 and n / secs or 0 end
    io.stderr:write(("generate: prompts %d tokens in %.2f s (%.1f tokens/s); %d new tokens " ..
                     "after them in %.2f s (%.1f tokens/s, rows of up to %d together)\n")
                    :format(stats.prompt_tokens, stats.prompt_s,
                            rate(stats.prompt_tokens, stats.prompt_s), stats.new_tokens,
                            stats.new_s, rate(stats.new_tokens, stats.new_s), flags.batch))
  end
  w.free()
end

main(arg)
