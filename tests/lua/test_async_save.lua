-- test_async_save.lua — saves written in the background (--async-save):
-- the files are a synchronous save's, byte for byte, and the run ends the
-- same; a process killed at any byte of a background save leaves the
-- previous checkpoint as `latest`, and resuming from it ends as the run
-- never stopped; time-based saves happen at the same step on every rank;
-- a writer thread's failure comes back to the caller.
local ffi = require("ffi")
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local checkpoint = require("luazero.checkpoint")

local T = {}
local q = support.quote
local write_file, tmp = support.scratch()
local corpus = write_file("corpus.txt", ("A seed corpus line of text for a tiny model.\n"):rep(50))
local MODEL = "--model gpt2-nano --n-layer 1 --n-embd 16 --n-head 2 --context 8 --vocab 128 " ..
              "--seq-len 8 --micro-batch 2 --sample 0 --eval-batches 1 --data " .. q(corpus)
local train, ok_train = support.trainer(MODEL)

local function read(path)
  local f = assert(io.open(path, "rb"), path)
  local s = f:read("*a")
  f:close()
  return s
end

local function steps_in(dir)
  local t = {}
  local p = io.popen("ls " .. q(dir))
  for name in p:lines() do
    local s = name:match("^step%-(%d+)$")
    if s then t[#t + 1] = tonumber(s) end
  end
  p:close()
  table.sort(t)
  return t
end

-- nil when a and b hold the same values; else the path where they differ.
local function same(a, b, path)
  if type(a) ~= "table" or type(b) ~= "table" then return a ~= b and path or nil end
  for k, v in pairs(a) do
    local d = same(v, b[k], path .. "." .. tostring(k))
    if d then return d end
  end
  for k in pairs(b) do if a[k] == nil then return path .. "." .. tostring(k) end end
end

-- Every step folder of a and b: the same manifest (but its date) and the
-- same shard bytes.
local function same_checkpoints(a, b, what)
  local sa, sb = steps_in(a), steps_in(b)
  assert(#sa > 0 and table.concat(sa, ",") == table.concat(sb, ","),
         ("%s: step folders %s and %s"):format(what, table.concat(sa, ","), table.concat(sb, ",")))
  for _, s in ipairs(sa) do
    local name = checkpoint.step_name(s)
    local ma = checkpoint.read_manifest(a .. "/" .. name)
    local mb = checkpoint.read_manifest(b .. "/" .. name)
    ma.created, mb.created, ma.manifest_xxh64, mb.manifest_xxh64 = nil, nil, nil, nil
    ma.job, mb.job = nil, nil -- (the launcher job that wrote each)
    if type(ma.config) == "table" and type(mb.config) == "table" then -- the writer's own key
      ma.config.source, mb.config.source, ma.config.checkpoint, mb.config.checkpoint = nil, nil, nil, nil
      local ra, rb = ma.config.raw, mb.config.raw
      if type(ra) == "table" and type(rb) == "table" then ra.checkpoint, rb.checkpoint = nil, nil end
    end
    local where = same(ma, mb, "")
    assert(not where, ("%s: %s/manifest.json differs at %s"):format(what, name, tostring(where)))
    for _, sh in ipairs(ma.shards) do
      assert(read(a .. "/" .. name .. "/" .. sh.file) == read(b .. "/" .. name .. "/" .. sh.file),
             ("%s: %s/%s differs"):format(what, name, sh.file))
    end
  end
end

function T.async_saves_write_the_bytes_of_sync_saves()
  -- One rank asks through ds_config's checkpoint.writer.decoupled, two through the flag.
  local function writer(decoupled)
    return " --config " .. q(write_file(("decoupled-%s.json"):format(decoupled),
      ('{"checkpoint": {"writer": {"decoupled": %s}}}'):format(decoupled)))
  end
  for _, c in ipairs({ { 1, "--stage 0", writer(true), writer(false) },
                       { 2, "--stage 2 --dtype bf16", " --async-save", "" } }) do
    local flags = ("--steps 8 --save-every 2 %s --save "):format(c[2])
    local a, b = ("%s/sync%d"):format(tmp, c[1]), ("%s/async%d"):format(tmp, c[1])
    local _, sum_sync = ok_train(c[1], flags .. q(a) .. c[4])
    local out, sum_async = ok_train(c[1], flags .. q(b) .. c[3])
    support.eq(sum_async, sum_sync, ("world %d: the end checksum"):format(c[1]))
    assert(out:find("saved " .. b .. "/step-000002 in the background", 1, true), out)
    same_checkpoints(a, b, ("world %d"):format(c[1]))
  end
end

-- 20 runs killed at a random byte of a background save (the hook counts
-- the process's compressed shard bytes across saves, in the writer thread).
function T.a_kill_during_an_async_save_keeps_the_previous_checkpoint()
  local flags = "--steps 8 --save-every 2"
  local _, reference = ok_train(1, "--steps 8") -- saves change no number
  local full = tmp .. "/full"
  ok_train(1, flags .. " --async-save --save " .. q(full))
  -- The compressed bytes written by the end of each save.
  local ends, total = {}, 0
  for _, s in ipairs(steps_in(full)) do
    total = total + checkpoint.read_manifest(full .. "/" .. checkpoint.step_name(s))
                                .shards[1].compressed_bytes
    ends[#ends + 1] = { step = s, bytes = total }
  end
  assert(#ends == 4, "expected 4 saves")
  local rng = require("luazero.rng").new(11)
  for i = 1, 20 do
    -- past the first save: there is a previous checkpoint to keep
    local k = ends[1].bytes + 1 + rng:int(total - ends[1].bytes)
    local prev
    for j = 2, #ends do
      if k <= ends[j].bytes then prev = ends[j - 1].step; break end
    end
    local dir = ("%s/killed%d"):format(tmp, i)
    local out, st = train(1, flags .. " --async-save --save " .. q(dir),
                          "LZ_CKPT_KILL_AFTER_BYTES=" .. k)
    assert(st ~= 0, ("kill at byte %d: the run was not killed:\n%s"):format(k, out))
    local latest = read(dir .. "/latest")
    support.eq(latest, checkpoint.step_name(prev) .. "\n", ("kill at byte %d: latest"):format(k))
    for _, s in ipairs(steps_in(dir)) do
      assert(s <= prev, ("kill at byte %d: %s is in place"):format(k, checkpoint.step_name(s)))
    end
    local ck = checkpoint.open(dir)
    support.eq(ck.manifest.global_steps, prev, "the step latest names")
    local _, resumed = ok_train(1, "--steps 8 --resume " .. q(dir))
    support.eq(resumed, reference, ("kill at byte %d, resumed from step %d"):format(k, prev))
  end
end

function T.saves_every_minutes_happen_at_one_step_on_every_rank()
  -- Minutes so small every step is due (rank 0's clock; two ranks follow it).
  local dir = tmp .. "/minutes"
  local _, a = ok_train(2, "--steps 5 --stage 1 --save-every-minutes 1e-9 --async-save --save " ..
                           q(dir))
  support.eq(table.concat(steps_in(dir), ","), "1,2,3,4,5", "saved steps")
  -- So large none is: the last step only, beside --save-every.
  local dir2 = tmp .. "/minutes2"
  local _, b = ok_train(2, "--steps 5 --stage 1 --save-every 2 --save-every-minutes 600 --save " ..
                           q(dir2))
  support.eq(table.concat(steps_in(dir2), ","), "2,4,5", "saved steps")
  support.eq(a, b, "end checksums")
  local out, st = train(1, "--steps 2 --save-every-minutes -1 --save " .. q(dir2))
  assert(st == 2 and out:find("--save-every-minutes must be >= 0", 1, true), out)
end

-- States on NVMe: saved synchronously, with one line saying so.
function T.states_on_nvme_save_synchronously()
  local nvme = tmp .. "/nvme"
  os.execute("mkdir -p " .. q(nvme))
  local cfg = write_file("nvme.json", require("cjson").encode({
    train_micro_batch_size_per_gpu = 2,
    zero_optimization = { stage = 2, sub_group_size = 4096,
                          offload_optimizer = { device = "nvme", nvme_path = nvme } } }))
  local flags = "--steps 4 --save-every 2 --config " .. q(cfg) .. " --save "
  local _, a = ok_train(1, flags .. q(tmp .. "/nvme-sync"))
  local out, b = ok_train(1, flags .. q(tmp .. "/nvme-async") .. " --async-save")
  assert(out:find("--async-save: saving synchronously: the optimizer states are on NVMe", 1, true),
         out)
  support.eq(b, a, "end checksums")
  same_checkpoints(tmp .. "/nvme-sync", tmp .. "/nvme-async", "nvme")
end

-- A writer thread that cannot create its file: the join says so, by name.
function T.a_writer_threads_failure_comes_back_on_join()
  local C = lz.C
  local buf = lz.tensor({ 1024 }, "f32", "offload")
  local out = ffi.new("lz_shard_job *[1]")
  local path = tmp .. "/no/such/folder/shard.zst"
  assert(C.lz_shard_job_start(out, path, buf.data, 4096, 1000, 3, 0) == 0)
  local st = C.lz_shard_job_join(out[0], nil)
  assert(st ~= 0 and lz.last_error():find(path, 1, true), lz.last_error())
  -- A good one: the shard reads back.
  for i = 0, 1023 do buf:set(i, i) end
  path = tmp .. "/shard.zst"
  assert(C.lz_shard_job_start(out, path, buf.data, 4096, 1000, 3, 1) == 0)
  local info = ffi.new("lz_shard_info")
  assert(C.lz_shard_job_join(out[0], info) == 0, lz.last_error())
  support.eq(tonumber(info.raw_bytes), 4096, "raw bytes")
  local r = ffi.new("lz_shard_reader *[1]")
  assert(C.lz_shard_reader_open(r, path, info) == 0, lz.last_error())
  local back = lz.tensor({ 1024 }, "f32", "workspace")
  assert(C.lz_shard_reader_read(r[0], back.data, 4096) == 0 and
         C.lz_shard_reader_close(r[0], 1) == 0, lz.last_error())
  assert(ffi.C.memcmp(back.data, buf.data, 4096) == 0, "the shard read back differs")
  back:free()
  buf:free()
end

pcall(ffi.cdef, "int memcmp(const void *a, const void *b, size_t n);")

return T
