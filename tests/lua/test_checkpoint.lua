-- test_checkpoint.lua — checkpoints end to end through scripts/train.lua
-- under the launcher: exact resume at stages 0-3, resharding (world 4 stage
-- 3 to world 2 stage 1 and world 1 stage 0), an interrupted save, refusals
-- (damaged shard, other model, garbled manifest, a stage-0 shard missing or
-- one too many for the writers recorded), pruning, the reading API
-- and consolidate; in process: the working copy is round(master) bitwise.
local ffi = require("ffi")
local bit = require("bit")
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local checkpoint = require("luazero.checkpoint")

local T = {}
local root, q, eq = lz.root, support.quote, support.eq
local write_file, tmp, corpus = support.scratch_corpus(support.HAMLET, 40)
local MODEL = support.GPT2_2L .. " --micro-batch 2 --data " .. q(corpus)

local sh = support.sh
local train, ok_train = support.trainer(MODEL)

local function fails(n, flags, ...)
  local out, st = train(n, flags)
  assert(st ~= 0, "expected a failure:\n" .. out)
  for _, needle in ipairs({ ... }) do
    assert(out:find(needle, 1, true), ("error does not mention %q:\n%s"):format(needle, out))
  end
  return out
end

function T.resume_is_bitwise_at_stages_0_to_3_world_2()
  for stage = 0, 3 do
    local dtype = stage % 2 == 0 and "bf16" or "fp32"
    local dir = ("%s/resume%d"):format(tmp, stage)
    -- 20 steps straight (saving at 10 and 20), then the run that stopped
    -- at 10 resumed from its checkpoint for the last 10.
    local flags = ("--steps 20 --stage %d --dtype %s"):format(stage, dtype)
    local _, straight = ok_train(2, flags .. " --save " .. q(dir) .. " --save-every 10")
    local _, resumed = ok_train(2, flags .. " --resume " .. q(dir .. "/step-000010"))
    assert(straight == resumed, ("stage %d %s: %s straight, %s resumed"):format(stage, dtype,
           straight, resumed))
  end
end

-- The offload tiers: states on NVMe (and the stage-3 parameter shard) are
-- saved, loaded and resumed exactly; a checkpoint saved with offload loads
-- without it and the reverse.
function T.resume_is_bitwise_with_states_on_nvme()
  local nvme = tmp .. "/nvme"
  os.execute("mkdir -p " .. q(nvme))
  local cjson = require("cjson")
  local function cfg(name, stage, opt, param)
    return write_file(name, cjson.encode({
      train_micro_batch_size_per_gpu = 2, bf16 = { enabled = true },
      zero_optimization = { stage = stage, sub_group_size = 4096,
                            stage3_param_persistence_threshold = 128,
                            offload_optimizer = opt, offload_param = param } }))
  end
  local dev = { device = "nvme", nvme_path = nvme, pipeline_read = true, pipeline_write = true }
  local cases = {
    { "stage 2, optimizer on nvme", cfg("o2.json", 2, dev), cfg("p2.json", 2) },
    { "stage 3, optimizer and params on nvme", cfg("o3.json", 3, dev, dev), cfg("p3.json", 3) },
  }
  for _, c in ipairs(cases) do
    local dir = tmp .. "/offload-" .. c[2]:match("(%w+)%.json$")
    local flags = "--steps 8 --config " .. q(c[2])
    local _, straight = ok_train(2, flags .. " --save " .. q(dir) .. " --save-every 4")
    local _, resumed = ok_train(2, flags .. " --resume " .. q(dir .. "/step-000004"))
    assert(straight == resumed, ("%s: %s straight, %s resumed"):format(c[1], straight, resumed))
    -- Saved with offload, resumed without: the same run.
    local _, plain = ok_train(2, "--steps 8 --config " .. q(c[3]) .. " --resume " ..
                              q(dir .. "/step-000004"))
    assert(plain == straight, ("%s: resumed without offload %s, %s"):format(c[1], plain, straight))
  end
end

function T.reshards_world_4_stage_3_to_world_2_stage_1_and_world_1_stage_0()
  local dir = tmp .. "/reshard"
  local _, saved = ok_train(4, "--steps 4 --stage 3 --dtype bf16 --save " .. q(dir))
  -- The consolidated master is the saved run's checksum.
  local bin = tmp .. "/master.bin"
  local ck = checkpoint.open(dir)
  ck:consolidate(bin)
  local f = assert(io.open(bin, "rb"))
  local body = f:read("*a"):sub(1025)
  f:close()
  assert(bit.tohex(lz.xxh64(body, #body, 0), 16) == saved, "consolidated master differs")
  assert(ck:summary().shards == 4 and ck:summary().stage == 3)
  -- The reading API: one tensor whole agrees with the consolidated bytes.
  local e = ck.manifest.params[5]
  local t = ck:tensor(e.name)
  assert(ffi.string(t.data, t:bytes()) == body:sub(e.offset * 4 + 1, (e.offset + e.numel) * 4))
  t:free()
  -- the end of a name after a dot serves where it is one tensor's; else refused
  local short = e.name:match("^transformer%.(.+)$") or e.name:match("%.(.-%..-)$")
  local t2 = ck:tensor(short)
  assert(ffi.string(t2.data, t2:bytes()) == body:sub(e.offset * 4 + 1, (e.offset + e.numel) * 4),
         short)
  t2:free()
  support.expect_error(function() ck:tensor("weight") end, "tensors' names (")
  support.expect_error(function() ck:tensor() end, "tensor: give a tensor's name, e.g.")
  support.expect_error(function() ck:tensor("nope") end,
                       "has no tensor \"nope\" (the checkpoint's :norms() lists them, e.g.")
  assert(#ck:norms() == #ck.manifest.params and ck:norms()[1].norm > 0)
  for _, ws in ipairs({ { 2, 1 }, { 1, 0 } }) do
    -- --steps 4: nothing to run; the checksum is the loaded master's.
    local _, loaded = ok_train(ws[1], ("--steps 4 --stage %d --dtype bf16 --resume %s")
                               :format(ws[2], q(dir)))
    assert(loaded == saved, ("world %d stage %d loaded %s, saved %s"):format(ws[1], ws[2],
           loaded, saved))
    local out = ok_train(ws[1], ("--steps 6 --stage %d --resume %s"):format(ws[2], q(dir)))
    local loss = tonumber(out:match("step +6/6 | loss ([%d%.]+)"))
    assert(loss and loss < 10, "training did not continue:\n" .. out)
  end
end

function T.interrupted_save_keeps_the_previous_checkpoint()
  local dir = tmp .. "/killed"
  ok_train(2, "--steps 2 --stage 2 --save " .. q(dir))
  local out, st = train(2, "--steps 4 --stage 2 --save " .. q(dir) .. " --resume " .. q(dir),
                        "LZ_CKPT_KILL_AFTER_BYTES=1000")
  assert(st ~= 0, "the save was not interrupted:\n" .. out)
  local latest = assert(io.open(dir .. "/latest")):read("*a")
  assert(latest == "step-000002\n", "latest moved to " .. latest)
  assert(not io.open(dir .. "/step-000004/manifest.json"), "a half-written step-000004 exists")
  local _, a = ok_train(2, "--steps 4 --stage 2 --resume " .. q(dir))
  local _, b = ok_train(2, "--steps 4 --stage 0 --resume " .. q(dir .. "/step-000002"))
  assert(a == b, a .. " vs " .. b)
end

function T.refuses_damaged_shards_other_models_and_garbled_manifests()
  local dir = tmp .. "/refuse"
  ok_train(2, "--steps 2 --stage 1 --save " .. q(dir) .. " --keep 1")
  local step = dir .. "/step-000002"
  local shard = step .. "/shard-00001-of-00002.zst"
  local m = checkpoint.read_manifest(step)
  local expect = m.shards[2].xxh64_compressed
  local f = assert(io.open(shard, "rb"))
  local good = f:read("*a")
  f:close()
  local function put(path, bytes) local g = assert(io.open(path, "wb")); g:write(bytes); g:close() end
  -- A flipped byte, then a truncated file: both name the file and checksum.
  local mid = math.floor(#good / 2)
  put(shard, good:sub(1, mid) .. string.char(bit.bxor(good:byte(mid + 1), 1)) .. good:sub(mid + 2))
  fails(2, "--steps 3 --resume " .. q(dir), "shard-00001-of-00002.zst", expect, "xxh64")
  put(shard, good:sub(1, #good - 7))
  fails(1, "--steps 3 --resume " .. q(dir), "shard-00001-of-00002.zst", expect)
  put(shard, good)
  -- Another model: the first tensor that differs, by name and shape.
  local other = MODEL:gsub("--n%-embd 64", "--n-embd 32")
  local out, st = sh(("cd %s && %s scripts/train.lua %s --steps 3 --resume %s"):format(q(root),
                     q(lz.executable()), other, q(dir)))
  assert(st ~= 0 and out:find("transformer.wte.weight [256, 64]", 1, true) and
         out:find("[256, 32]", 1, true), out)
  -- A garbled manifest: names the file and the field.
  local mf = step .. "/manifest.json"
  local text = assert(io.open(mf)):read("*a")
  put(mf, text:gsub('"stage":1', '"stage":7'))
  fails(1, "--steps 3 --resume " .. q(dir), "manifest.json", "stage")
  put(mf, text:sub(1, 100))
  fails(1, "--steps 3 --resume " .. q(dir), "manifest.json", "not valid JSON")
  os.remove(mf)
  fails(1, "--steps 3 --resume " .. q(step), "neither manifest.json nor latest")
  put(mf, text)
  ok_train(1, "--steps 3 --resume " .. q(dir))
end

-- Messages about the folder given: one that does not exist says so; a
-- `latest` holding a path is quoted on one line; a damaged shard read by
-- export or the REPL's ckpt(dir, "norms") is named without a Lua position.
function T.resume_and_reading_messages_are_one_line_without_lua_positions()
  local out = fails(1, "--steps 3 --resume " .. q(tmp .. "/no-such-run"),
                    "no-such-run: no such folder")
  assert(not out:find("neither manifest.json nor latest", 1, true), out)
  local dir = tmp .. "/bad-latest"
  os.execute("mkdir -p " .. q(dir))
  write_file("bad-latest/latest", "../x\n")
  out = fails(1, "--steps 3 --resume " .. q(dir), [[holds "../x\n", not a step folder name]])
  local _, lines = out:gsub("\n", "")
  assert(lines == 1, out)
  -- a folder holding only a save that was cut short says so
  os.execute("mkdir -p " .. q(tmp .. "/cut/.step-000002.tmp-4242"))
  fails(1, "--steps 3 --resume " .. q(tmp .. "/cut"), "cut: holds no complete checkpoint, only " ..
        ".step-000002.tmp-4242, a save that was interrupted before it finished")
  local damaged = tmp .. "/damaged"
  ok_train(1, "--steps 2 --save " .. q(damaged))
  local shard = damaged .. "/step-000002/shard-00000-of-00001.zst"
  local f = assert(io.open(shard, "r+b"))
  local size = f:seek("end")
  f:seek("set", math.floor(size / 2))
  local b = f:read(1)
  f:seek("set", math.floor(size / 2))
  f:write(string.char(bit.bxor(b:byte(), 0xff)))
  f:close()
  -- (flags before CKPT OUT too; an unknown command is named)
  local text, st = sh(("cd %s && LUAZERO=%s tools/ckpt frobnicate %s"):format(q(root),
                      q(lz.executable()), q(damaged)))
  assert(st == 2 and text == "ckpt: unknown command 'frobnicate' (inspect, consolidate, export, " ..
         "convert-states; --help)\n", text)
  text, st = sh(("cd %s && LUAZERO=%s tools/ckpt export --dtype bf16 %s %s"):format(q(root),
                q(lz.executable()), q(damaged), q(tmp .. "/damaged-hf")))
  assert(st ~= 0 and text:find("shard-00000-of-00001.zst", 1, true), text)
  assert(not text:find("%.lua:%d+:"), text)
  assert(not io.open(tmp .. "/damaged-hf"), "the failed export left a folder")
  local ok, err = pcall(require("luazero.ui.inspect").ckpt, damaged, "norms")
  assert(not ok and tostring(err):find("shard-00000-of-00001.zst", 1, true), tostring(err))
  assert(not tostring(err):find("%.lua:%d+:"), err)
  -- resumed, its damage is the input's (exit 2: a restart would read the same bytes)
  local out2, st2 = train(1, "--steps 3 --resume " .. q(damaged))
  assert(st2 == 2 and out2:find("the shard is damaged", 1, true), out2)
end

function T.keep_prunes_old_step_folders_after_latest_moved()
  local dir = tmp .. "/keep"
  ok_train(1, "--steps 6 --save " .. q(dir) .. " --save-every 2 --keep 2")
  local p = io.popen("ls -a " .. q(dir))
  local names = p:read("*a")
  p:close()
  local function has(s) return names:find(s, 1, true) ~= nil end
  assert(has("step-000004") and has("step-000006"), names)
  assert(not has("step-000002") and not has("tmp"), names)
  assert(assert(io.open(dir .. "/latest")):read("*a") == "step-000006\n")
end

-- In process: after bf16 steps, every stage's working copy is exactly the
-- rounding of its fp32 master, which is why checkpoints do not store it.
function T.working_copy_is_round_of_master_bitwise()
  local gpt2 = require("models.gpt2")
  local data = require("luazero.data")
  local comm = require("luazero.comm").init("local")
  for _, stage in ipairs({ 0, 3 }) do
    local cfg = gpt2.config("gpt2-nano", { n_layer = 1, n_embd = 32, n_head = 2, context = 16 })
    local engine = require("luazero.zero").initialize({
      model = gpt2.new(cfg), seed = 3, batch = { 2, 16 }, comm = comm,
      config = { train_micro_batch_size_per_gpu = 2, gradient_accumulation_steps = 1,
                 bf16 = { enabled = true }, zero_optimization = { stage = stage } } })
    local corpus_data = data.load(corpus)
    local loader = data.loader(corpus_data, { B = 2, T = 16, seed = 1, vocab = cfg.vocab })
    for _ = 1, 3 do engine:train_batch(loader) end
    local w = engine.work
    engine:visit_states(false, function(off, master)
      local r = lz.tensor({ master:numel() }, "bf16", "workspace"):copy(master)
      local got = w:view(off, { master:numel() })
      assert(ffi.string(r.data, r:bytes()) == ffi.string(got.data, got:bytes()),
             "stage " .. stage .. ": working copy is not round(master)")
      r:free()
    end)
    engine:free()
    loader:free()
    corpus_data.tokens:free()
  end
end

-- The fields the loader and the export rely on: a manifest without `model`
-- or `lr_schedule`, an n_embd its embedding's shape contradicts, a dtype no
-- run trains in, a learning rate that is not a number: each refused in one
-- line naming the field (the checksum rewritten, so only the field is wrong).
function T.manifest_fields_are_checked_by_name()
  local manifest = require("luazero.checkpoint.manifest")
  local dir = tmp .. "/fields"
  ok_train(1, "--steps 1 --save " .. q(dir))
  local text = assert(lz.read_file(dir .. "/step-000001/manifest.json"))
  local function refused(edit, needle)
    local m = manifest.json.decode(text)
    edit(m)
    local ok, err = pcall(manifest.decode, manifest.encode(m), "x/manifest.json")
    assert(not ok and err:find("checkpoint: x/manifest.json: " .. needle, 1, true),
           tostring(err) .. " does not name " .. needle)
  end
  refused(function(m) m.model = nil end, "model: expected an object")
  refused(function(m) m.model.config = nil end, "model.config: expected an object")
  refused(function(m) m.model.config.n_embd = 32 end,
          "model.config.n_embd: 32, but params[1] (transformer.wte.weight) has shape [256, 64]")
  refused(function(m) m.dtype = "fp8" end, 'dtype: "fp8" is not a training dtype')
  refused(function(m) m.lr_schedule = nil end, "lr_schedule: expected an object")
  refused(function(m) m.lr_schedule.lr = "nan" end, 'lr_schedule.lr: expected a finite number >= 0 (got "nan")')
  refused(function(m) m.lr_schedule.lr = nil end, "lr_schedule.lr: expected a finite number")
  refused(function(m) m.lr_schedule.base_lr = -1 end, "lr_schedule.base_lr: expected a finite")
  assert(manifest.decode(manifest.encode(manifest.json.decode(text)), "x").dtype == "fp32")
end

-- The manifest records how many ranks wrote shards (writers) and the
-- loader holds the shards to it: at stage 0 one rank writes (or every rank,
-- where the experts lived in their groups), so a shard missing from the
-- list or one too many is refused by file name; a manifest from before the
-- field keeps the rule its shard count implies.
function T.stage_0_shards_are_held_to_the_writers_recorded()
  local manifest = require("luazero.checkpoint.manifest")
  local function saved(stage)
    local dir = ("%s/writers-%d"):format(tmp, stage)
    ok_train(2, ("--steps 1 --stage %d --save %s"):format(stage, q(dir)))
    return assert(lz.read_file(dir .. "/step-000001/manifest.json"))
  end
  local replicated, sharded = saved(0), saved(1)
  local function check(text, edit)
    local m = manifest.json.decode(text)
    edit(m)
    return pcall(manifest.decode, manifest.encode(m), "x/manifest.json")
  end
  local function refused(text, edit, needle)
    local ok, err = check(text, edit)
    assert(not ok and err:find("checkpoint: x/manifest.json: " .. needle, 1, true),
           tostring(err) .. " does not name " .. needle)
  end
  local m0, m1 = manifest.json.decode(replicated), manifest.json.decode(sharded)
  eq(m0.writers, 1, "stage 0, world 2: writers")
  eq(#m0.shards, 1, "stage 0, world 2: shards")
  eq(m1.writers, 2, "stage 1, world 2: writers")
  -- stage 0 written by both ranks (as with the experts in their groups),
  -- the second shard dropped from the list
  refused(sharded, function(m) m.stage, m.shards[2] = 0, nil end,
          "shards: shard-00001-of-00002.zst is missing: 1 listed, expected 2 for writers 2 " ..
          "(world size 2, stage 0)")
  -- stage 0 written by one rank, a second shard listed
  refused(replicated, function(m)
    m.shards[2] = manifest.json.decode(manifest.json.encode(m.shards[1]))
    m.shards[2].file = "shard-00001-of-00002.zst"
  end, 'shards[2]: "shard-00001-of-00002.zst" is one too many: 2 listed, expected 1 for ' ..
       "writers 1 (world size 2, stage 0)")
  refused(sharded, function(m) m.writers = 1 end,
          "writers: 1 at stage 1, world size 2 (expected 2)")
  refused(replicated, function(m) m.writers = 3 end, "writers: expected a whole number in 1..2")
  -- a manifest from before writers: the rule the shard count implies
  assert(check(replicated, function(m) m.writers = nil end), "stage 0 without writers, 1 shard")
  assert(check(sharded, function(m) m.stage, m.writers = 0, nil end),
         "stage 0 without writers, a shard a rank")
end

return T
