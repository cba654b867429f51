-- support.lua — what the Lua tests share: an expected error, shell quoting,
-- a scratch folder for the files they write, running a command and
-- scripts/train.lua. (Not a test file: run_lua.lua
-- loads only test_*.lua.)
local M = {}

-- fn must raise an error whose text contains needle.
function M.expect_error(fn, needle)
  local ok, err = pcall(fn)
  assert(not ok, "expected an error mentioning: " .. needle)
  assert(tostring(err):find(needle, 1, true),
         ("error %q does not mention %q"):format(tostring(err), needle))
end

function M.quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

-- Writes bytes to path (replacing the file); returns path.
function M.write(path, bytes)
  local f = assert(io.open(path, "wb"))
  f:write(bytes)
  f:close()
  return path
end

-- A fresh folder; returns write(name, bytes) -> path of the written file,
-- and the folder.
function M.scratch()
  local dir = os.tmpname()
  os.remove(dir)
  os.execute("mkdir -p " .. M.quote(dir))
  return function(name, bytes) return M.write(dir .. "/" .. name, bytes) end, dir
end

-- A scratch folder holding corpus.txt, `text` repeated `times` times:
-- write(name, bytes) -> path, the folder, and the corpus's path.
function M.scratch_corpus(text, times)
  local write_file, dir = M.scratch()
  return write_file, dir, write_file("corpus.txt", text:rep(times))
end

-- The ZeRO layout over `world` ranks of a gpt2-nano with the fields of
-- `fields` (models.gpt2.config's), and the model.
function M.gpt2_layout(fields, world)
  local gpt2 = require("models.gpt2")
  local m = gpt2.new(gpt2.config("gpt2-nano", fields))
  return require("luazero.zero.layout").new(m.param_table, world), m
end

-- Two lines the training tests repeat into a corpus.
M.HAMLET = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"

-- A line the MoE tests repeat into a corpus.
M.YORK = "Now is the winter of our discontent, made glorious summer by this sun of York.\n"

-- The tiny GPT-2s the training tests run through scripts/train.lua, seeded,
-- without samples and with one eval batch: 1 layer of width 32 on 8-token
-- sequences, or 2 layers of width 64 on 16-token ones.
M.GPT2_1L = "--model gpt2-nano --n-layer 1 --n-embd 32 --n-head 2 --context 16 --seq-len 8 " ..
            "--sample 0 --eval-batches 1 --seed 7"
M.GPT2_2L = "--model gpt2-nano --n-layer 2 --n-embd 64 --n-head 4 --context 32 --seq-len 16 " ..
            "--sample 0 --eval-batches 1 --seed 7"

-- The records of a metrics log (JSON Lines), in order.
function M.records(path)
  local cjson = require("cjson")
  local recs = {}
  for l in io.lines(path) do recs[#recs + 1] = cjson.decode(l) end
  return recs
end

-- Before a test reads the ledger to measure its own objects: frees what
-- earlier code left for the collector (jit.flush first: compiled traces pin
-- objects that collectgarbage alone does not reclaim), then stops the
-- collector so nothing older is freed between the test's readings.
-- tests/run_lua.lua restarts it after each test.
function M.settle()
  jit.flush()
  collectgarbage()
  collectgarbage()
  collectgarbage("stop")
end

-- A fixed batch for a tiny model's engine: inputs x and targets y [2, 8],
-- token ids below 50; train(e, steps) takes `steps` steps of engine e on
-- it and returns e's params_checksum. Returns train, x, y.
function M.engine_batch()
  local lz = require("luazero")
  local x = lz.tensor({ 2, 8 }, "i32", "activations")
  local y = lz.tensor({ 2, 8 }, "i32", "activations")
  for i = 0, 15 do x:set(i, (i * 7) % 50); y:set(i, (i * 11) % 50) end
  local function train(e, steps)
    for _ = 1, steps do e:backward(e:forward(x, y)); e:step() end
    return e:params_checksum()
  end
  return train, x, y
end

-- For the MoE check scripts: a tiny Mixtral (mixtral.config's mcfg) in an
-- engine at ZeRO stage `stage` over comm (micro-batches of 2 x 16, AdamW at
-- lr 1e-2, buckets of 5000 elements), and a loader of corpus over comm's
-- ranks. opts: accum (gradient_accumulation_steps, 1 by default), moe (the
-- config's moe block), checkpoint_activations. Returns engine, loader.
function M.moe_engine(comm, corpus, mcfg, stage, opts)
  local zero, data = require("luazero.zero"), require("luazero.data")
  local cfg = { train_micro_batch_size_per_gpu = 2, gradient_accumulation_steps = opts.accum or 1,
                zero_optimization = { stage = stage, stage3_param_persistence_threshold = 0,
                                      reduce_bucket_size = 5000,
                                      stage3_prefetch_bucket_size = 5000 },
                moe = opts.moe,
                optimizer = { type = "AdamW", params = { lr = 1e-2 } } }
  local engine = zero.initialize({ model = require("models.mixtral").new(mcfg), config = cfg,
                                   seed = 1, batch = { 2, 16 }, comm = comm,
                                   checkpoint_activations = opts.checkpoint_activations })
  local loader = data.loader(corpus, { B = 2, T = 16, seed = 1, vocab = mcfg.vocab,
                                       rank = comm.rank(), world = comm.size() })
  return engine, loader
end

-- got must equal want; the error names what and both values.
function M.eq(got, want, what)
  assert(got == want, ("%s: %s, expected %s"):format(what, tostring(got), tostring(want)))
end

M.exists = require("luazero.io.fs").exists

-- Runs a shell command; returns its output (stdout and stderr together)
-- and its exit status.
function M.sh(cmd)
  local p = io.popen(cmd .. " 2>&1; echo \"EXIT:$?\"")
  local out = p:read("*a")
  p:close()
  return out:gsub("EXIT:%d+%s*$", ""), tonumber(out:match("EXIT:(%d+)%s*$"))
end

-- train(n, flags [, env]) -> output, status: scripts/train.lua with
-- `model_flags` and `flags` on n ranks; ok_train(...) -> output, the
-- params_checksum, raising when the run fails.
function M.trainer(model_flags)
  local lz = require("luazero")
  local function train(n, flags, env)
    return M.sh(("cd %s && %s %s %s scripts/train.lua %s %s"):format(M.quote(lz.root), env or "",
                M.quote(lz.executable()), n > 1 and ("-n " .. n) or "", model_flags, flags))
  end
  local function ok_train(n, flags, env)
    local out, st = train(n, flags, env)
    assert(st == 0, ("train -n %d %s failed:\n%s"):format(n, flags, out))
    return out, assert(out:match("params_checksum (%x+)"), out)
  end
  return train, ok_train
end

-- Marks the ledger before a test builds an engine (what earlier code left
-- for the collector freed first). Returns states(device) -> host, dev, tier:
-- the model-state bytes (params, grads, optimizer, offload) added since on
-- the host's ledger, those but offload on the device's own ledger (0 on the
-- cpu, whose one memory is all host), and the bytes added per category on
-- the ledger that holds the device's tier (the host's on the cpu).
function M.ledger_mark()
  local lz = require("luazero")
  jit.flush(); collectgarbage(); collectgarbage()
  local before, before_dev = lz.mem(), lz.mem_device()
  return function(device)
    local m, md = lz.mem(), lz.mem_device()
    local host, dev = 0, 0
    for _, cat in ipairs({ "params", "grads", "optimizer", "offload" }) do
      host = host + m[cat] - before[cat]
      if device ~= "cpu" and cat ~= "offload" then dev = dev + md[cat] - before_dev[cat] end
    end
    local now, was = device == "cpu" and m or md, device == "cpu" and before or before_dev
    local tier = {}
    for cat, n in pairs(now) do
      if type(n) == "number" and type(was[cat]) == "number" then tier[cat] = n - was[cat] end
    end
    return host, dev, tier
  end
end

-- For the expert-placement tests: for each case { ep, o, what }, run(ep,
-- stage, o) at stage 0 with the experts under ZeRO over the world (o's
-- copy with placement = "world", moe.placement), the reference, and then
-- stages 0-3 with o, each with the experts in their group (placement
-- "edp") and on the reference's checksum and gradient norms.
-- Returns the first case's reference result and the runs compared.
function M.same_as_stage_0(run, cases)
  local first, runs = nil, 0
  for _, c in ipairs(cases) do
    local ep, o, what = c[1], c[2], c[3]
    local ref = {}
    for k, v in pairs(o) do ref[k] = v end
    ref.placement = "world"
    local s0 = run(ep, 0, ref)
    M.eq(s0.placement, "world", "the reference's placement, " .. what)
    for stage = 0, 3 do
      local r = run(ep, stage, o)
      M.eq(r.placement, "edp", ("stage %d's placement, %s"):format(stage, what))
      M.eq(r.sum, s0.sum, ("checksum at stage %d, %s"):format(stage, what))
      M.eq(r.norms, s0.norms, ("gradient norms at stage %d, %s"):format(stage, what))
      runs = runs + 1
    end
    first = first or s0
  end
  return first, runs
end

-- A tokenizer.json table in Llama 2's layout: <unk> <s> </s>, the 256
-- byte tokens <0x00>..<0xFF>, then 9 pieces (ids 259..267); Llama 2's
-- normalizer and decoder (test_tokenizer.lua's SentencePiece cases).
function M.sentencepiece_tokenizer()
  local cjson = require("cjson")
  local vocab = { ["<unk>"] = 0, ["<s>"] = 1, ["</s>"] = 2 }
  for b = 0, 255 do vocab[("<0x%02X>"):format(b)] = 3 + b end
  for i, t in ipairs({ "▁", "a", "b", "c", "▁a", "ab", "▁ab", "é", "▁▁" }) do vocab[t] = 258 + i end
  local added = {}
  for i, c in ipairs({ "<unk>", "<s>", "</s>" }) do
    added[i] = { id = i - 1, content = c, special = true, normalized = false }
  end
  return {
    added_tokens = added,
    normalizer = { type = "Sequence", normalizers = {
      { type = "Prepend", prepend = "▁" },
      { type = "Replace", pattern = { String = " " }, content = "▁" } } },
    pre_tokenizer = cjson.null,
    decoder = { type = "Sequence", decoders = {
      { type = "Replace", pattern = { String = "▁" }, content = " " },
      { type = "ByteFallback" }, { type = "Fuse" },
      { type = "Strip", content = " ", start = 1, stop = 0 } } },
    model = { type = "BPE", unk_token = "<unk>", fuse_unk = true, byte_fallback = true,
              vocab = vocab, merges = { "▁ a", "a b", "▁ ab", "▁ ▁" } },
  }
end

return M
