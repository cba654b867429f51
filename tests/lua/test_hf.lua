-- test_hf.lua — Hugging Face weights in and out (luazero/hf.lua,
-- checkpoint/safetensors.lua, train.lua --init, tools/ckpt export FOLDER):
-- a checkpoint exported in fp32 and loaded back with --init gives its
-- validation loss and params_checksum bit for bit (llama-tiny and GPT-2, and
-- into stage 3 at world 2), sharded folders with an index, BF16/F16 files,
-- a sample decoded with --tokenizer, and one-line refusals that write nothing.
local ffi = require("ffi")
local cjson = require("cjson")
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local safetensors = require("luazero.checkpoint.safetensors")

local T = {}
local q = support.quote
local write_file, tmp = support.scratch()

local eq, exists = support.eq, support.exists

local corpus
local function corpus_path()
  if not corpus then
    local lines = {}
    for i = 1, 300 do lines[i] = ("line %d: it was the best of times, the worst of times."):format(i) end
    corpus = write_file("corpus.txt", table.concat(lines, "\n"))
  end
  return corpus
end

local LLAMA = "--model llama-tiny --vocab 250 --context 64"
local GPT2 = "--model gpt2-nano --n-layer 2 --n-head 4 --n-embd 64 --context 64 --vocab 250"
local RUN = "--seq-len 32 --micro-batch 4 --sample 0 --eval-batches 4 --data "

local train = support.trainer("")

-- A run that must succeed: its output, val_loss (the exact digits) and checksum.
local function ok_run(n, flags)
  local out, st = train(n, flags)
  assert(st == 0, ("train -n %d %s failed:\n%s"):format(n, flags, out))
  return out, out:match("val_loss (%S+)"), assert(out:match("params_checksum (%x+)"), out)
end

local function ckpt(args)
  return support.sh(("cd %s && LUAZERO=%s tools/ckpt %s"):format(q(lz.root), q(lz.executable()),
                                                                 args))
end

-- A checkpoint of `model` trained 3 steps, its fp32 export folder, and the
-- val_loss and checksum of the checkpoint itself (resumed, no step run).
local function trained(name, model)
  local dir, out = tmp .. "/" .. name .. "-ck", tmp .. "/" .. name .. "-hf"
  ok_run(1, ("%s %s%s --steps 3 --save %s"):format(model, RUN, q(corpus_path()), q(dir)))
  local text, st = ckpt(("export %s %s"):format(q(dir), q(out)))
  eq(st, 0, text)
  assert(exists(out .. "/config.json") and exists(out .. "/model.safetensors"), text)
  local _, val, sum = ok_run(1, ("%s %s%s --steps 3 --resume %s"):format(model, RUN,
                                 q(corpus_path()), q(dir)))
  assert(val, "the resumed run printed no val_loss")
  return { dir = dir, out = out, val = val, sum = sum }
end

local cache = {}
local function get(name, model)
  cache[name] = cache[name] or trained(name, model)
  return cache[name]
end

--------------------------------------------------------------- round trip

-- --init of the export, model from its config.json: the checkpoint's
-- validation loss and checksum, to the last bit; stage 3 at world 2 too
-- (against the checkpoint resumed there: the loss of a 2-rank forward).
local function round_trip(name, model)
  local c = get(name, model)
  local out, val, sum = ok_run(1, ("%s%s --steps 0 --init %s"):format(RUN, q(corpus_path()),
                                                                      q(c.out)))
  assert(out:find("initialized from", 1, true), out)
  eq(val, c.val, name .. " --init val_loss (checkpoint's)")
  eq(sum, c.sum, name .. " --init params_checksum")
  local _, val2, sum2 = ok_run(2, ("%s%s --steps 0 --stage 3 --init %s"):format(RUN,
                               q(corpus_path()), q(c.out)))
  local _, rval2, rsum2 = ok_run(2, ("%s %s%s --steps 3 --stage 3 --resume %s"):format(model, RUN,
                                 q(corpus_path()), q(c.dir)))
  eq(sum2, c.sum, name .. " --init at world 2 stage 3: params_checksum")
  eq(val2, rval2, name .. " --init at world 2 stage 3: val_loss (the checkpoint's there)")
  eq(rsum2, c.sum, name .. " resume at world 2 stage 3: params_checksum")
end

-- --steps 0 with --save says nothing is saved; a folder holding only
-- pytorch_model.bin names the conversion to safetensors.
function T.steps_0_save_says_so_and_a_pickle_folder_names_the_conversion()
  local c = get("llama", LLAMA)
  local out = ok_run(1, ("%s%s --steps 0 --init %s --save %s"):format(RUN, q(corpus_path()),
                                                                       q(c.out), q(tmp .. "/s0")))
  assert(out:find("--save " .. tmp .. "/s0: --steps 0 trains nothing, so nothing is saved " ..
                  "there", 1, true), out)
  local bin = tmp .. "/pickled"
  os.execute(("mkdir -p %s && cp %s/config.json %s/ && touch %s/pytorch_model.bin")
             :format(q(bin), q(c.out), q(bin), q(bin)))
  local o, st = train(1, ("%s%s --steps 0 --init %s"):format(RUN, q(corpus_path()), q(bin)))
  assert(st == 2 and o:find("its weights are pytorch_model*.bin (PyTorch pickles), which " ..
                            "luazero does not read; convert them once to safetensors", 1, true), o)
end

function T.llama_export_then_init_is_bitwise() round_trip("llama", LLAMA) end
function T.gpt2_export_then_init_is_bitwise()
  round_trip("gpt2", GPT2)
  -- (a vocabulary of 250 has no <|endoftext|> 50256: bos and eos written null,
  -- not left for transformers' default 50256 past the vocabulary)
  local f = assert(io.open(get("gpt2", GPT2).out .. "/config.json", "rb"))
  local cfg = require("cjson").decode(f:read("*a"))
  f:close()
  assert(cfg.bos_token_id == require("cjson").null and cfg.eos_token_id == require("cjson").null,
         "bos/eos of a 250-token GPT-2 export")
end

-- An export into a folder that held another model's export replaces it and
-- says so; the same model's again says nothing of it.
function T.an_export_over_another_models_says_it_replaced_it()
  local llama, gpt2 = get("llama", LLAMA), get("gpt2", GPT2)
  local out = tmp .. "/shared-out-hf"
  local text, st = ckpt(("export %s %s"):format(q(gpt2.dir), q(out)))
  eq(st, 0, text)
  assert(not text:find("; it replaced", 1, true), text)
  text, st = ckpt(("export %s %s"):format(q(llama.dir), q(out)))
  eq(st, 0, text)
  assert(text:find("config.json; it replaced an export of GPT2LMHeadModel there\n", 1, true), text)
  text, st = ckpt(("export %s %s"):format(q(llama.dir), q(out)))
  assert(st == 0 and not text:find("; it replaced", 1, true), text)
end

-- The export's tensors split in two shards named by an index, given with
-- --model-config instead of the folder's config.json: the same checksum.
function T.sharded_folder_with_index_loads_the_same()
  -- (and beside a model.safetensors, that file is read, as transformers
  -- reads it: below)
  local c = get("llama", LLAMA)
  local src = safetensors.open(c.out .. "/model.safetensors")
  local dir = tmp .. "/sharded"
  os.execute("mkdir -p " .. q(dir))
  local map, halves = {}, { {}, {} }
  for i, n in ipairs(src.names) do table.insert(halves[i % 2 + 1], n) end
  for k, names in ipairs(halves) do
    local file = ("model-%05d-of-00002.safetensors"):format(k)
    local list = {}
    for _, n in ipairs(names) do
      local t = src.tensors[n]
      list[#list + 1] = { name = n, dtype = "F32", shape = t.shape, bytes = t.numel * 4, t = t }
      map[n] = file
    end
    local head = safetensors.header(list, { format = "pt" })
    local f = assert(io.open(dir .. "/" .. file, "wb"))
    f:write(head)
    for _, e in ipairs(list) do
      local buf = ffi.new("float[?]", e.t.numel)
      src:read(e.t, 0, e.t.numel, buf)
      f:write(ffi.string(buf, e.t.numel * 4))
    end
    f:close()
  end
  src:close()
  write_file("sharded/model.safetensors.index.json", cjson.encode({ metadata = {}, weight_map = map }))
  local _, val, sum = ok_run(1, ("%s%s --steps 0 --model-config %s --init %s"):format(RUN,
                             q(corpus_path()), q(c.out .. "/config.json"), q(dir)))
  eq(sum, c.sum, "sharded folder: params_checksum")
  eq(val, c.val, "sharded folder: val_loss")
  local both = tmp .. "/both"
  os.execute(("mkdir -p %s && cp %s %s/"):format(q(both), q(c.out .. "/model.safetensors"), q(both)))
  write_file("both/model.safetensors.index.json",
             cjson.encode({ weight_map = { ["model.embed_tokens.weight"] = "gone.safetensors" } }))
  _, _, sum = ok_run(1, ("%s%s --steps 0 --model-config %s --init %s"):format(RUN,
                     q(corpus_path()), q(c.out .. "/config.json"), q(both)))
  eq(sum, c.sum, "model.safetensors beside an index: params_checksum")
end

-- BF16 and F16 tensors read as fp32: exact values, subnormals and signs.
function T.bf16_and_f16_read_as_fp32()
  local bf = ffi.new("uint16_t[4]", { 0x3f80, 0xc020, 0x0001, 0x7f80 }) -- 1, -2.5, tiny, inf
  local hf16 = ffi.new("uint16_t[4]", { 0x3c00, 0xc100, 0x0001, 0x7bff }) -- 1, -2.5, 2^-24, 65504
  local list = { { name = "a", dtype = "BF16", shape = { 2, 2 }, bytes = 8 },
                 { name = "b", dtype = "F16", shape = { 4 }, bytes = 8 } }
  local head = safetensors.header(list, {})
  local path = write_file("half.safetensors", head .. ffi.string(bf, 8) .. ffi.string(hf16, 8))
  local st = safetensors.open(path)
  local out = ffi.new("float[4]")
  st:read(st.tensors.a, 0, 4, out)
  eq(out[0], 1, "bf16 1"); eq(out[1], -2.5, "bf16 -2.5")
  eq(out[2], 2 ^ -133, "bf16 subnormal"); eq(out[3], math.huge, "bf16 inf")
  st:read(st.tensors.b, 1, 3, out)
  eq(out[0], -2.5, "f16 -2.5"); eq(out[1], 2 ^ -24, "f16 subnormal"); eq(out[2], 65504, "f16 max")
  st:close()
  -- In the interpreter too, NaN payloads kept bit for bit (a NaN read into a
  -- Lua number there can look like another type).
  local nan = ffi.new("uint16_t[2]", { 0xff88, 0x7c01 }) -- a BF16 and an F16 NaN
  path = write_file("nan.safetensors", safetensors.header({
    { name = "a", dtype = "BF16", shape = { 1 }, bytes = 2 },
    { name = "b", dtype = "F16", shape = { 1 }, bytes = 2 } }, {}) .. ffi.string(nan, 4))
  jit.off()
  local ok, err = pcall(function()
    st = safetensors.open(path)
    local bits = ffi.new("uint32_t[2]")
    st:read(st.tensors.a, 0, 1, ffi.cast("float *", bits))
    st:read(st.tensors.b, 0, 1, ffi.cast("float *", bits + 1))
    st:close()
    eq(bits[0], 0xff880000, "bf16 NaN bits")
    eq(bits[1], 0x7f802000, "f16 NaN bits")
  end)
  jit.on()
  if not ok then error(err, 0) end
  -- The format's other dtypes open (GPT-2's causal mask in U8 or BOOL, an
  -- I64 inv_freq: nothing a model reads); reading one is refused.
  path = write_file("mask.safetensors", safetensors.header({
    { name = "w", dtype = "F32", shape = { 1 }, bytes = 4 },
    { name = "h.0.attn.bias", dtype = "BOOL", shape = { 2, 2 }, bytes = 4 },
    { name = "inv_freq", dtype = "I64", shape = { 1 }, bytes = 8 } }, {}) ..
    ffi.string(ffi.new("float[1]", 3), 4) .. "\1\0\1\1" .. ("\0"):rep(8))
  st = safetensors.open(path)
  local one = ffi.new("float[1]")
  st:read(st.tensors.w, 0, 1, one)
  eq(one[0], 3, "the F32 tensor beside them")
  support.expect_error(function() st:read(st.tensors["h.0.attn.bias"], 0, 4, ffi.new("float[4]")) end,
                       'tensor h.0.attn.bias: dtype "BOOL" is not one luazero reads')
  st:close()
end

-- A bf16 export loads with --init: the weights are the fp32 master rounded,
-- so the loss is near the checkpoint's (not equal).
function T.bf16_export_inits_close()
  local c = get("llama", LLAMA)
  local out = tmp .. "/llama-bf16.safetensors"
  local text, st = ckpt(("export %s %s --dtype bf16"):format(q(c.dir), q(out)))
  eq(st, 0, text)
  local _, val, sum = ok_run(1, ("%s %s%s --steps 0 --init %s"):format(LLAMA, RUN, q(corpus_path()),
                                                                       q(out)))
  assert(sum ~= c.sum, "bf16 weights gave the fp32 checksum")
  local rel = math.abs(tonumber(val) - tonumber(c.val)) / tonumber(c.val)
  assert(rel < 1e-2, ("bf16 --init loss %s vs %s (relative %g)"):format(val, c.val, rel))
end

-- Headers that lie about where the data is: the format's rules (offsets
-- from 0, the tensors tiling the data exactly) refuse each, naming the
-- tensor and the rule.
function T.lying_data_offsets_are_refused_naming_the_tensor_and_the_rule()
  local function file(name, h, data_bytes)
    local text = cjson.encode(h)
    text = text .. (" "):rep((8 - #text % 8) % 8)
    return write_file(name, ffi.string(ffi.new("uint64_t[1]", #text), 8) .. text ..
                      ("\0"):rep(data_bytes))
  end
  local function f32(n, a, b) return { dtype = "F32", shape = { n }, data_offsets = { a, b } } end
  local cases = {
    { "negative", { a = f32(64, -256, 0) }, 0,
      { "tensor a", "[-256, 0]", "begin before the data" } },
    { "borrowed", { a = f32(2, 0, 8), b = f32(2, 0, 8) }, 8, { "overlap tensor", "[0, 8]" } },
    { "shifted", { a = f32(2, 0, 8), b = f32(2, 7, 15) }, 15,
      { "tensor b", "[7, 15]", "overlap tensor a's [0, 8]" } },
    { "gap", { a = f32(2, 0, 8), b = f32(2, 16, 24) }, 24,
      { "tensor b", "[16, 24]", "begin 8 bytes after tensor a ends", "no gap" } },
    { "trailing", { a = f32(2, 0, 8) }, 12, { "4 bytes after the last tensor (a)" } },
  }
  for _, c in ipairs(cases) do
    local path = file(c[1] .. ".safetensors", c[2], c[3])
    local ok, err = pcall(safetensors.open, path)
    assert(not ok, c[1] .. ": accepted")
    for _, n in ipairs(c[4]) do
      assert(tostring(err):find(n, 1, true), ("%s: %q does not name %q"):format(c[1], err, n))
    end
    assert(tostring(err):find(path, 1, true), err)
  end
  -- The same tensors laid out right are read.
  local right = { a = f32(2, 0, 8), b = f32(2, 8, 16) }
  local st = safetensors.open(file("right.safetensors", right, 16))
  eq(#st.names, 2, "tensors of a right file")
  st:close()
end

-- Headers the safetensors library refuses, refused here too in one line
-- naming the file (and the tensor, where one is at fault): 64-bit
-- overflow, offsets that are not a pair, metadata that is not strings,
-- a header that is not UTF-8, not an object, or has bytes JSON forbids.
function T.malformed_headers_are_refused_as_the_safetensors_library_does()
  local function file(name, text, data_bytes)
    return write_file(name, ffi.string(ffi.new("uint64_t[1]", #text), 8) .. text ..
                      ("\0"):rep(data_bytes))
  end
  local A = '"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'
  local cases = {
    { "overflow", '{"a":{"dtype":"F32","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}}',
      0, { "tensor a: shape [4294967296,4294967296,0] overflows 64 bits" } },
    { "triple", '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}}', 8,
      { "tensor a: data_offsets [0,8,8] is not [begin, end]" } },
    { "shape-object", '{"a":{"dtype":"F32","shape":{"n":2},"data_offsets":[0,8]}}', 8,
      { "tensor a: shape {\"n\":2} is not a list" } },
    { "metadata", '{"__metadata__":{"step":3},' .. A .. '}', 8,
      { '__metadata__: {"step":3} is not an object of strings' } },
    { "utf8", '{"a\255":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', 8,
      { "header is not UTF-8 text" } },
    { "array", "[]", 0, { "header is not a JSON object (an array)" } },
    { "nul", "{" .. A .. "}\0\0", 8, { "header byte 54 is the control character 0" } },
    { "huge-end", '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,18446744073709551616]}}', 8,
      { "tensor a: data_offsets span 18446744073709551616 bytes, but shape [2] of F32 needs 8" } },
  }
  for _, c in ipairs(cases) do
    local path = file(c[1] .. ".safetensors", c[2], c[3])
    local ok, err = pcall(safetensors.open, path)
    assert(not ok, c[1] .. ": accepted")
    err = tostring(err)
    assert(err:find("safetensors " .. path .. ": ", 1, true) == 1 and not err:find("\n"), err)
    for _, n in ipairs(c[4]) do
      assert(err:find(n, 1, true), ("%s: %q does not name %q"):format(c[1], err, n))
    end
  end
  -- What the library accepts: metadata of strings or null, spaces around
  -- the object, empty tensors anywhere in the order.
  for name, text in pairs({
    meta = '{"__metadata__":{"format":"pt"},' .. A .. '}',
    null = '{"__metadata__":null,' .. A .. '}',
    spaces = " {" .. A .. "}   ",
    empty = '{"z":{"dtype":"F32","shape":[0],"data_offsets":[8,8]},' .. A .. '}',
  }) do
    local st = safetensors.open(file(name .. ".safetensors", text, 8))
    eq(#st.names, name == "empty" and 2 or 1, "tensors of " .. name)
    st:close()
  end
end

--------------------------------------------------------------- LoRA resume

-- A LoRA run on an --init base records its settings and the base (path and
-- checksum): a resume with other settings or another base is refused in
-- one line naming the flag and the saved value; without --init it takes
-- the recorded base and says so; a base that is gone or changed is refused.
function T.lora_resume_checks_its_settings_and_its_base()
  local c = get("llama", LLAMA)
  local base = tmp .. "/lora-base"
  os.execute(("rm -rf %s && cp -r %s %s"):format(q(base), q(c.out), q(base)))
  local ft = tmp .. "/lora-ft"
  local LORA = "--lora-r 2 --lora-alpha 8 --lora-targets q_proj,v_proj"
  local function run(flags) return train(1, ("%s%s %s"):format(RUN, q(corpus_path()), flags)) end
  local out, st = run(("--steps 2 --init %s %s --save %s"):format(q(base), LORA, q(ft)))
  eq(st, 0, out)
  local m = require("luazero.checkpoint").open(ft).manifest
  eq(m.lora.alpha, 8, "the manifest's lora.alpha")
  assert(m.init:find("lora-base", 1, true) and m.init_xxh64:match("^%x+$"), m.init)
  local function refused_resume(flags, needles)
    local o, s2 = run(("--steps 3 --resume %s %s"):format(q(ft), flags))
    eq(s2, 2, "exit status of " .. flags .. ":\n" .. o)
    local _, lines = o:gsub("\n", "")
    eq(lines, 1, "lines of " .. o)
    for _, n in ipairs(needles) do
      assert(o:find(n, 1, true), ("%q does not name %q"):format(o, n))
    end
  end
  local init = "--init " .. q(base) .. " "
  refused_resume(init .. "--lora-r 2 --lora-alpha 32",
                 { "--lora-alpha 32", "saved with --lora-alpha 8" })
  refused_resume(init .. "--lora-r 4 --lora-alpha 8", { "--lora-r 4", "saved with --lora-r 2" })
  refused_resume(init .. "--lora-r 2 --lora-alpha 8 --lora-targets q_proj",
                 { "--lora-targets q_proj", "saved with --lora-targets q_proj,v_proj" })
  refused_resume("", { "trained LoRA adapters", "--lora-r 2 --lora-alpha 8" })
  -- An alpha of more digits than the manifest keeps (14) resumes with itself.
  local e_flags = "--lora-r 2 --lora-alpha 2.718281828459045 --lora-targets q_proj,v_proj"
  out, st = run(("--steps 1 --init %s %s --save %s-e"):format(q(base), e_flags, q(ft)))
  eq(st, 0, out)
  out, st = run(("--steps 2 --init %s %s --resume %s-e"):format(q(base), e_flags, q(ft)))
  eq(st, 0, out)
  -- Without --init (the model from --model-config): the recorded base.
  local _, _, want = ok_run(1, ("%s%s --steps 3 --resume %s %s %s"):format(RUN, q(corpus_path()),
                            q(ft), init, LORA))
  local o2, _, got = ok_run(1, ("%s%s --steps 3 --resume %s --model-config %s %s"):format(RUN,
                            q(corpus_path()), q(ft), q(base .. "/config.json"), LORA))
  assert(o2:find("resume: the base weights from the checkpoint's --init", 1, true), o2)
  eq(got, want, "params_checksum resumed on the recorded base")
  -- The same targets in another order: the same set, resumed as saved.
  local _, _, swapped = ok_run(1, ("%s%s --steps 3 --resume %s %s%s"):format(RUN, q(corpus_path()),
                               q(ft), init, LORA:gsub("q_proj,v_proj", "v_proj,q_proj")))
  eq(swapped, want, "params_checksum resumed with --lora-targets v_proj,q_proj")
  -- Another base: changed weights are refused by their checksum.
  local other = tmp .. "/lora-other"
  os.execute(("rm -rf %s && cp -r %s %s"):format(q(other), q(base), q(other)))
  local f = assert(io.open(other .. "/model.safetensors", "r+b"))
  f:seek("end", -4)
  f:write("\1\2\3\4")
  f:close()
  refused_resume("--init " .. q(other) .. " " .. LORA, { "--init " .. other, "hash", m.init_xxh64 })
  -- The recorded base gone: refused, naming it.
  os.execute("rm -rf " .. q(base))
  refused_resume("--model-config " .. q(other .. "/config.json") .. " " .. LORA,
                 { base, "which is gone", "--init PATH" })
  -- A LoRA run on a drawn base, resumed with --init: refused.
  local drawn = tmp .. "/lora-drawn"
  out, st = run(("%s --steps 2 %s --save %s"):format(LLAMA, LORA, q(drawn)))
  eq(st, 0, out)
  out, st = run(("%s --steps 3 %s --init %s --resume %s"):format(LLAMA, LORA, q(other), q(drawn)))
  eq(st, 2, out)
  assert(out:find("drawn from --seed", 1, true), out)
end

--------------------------------------------------------------- tokenizer

-- GPT-2's bytes-to-unicode table: a tokenizer.json with every byte and a
-- few merges.
local function byte_level_tokenizer()
  local function utf8(cp)
    if cp < 0x80 then return string.char(cp) end
    return string.char(0xC0 + math.floor(cp / 64), 0x80 + cp % 64)
  end
  local vocab, n = {}, 0
  for b = 0, 255 do
    local printable = (b >= 33 and b <= 126) or (b >= 161 and b <= 172) or (b >= 174)
    local cp = b
    if not printable then cp = 256 + n; n = n + 1 end
    vocab[utf8(cp)] = b
  end
  vocab["th"], vocab["the"], vocab["Ġthe"] = 256, 257, 258
  return write_file("tokenizer.json", cjson.encode({
    pre_tokenizer = { type = "ByteLevel", add_prefix_space = false, use_regex = true },
    decoder = { type = "ByteLevel" },
    model = { type = "BPE", vocab = vocab, merges = { "t h", "th e", "Ġ the" } },
  }))
end

-- The corpus as a token file `name` by tools/prepare-data with the
-- byte-level tokenizer (259 tokens): its tokenizer.json and the file.
local function prepared(name)
  local tok_path, bin = byte_level_tokenizer(), tmp .. "/" .. name
  local out, st = support.sh(("cd %s && LUAZERO=%s tools/prepare-data --tokenizer %s %s %s")
                             :format(q(lz.root), q(lz.executable()), q(tok_path),
                                     q(corpus_path()), q(bin)))
  eq(st, 0, out)
  return tok_path, bin
end

-- Data prepared with a tokenizer: the sample is its text with --tokenizer,
-- the ids it decodes without.
function T.sample_is_decoded_with_the_tokenizer()
  local tok_path, bin = prepared("tok.bin")
  local flags = ("--model llama-tiny --vocab 259 --seq-len 32 --micro-batch 4 --steps 1 " ..
                 "--sample 40 --data %s"):format(q(bin))
  local plain = select(1, ok_run(1, flags))
  local ids = {}
  for id in assert(plain:match("sample %(token ids%): ([%d ]+)"), plain):gmatch("%d+") do
    ids[#ids + 1] = tonumber(id)
  end
  eq(#ids, 41, "sampled ids (prompt and 40)")
  local decoded = ok_run(1, flags .. " --tokenizer " .. q(tok_path))
  local want = require("luazero.tokenizer").load(tok_path):decode(ids)
  local text = assert(decoded:match("sample:\n(.*)\nparams_checksum") or
                      decoded:match("sample:\n(.*)$"), decoded)
  eq(text:gsub("\n$", ""), want:gsub("\n$", ""), "decoded sample")
end

-- Weights fix the vocabulary: a tokenizer, or data, past it is refused
-- naming them and the fix (the model's own tokenizer), not a --vocab that
-- the weights' shapes would refuse next; in train, eval and generate alike.
function T.a_tokenizer_past_the_weights_vocabulary_names_the_weights()
  local c = get("llama", LLAMA) -- vocab 250
  local tok_path, bin = prepared("tok-past.bin")
  local want = ("--tokenizer %s: 259 tokens, more than the model's vocab 250 (fixed by the " ..
                "weights in %s); use the tokenizer the model was trained with"):format(tok_path,
                                                                                       c.out)
  local out, st = train(1, ("%s%s --steps 1 --init %s --tokenizer %s"):format(RUN, q(corpus_path()),
                                                                        q(c.out), q(tok_path)))
  assert(st == 2 and out:find("train: " .. want, 1, true), out)
  local past = ("is not below the model's vocabulary 250 (fixed by the weights in %s): the data " ..
                "was made with another tokenizer; prepare it with the model's"):format(c.out)
  out, st = train(1, ("%s%s --steps 1 --init %s"):format(RUN, q(bin), q(c.out)))
  assert(st == 2 and out:find(past, 1, true), out)
  for script, needle in pairs({ ["eval.lua --data " .. q(bin)] = past,
                                ["generate.lua --prompt hello --tokenizer " .. q(tok_path)] = want }) do
    out, st = support.sh(("cd %s && %s scripts/%s --hf %s 2>&1"):format(q(lz.root),
                         q(lz.executable()), script, q(c.out)))
    assert(st == 2 and out:find(needle, 1, true), out)
  end
end

-- Instruction data beside --init's folder, which holds its tokenizer: that
-- tokenizer, without --tokenizer; and eval of a checkpoint trained from the
-- folder finds it the same way (as generate does).
function T.jsonl_data_takes_the_init_folders_tokenizer()
  local c = get("llama259", "--model llama-tiny --vocab 259 --context 64")
  os.execute(("cp %s %s/tokenizer.json"):format(q(byte_level_tokenizer()), q(c.out)))
  local data = write_file("pc.jsonl", ('{"prompt": "the question", "completion": " the answer"}\n')
                                      :rep(40))
  local flags = ("--seq-len 32 --micro-batch 2 --sample 0 --eval-batches 1 --data %s --init %s")
                :format(q(data), q(c.out))
  local ck = tmp .. "/pc-ck"
  local out = ok_run(1, flags .. " --steps 1 --save " .. q(ck))
  assert(out:find(("data: %s tokenised with --init's tokenizer (%s/tokenizer.json)")
                  :format(data, c.out), 1, true), out)
  local with = ok_run(1, flags .. " --steps 1 --tokenizer " .. q(c.out))
  eq(with:match("params_checksum (%x+)"), out:match("params_checksum (%x+)"),
     "the same run as with --tokenizer")
  local ev, st = support.sh(("cd %s && %s scripts/eval.lua --load %s --data %s --seq-len 32")
                            :format(q(lz.root), q(lz.executable()), q(ck), q(data)))
  assert(st == 0 and ev:find("val_loss ", 1, true), ev)
end

--------------------------------------------------------------- refusals

-- One line on stderr naming `needles`, exit status 2, and no --save folder
-- or --log file left.
local function refused(flags, needles)
  local save, log = tmp .. "/never-saved", tmp .. "/never.jsonl"
  os.execute("rm -rf " .. q(save) .. " " .. q(log))
  local out, st = train(1, ("%s%s --steps 1 --save %s --log %s %s"):format(RUN, q(corpus_path()),
                            q(save), q(log), flags))
  eq(st, 2, "exit status of " .. flags .. ":\n" .. out)
  local line = out:match("train: [^\n]*")
  assert(line, out)
  for _, n in ipairs(needles) do
    assert(line:find(n, 1, true), ("%q does not name %q"):format(line, n))
  end
  assert(not exists(save) and not exists(log), "a refused run wrote " .. save .. " or " .. log)
end

-- A copy of the llama export folder with `edit(header, data_bytes)` applied
-- to its header (a table), `cut` bytes cut from its end and `append` added.
local function altered(name, edit, cut, append)
  local c = get("llama", LLAMA)
  local dir = tmp .. "/" .. name
  os.execute(("rm -rf %s && cp -r %s %s"):format(q(dir), q(c.out), q(dir)))
  local path = dir .. "/model.safetensors"
  local f = assert(io.open(path, "rb"))
  local bytes = f:read("*a")
  f:close()
  local b = { bytes:byte(1, 8) }
  local len = 0
  for i = 8, 1, -1 do len = len * 256 + b[i] end
  local header, body = bytes:sub(9, 8 + len), bytes:sub(9 + len)
  if edit then
    local h = cjson.decode(header)
    edit(h, #body)
    header = cjson.encode(h)
    header = header .. (" "):rep((8 - #header % 8) % 8)
  end
  local n = ffi.new("uint64_t[1]", #header)
  if cut then body = body:sub(1, #body - cut) end
  if append then body = body .. append end
  f = assert(io.open(path, "wb"))
  f:write(ffi.string(n, 8), header, body)
  f:close()
  return dir, path
end

-- config.json of folder dir with tie_word_embeddings set to true.
local function tie_config(dir)
  local f = assert(io.open(dir .. "/config.json", "rb"))
  local c = cjson.decode(f:read("*a"))
  f:close()
  c.tie_word_embeddings = true
  f = assert(io.open(dir .. "/config.json", "wb"))
  f:write(cjson.encode(c))
  f:close()
end

-- A tied config whose file holds an lm_head.weight: refused where it differs
-- from the token table (the run would train the table in its place;
-- transformers 5 keeps such a head apart), read where it is the table's copy.
function T.a_tied_config_refuses_a_different_head_and_reads_a_copy()
  local dir, path = altered("tied-different")
  tie_config(dir)
  refused("--init " .. q(dir), { path, "lm_head.weight", "model.embed_tokens.weight",
                                 "tie_word_embeddings" })
  local copy
  copy, path = altered("tied-copy")
  tie_config(copy)
  local f = assert(io.open(path, "rb"))
  local bytes = f:read("*a")
  f:close()
  local b, len = { bytes:byte(1, 8) }, 0
  for i = 8, 1, -1 do len = len * 256 + b[i] end
  local h = cjson.decode(bytes:sub(9, 8 + len))
  local e, l = h["model.embed_tokens.weight"].data_offsets, h["lm_head.weight"].data_offsets
  eq(e[2] - e[1], l[2] - l[1], "the table's and the head's bytes")
  local at = 8 + len
  bytes = bytes:sub(1, at + l[1]) .. bytes:sub(at + e[1] + 1, at + e[2]) .. bytes:sub(at + l[2] + 1)
  f = assert(io.open(path, "wb"))
  f:write(bytes)
  f:close()
  ok_run(1, ("%s%s --steps 1 --init %s"):format(RUN, q(corpus_path()), q(copy)))
end

function T.wrong_shape_is_refused_naming_tensor_and_file()
  local dir, path = altered("bad-shape", function(h)
    local e = h["model.norm.weight"]
    e.shape = { 32, 2 }
  end)
  -- (the config.json beside them describes another model: the fix is in it)
  refused("--init " .. q(dir), { path, "model.norm.weight", "[32, 2]", "[64]",
                                "the config.json beside them does not describe them" })
end

function T.truncated_shard_is_refused_naming_file_and_tensor()
  local dir, path = altered("truncated", nil, 100)
  refused("--init " .. q(dir), { path, "truncated", "lm_head.weight" })
end

function T.missing_and_unknown_tensors_are_refused()
  local dir, path = altered("missing", function(h)
    h["model.norm_renamed.weight"], h["model.norm.weight"] = h["model.norm.weight"], nil
  end)
  refused("--init " .. q(dir), { path, "model.norm.weight", "missing" })
  dir, path = altered("extra", function(h, bytes)
    h["model.layers.9.mlp.up_proj.weight"] = { dtype = "F32", shape = { 4 },
                                               data_offsets = { bytes, bytes + 16 } }
  end, nil, ("\0"):rep(16))
  refused("--init " .. q(dir), { path, "model.layers.9.mlp.up_proj.weight", "not a parameter" })
end

function T.bad_header_json_is_refused()
  local path = write_file("garbled.safetensors", ffi.string(ffi.new("uint64_t[1]", 8), 8) ..
                          "{\"a\": [1" .. ("\0"):rep(16))
  refused("--model llama-tiny --vocab 250 --init " .. q(path), { path, "not a JSON object" })
end

function T.unknown_architecture_in_config_json_is_refused()
  local c = get("llama", LLAMA)
  local dir = tmp .. "/unknown"
  os.execute(("rm -rf %s && cp -r %s %s"):format(q(dir), q(c.out), q(dir)))
  local j = cjson.decode(assert(lz.read_file(dir .. "/config.json")))
  j.architectures = { "NoSuchModelForCausalLM" }
  write_file("unknown/config.json", cjson.encode(j))
  refused("--init " .. q(dir), { dir .. "/config.json", "architectures[0]",
                                 "NoSuchModelForCausalLM" })
end

-- --init of a folder without config.json names the flags that say the
-- model; sizes in a config.json that do not fit are named as the file
-- names them (num_attention_heads, not n_head).
function T.config_json_missing_or_wrong_is_refused_in_the_files_names()
  local c = get("llama", LLAMA)
  local dir = tmp .. "/no-config"
  os.execute(("rm -rf %s && cp -r %s %s && rm %s"):format(q(dir), q(c.out), q(dir),
                                                          q(dir .. "/config.json")))
  refused("--init " .. q(dir), { dir, "no config.json", "--model NAME", "--model-config" })
  local j0 = cjson.decode(assert(lz.read_file(c.out .. "/config.json")))
  local heads = j0.num_attention_heads
  local cases = {
    { function(j) j.num_key_value_heads = heads - 1 end,
      ("num_attention_heads %d is not a multiple of num_key_value_heads %d")
        :format(heads, heads - 1) },
    { function(j) j.head_dim = nil; j.hidden_size = heads * 16 + 1 end,
      ("hidden_size %d is not a multiple of num_attention_heads %d")
        :format(heads * 16 + 1, heads) },
    { function(j) j.num_hidden_layers = 0 end, "num_hidden_layers" },
  }
  for i, case in ipairs(cases) do
    local j = cjson.decode(assert(lz.read_file(c.out .. "/config.json")))
    case[1](j)
    local path = write_file(("config-%d.json"):format(i), cjson.encode(j))
    local out = train(1, ("%s%s --steps 1 --model-config %s"):format(RUN, q(corpus_path()),
                                                                      q(path)))
    local line = assert(out:match("train: [^\n]*"), out)
    assert(line:find(path, 1, true) and line:find(case[2], 1, true), line .. " vs " .. case[2])
    for _, ours in ipairs({ "n_head", "n_kv_head", "n_embd", "n_layer" }) do
      assert(not line:find("%f[%w_]" .. ours .. "%f[^%w_]"), line .. " names " .. ours)
    end
  end
end

function T.a_tokenizer_that_is_not_bpe_is_refused_by_prepare_data()
  local path = write_file("wordpiece.json", cjson.encode({
    model = { type = "WordPiece", vocab = { a = 0 } } }))
  local bin = tmp .. "/never.bin"
  local out, st = support.sh(("cd %s && LUAZERO=%s tools/prepare-data --tokenizer %s %s %s")
                             :format(q(lz.root), q(lz.executable()), q(path), q(corpus_path()),
                                     q(bin)))
  eq(st, 2, out)
  local _, lines = out:gsub("\n", "")
  eq(lines, 1, "lines of " .. out)
  assert(out:find(path, 1, true) and out:find('model.type is "WordPiece"', 1, true), out)
  assert(not exists(bin), "prepare-data left " .. bin)
  -- train.lua --tokenizer refuses it the same way, before the run starts.
  refused("--model llama-tiny --vocab 250 --tokenizer " .. q(path), { path, "WordPiece" })
end

-- Weights that are NaN from the start: a run of no steps (--steps 0) exits
-- 2, as a diverged one does, and so does a run whose first loss is NaN;
-- neither blames the learning rate.
function T.non_finite_loaded_weights_exit_2_naming_the_weights()
  local dir, path = altered("nan-weights")
  local bytes = lz.read_file(path)
  local b = { bytes:byte(1, 8) }
  local len = 0
  for i = 8, 1, -1 do len = len * 256 + b[i] end
  local f = assert(io.open(path, "wb"))
  f:write(bytes:sub(1, 8 + len), ("\0\0\192\127"):rep((#bytes - 8 - len) / 4)) -- f32 NaN
  f:close()
  for _, steps in ipairs({ 0, 2 }) do
    local out, st = train(1, ("%s%s --steps %d --init %s"):format(RUN, q(corpus_path()), steps,
                                                                  q(dir)))
    eq(st, 2, "exit status of --steps " .. steps .. ":\n" .. out)
    local line = assert(out:match("train: [^\n]*"), out)
    assert(line:find("the weights loaded from --init " .. dir .. " give a non-finite loss", 1, true)
           and not line:find("lower --lr", 1, true), line)
    assert(not out:find("val_loss", 1, true), out)
  end
end

return T
