-- test_save16.lua — zero_optimization.stage3_gather_16bit_weights_on_model_save:
-- each save also writes STEP/hf16, a bf16 (an fp16 run: fp16) Hugging Face folder byte for byte
-- tools/ckpt export --dtype bf16's, that train.lua --init loads; and
-- zero_hpz_partition_size 1 is accepted silently, other sizes reported.
local cjson = require("cjson")
local lz = require("luazero")
local config = require("luazero.config")
local support = dofile(lz.root .. "/tests/lua/support.lua")

local T = {}
local q = support.quote
local write_file, tmp, corpus = support.scratch_corpus(
  "Do not go gentle into that good night, Old age should burn and rave at close of day; ", 40)
local MODEL = support.GPT2_2L .. " --data " .. q(corpus)
local _, ok_train = support.trainer(MODEL)

local function read(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end

-- A safetensors file as {json = its decoded header, data = the bytes after
-- it}; a JSON file as {json = decoded, data = ""}.
local function split(bytes)
  if bytes:sub(1, 1) == "{" then return { json = cjson.decode(bytes), data = "" } end
  local n = 0
  for i = 8, 1, -1 do n = n * 256 + bytes:byte(i) end
  return { json = cjson.decode(bytes:sub(9, 8 + n)), data = bytes:sub(9 + n) }
end

local function same(a, b)
  if type(a) ~= "table" or type(b) ~= "table" then return a == b end
  for k, v in pairs(a) do if not same(v, b[k]) then return false end end
  for k in pairs(b) do if a[k] == nil then return false end end
  return true
end

function T.save_writes_a_bf16_export_beside_each_checkpoint()
  local cfg = write_file("ds16.json", cjson.encode({
    train_micro_batch_size_per_gpu = 2,
    zero_optimization = { stage = 3, stage3_gather_16bit_weights_on_model_save = true } }))
  local dir = tmp .. "/ck"
  ok_train(2, ("--steps 4 --config %s --save %s --save-every 2"):format(q(cfg), q(dir)))
  for _, step in ipairs({ "step-000002", "step-000004" }) do
    local hf16 = dir .. "/" .. step .. "/hf16"
    assert(support.exists(hf16 .. "/model.safetensors") and support.exists(hf16 .. "/config.json"),
           hf16 .. " is missing")
    local out = tmp .. "/export-" .. step
    local text, st = support.sh(("cd %s && LUAZERO=%s tools/ckpt export %s %s --dtype bf16")
                                :format(q(lz.root), q(lz.executable()), q(dir .. "/" .. step),
                                        q(out)))
    support.eq(st, 0, text)
    -- The same tensors, bytes and header (JSON objects: compared as decoded,
    -- their keys' order is the encoder's).
    for _, f in ipairs({ "model.safetensors", "config.json" }) do
      local a, b = split(read(hf16 .. "/" .. f)), split(read(out .. "/" .. f))
      assert(a.data == b.data and same(a.json, b.json), step .. "/hf16/" .. f ..
             " differs from tools/ckpt export --dtype bf16's")
    end
    local cfg_json = cjson.decode(read(hf16 .. "/config.json"))
    assert(cfg_json.torch_dtype == "bfloat16", tostring(cfg_json.torch_dtype))
  end
  -- It loads: --init from it runs (the weights rounded to bf16 give a finite loss).
  local out = ok_train(1, ("--steps 0 --micro-batch 2 --init %s")
                         :format(q(dir .. "/step-000004/hf16")))
  local val = tonumber(out:match("val_loss (%S+)"))
  assert(val and val > 0 and val < 10, out)
  -- The checkpoint itself still resumes (the folder inside it is no shard).
  ok_train(1, ("--steps 5 --resume %s"):format(q(dir)))
  -- Without the key: no hf16.
  local plain = tmp .. "/plain"
  ok_train(1, ("--steps 1 --save %s"):format(q(plain)))
  assert(not support.exists(plain .. "/step-000001/hf16"), "hf16 written without the key")
end

-- An fp16 run's export is fp16, as DeepSpeed saves its model's dtype: the
-- bytes of tools/ckpt export --dtype fp16, each F16 value the fp32 master
-- rounded to nearest even, config.json's torch_dtype float16; --init loads it.
function T.an_fp16_runs_export_is_fp16()
  local cfg = write_file("ds16f.json", cjson.encode({
    train_micro_batch_size_per_gpu = 2, fp16 = { enabled = true },
    zero_optimization = { stage = 2, stage3_gather_16bit_weights_on_model_save = true } }))
  local dir = tmp .. "/ckf"
  ok_train(1, ("--steps 2 --config %s --save %s"):format(q(cfg), q(dir)))
  local hf16 = dir .. "/step-000002/hf16"
  local out = tmp .. "/export-f16"
  local text, st = support.sh(("cd %s && LUAZERO=%s tools/ckpt export %s %s --dtype fp16")
                              :format(q(lz.root), q(lz.executable()), q(dir .. "/step-000002"),
                                      q(out)))
  support.eq(st, 0, text)
  local a, b = split(read(hf16 .. "/model.safetensors")), split(read(out .. "/model.safetensors"))
  assert(a.data == b.data and same(a.json, b.json), "hf16 differs from --dtype fp16's export")
  for name, e in pairs(a.json) do
    if name ~= "__metadata__" then assert(e.dtype == "F16", name .. " " .. tostring(e.dtype)) end
  end
  -- one tensor against the master, rounded through f16 here
  local ck = require("luazero.checkpoint").open(dir .. "/step-000002")
  local master = ck:tensor("wte.weight")
  local e = a.json["wte.weight"] or a.json["transformer.wte.weight"]
  local n = master:numel()
  local want = lz.tensor({ n }, "f16", "workspace"):copy(master:view(0, { n }))
  assert(a.data:sub(e.data_offsets[1] + 1, e.data_offsets[2]) ==
         require("ffi").string(want.data, want:bytes()), "wte.weight is not the master in f16")
  master:free(); want:free()
  assert(cjson.decode(read(hf16 .. "/config.json")).torch_dtype == "float16")
  local o = ok_train(1, ("--steps 0 --micro-batch 2 --init %s"):format(q(hf16)))
  local val = tonumber(o:match("val_loss (%S+)"))
  assert(val and val > 0 and val < 10, o)
end

function T.hpz_partition_size_one_is_accepted()
  local function unimpl(z)
    local cfg = config.load({ train_batch_size = 2, zero_optimization = z }, 1)
    return table.concat(cfg.unimplemented, ",")
  end
  support.eq(unimpl({ stage = 3, zero_hpz_partition_size = 1 }), "", "hpz 1")
  support.eq(unimpl({ stage = 3, zero_hpz_partition_size = 8 }),
             "zero_optimization.zero_hpz_partition_size", "hpz 8")
  local cfg = config.load({ train_batch_size = 2, zero_optimization = {
    stage3_gather_fp16_weights_on_model_save = true } }, 1)
  assert(cfg.zero_optimization.gather_16bit_weights_on_model_save == true, "the older name")
  assert(#cfg.unimplemented == 0, table.concat(cfg.unimplemented, ","))
  support.expect_error(function() config.load({ train_batch_size = 2, zero_optimization = {
    stage3_gather_16bit_weights_on_model_save = 1 } }, 1) end,
    "config: zero_optimization.stage3_gather_16bit_weights_on_model_save must be true or false")
end

return T
