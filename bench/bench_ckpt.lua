-- bench/bench_ckpt.lua — checkpoint save and load speed and compression
-- ratio for GPT-2 124M (fp32 master + Adam moments after one training step,
-- one rank, stage 0), with the raw disk write speed of the same bytes
-- (dd, fdatasync) beside it. With --async: what a save costs the step that
-- makes it, synchronous against asynchronous (--async-save), measured as
-- ratios to a step that does not save, in one run (docs/checkpoints.md).
--   luazero bench/bench_ckpt.lua [--model gpt2] [--dir /tmp] [--zstd-level 3]
--   luazero bench/bench_ckpt.lua --async [--dtype bf16] [--rounds 3] [--every 4] [--threads N] [--device cpu]
local ffi = require("ffi")
local lz = require("luazero")
local clock = require("luazero.clock")
local gpt2 = require("models.gpt2")
local checkpoint = require("luazero.checkpoint")

local bench = dofile(lz.root .. "/bench/bench_support.lua")
local flags = bench.flags("bench_ckpt", arg, {
  { "model", "string", "gpt2", "model size" },
  { "dir", "string", "/tmp", "folder on the disk to measure (a scratch folder is made in it)" },
  { "zstd-level", "int", 3, "zstd level" },
  { "async", "flag", false, "measure the step cost of a save, sync against async" },
  { "dtype", "string", "fp32", "with --async: fp32 or bf16" },
  { "device", "string", "cpu", "with --async: cpu or cuda" },
  { "batch", "int", 4, "with --async: micro-batch" },
  { "seq-len", "int", 128, "with --async: tokens per row" },
  { "rounds", "int", 3, "with --async: rounds of sync then async (order alternating)" },
  { "threads", "int", 0, "with --async: compute threads (0: all cores; fewer leave a core to the writer)" },
  { "every", "int", 4, "with --async: steps from one save to the next (the window a save is charged for)" },
})

-- --async: rounds of [2 plain steps, then 2 windows of --every steps, each
-- beginning with a step that saves] for a sync and an async engine in turn
-- (the order alternating by round), every step timed with what the loop
-- does around it (the poll of the writer, the save or its start; the last
-- window also waits for the save still in flight). A save's cost is its
-- window's time over --every plain steps, so an async save pays for the
-- CPU its writer takes from the steps it runs beside, not only for its own
-- step; an async save's own step splits into the snapshot copy, the wait
-- for the save before it and the rest. Medians over the rounds.
local function median(v)
  local c = { unpack(v) }
  table.sort(c)
  local n = #c
  if n == 0 then return 0 end
  return n % 2 == 1 and c[(n + 1) / 2] or (c[n / 2] + c[n / 2 + 1]) / 2
end

local function step_cost()
  local cfg = gpt2.config(flags.model)
  local B, T, K = flags.batch, flags.seq_len, flags.every
  if K < 1 then error("bench_ckpt: --every must be >= 1 (got " .. K .. ")", 0) end
  if flags.threads > 0 then lz.threads(flags.threads) end
  local engine = require("luazero.zero").initialize({
    model = gpt2.new(cfg), batch = { B, T }, seed = 1, device = flags.device,
    comm = require("luazero.comm").init("local"),
    config = { train_micro_batch_size_per_gpu = B, bf16 = { enabled = flags.dtype == "bf16" } } })
  local async = require("luazero.checkpoint.async")
  local x, y = lz.tensor({ B, T }, "i32"), lz.tensor({ B, T }, "i32")
  local r = require("luazero.rng").new(3)
  for i = 0, B * T - 1 do x:set(i, r:int(cfg.vocab)); y:set(i, r:int(cfg.vocab)) end
  local batch = { next_batch = function() return x, y end }
  local dir = ("%s/lz_bench_ckpt_%d"):format(flags.dir, tonumber(ffi.C.getpid()))
  local opts = { zstd_level = flags.zstd_level, keep = 1 }
  engine:train_batch(batch) -- warm-up
  local plain = {}
  local saves = { sync = {}, async = {} } -- { window_s, step_s, copy_s, wait_s }
  local total = {}
  local function finished(done, info)
    if done then total[#total + 1] = info.total_s end
  end
  local function timed_step(mode)
    local t0 = clock.now()
    if mode == "async" then finished(async.poll(engine)) end
    engine:train_batch(batch)
    return clock.now() - t0
  end
  local function run(mode)
    engine:train_batch(batch) -- not timed: the first step after the other mode's
    for _ = 1, 2 do plain[#plain + 1] = timed_step(mode) end
    for w = 1, 2 do
      local rec = { copy_s = 0, wait_s = 0 }
      local t0 = clock.now()
      rec.step_s = timed_step(mode)
      local s0 = clock.now()
      if mode == "sync" then
        engine:save(dir, {}, opts)
      else
        finished(async.wait(engine)) -- one save at a time
        rec.wait_s = clock.now() - s0
        local _, copy_s = async.start(engine, dir, {}, opts)
        rec.copy_s = copy_s
      end
      rec.step_s = rec.step_s + clock.now() - s0
      for _ = 2, K do timed_step(mode) end
      if mode == "async" and w == 2 then finished(async.wait(engine)) end
      rec.window_s = clock.now() - t0
      saves[mode][#saves[mode] + 1] = rec
    end
  end
  for round = 1, flags.rounds do
    local order = round % 2 == 1 and { "sync", "async" } or { "async", "sync" }
    for _, mode in ipairs(order) do run(mode) end
    io.stderr:write(("round %d/%d done\n"):format(round, flags.rounds))
  end
  async.release(engine)
  os.execute("rm -rf '" .. dir .. "'")
  local p = median(plain)
  local function of(mode, fn)
    local v = {}
    for _, rec in ipairs(saves[mode]) do v[#v + 1] = fn(rec) end
    return median(v), v
  end
  local function cost(rec) return (rec.window_s - K * p) / p end
  print(("save cost: %s %s, B%d T%d, %s, zstd %d, %d threads, a save every %d steps, %d rounds " ..
         "(medians; ratios within this run)"):format(cfg.name, flags.dtype, B, T, flags.device,
         flags.zstd_level, lz.threads(), K, flags.rounds))
  print(("plain step            %8.0f ms   1.00"):format(p * 1000))
  for _, mode in ipairs({ "sync", "async" }) do
    local m, each = of(mode, cost)
    for i, c in ipairs(each) do each[i] = ("%+.2f"):format(c) end
    print(("%-5s save: +%.2f of a step over its window of %d (its own step +%.2f; each save: %s)")
          :format(mode, m, K, of(mode, function(rec) return (rec.step_s - p) / p end),
                  table.concat(each, " ")))
  end
  local copy = of("async", function(rec) return rec.copy_s / p end)
  print(("async: snapshot copy %.2f of a step; wait for the save before %.2f; beyond the copy " ..
         "%+.2f of a step (target <= 0.10); a background save took %.2f s from its step, " ..
         "a sync save %.2f s"):format(copy, of("async", function(rec) return rec.wait_s / p end),
         of("async", function(rec) return cost(rec) - rec.copy_s / p end), median(total),
         of("sync", function(rec) return rec.step_s - p end)))
  engine:free()
end

if flags.async then
  step_cost()
  return
end

local cfg = gpt2.config(flags.model)
local B, T = 1, 32
local engine = require("luazero.zero").initialize({ model = gpt2.new(cfg), batch = { B, T }, seed = 1,
                               comm = require("luazero.comm").init("local"),
                               config = { train_micro_batch_size_per_gpu = B } })
-- One step on random tokens, so the moments hold real numbers.
local x, y = lz.tensor({ B, T }, "i32"), lz.tensor({ B, T }, "i32")
local r = require("luazero.rng").new(3)
for i = 0, B * T - 1 do x:set(i, r:int(cfg.vocab)); y:set(i, r:int(cfg.vocab)) end
engine:train_batch({ next_batch = function() return x, y end })

local dir = ("%s/lz_bench_ckpt_%d"):format(flags.dir, tonumber(ffi.C.getpid()))
local t0 = clock.now()
local step = engine:save(dir, {}, { zstd_level = flags.zstd_level })
local t_save = clock.now() - t0
local ck = checkpoint.open(step)
local s = ck:summary()
os.execute("sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null")
t0 = clock.now()
engine:load(step)
local t_load = clock.now() - t0

-- The yardstick: dd writing the same number of raw bytes, synced.
local mb = math.ceil(s.raw_bytes / 2 ^ 20)
local p = io.popen(("dd if=/dev/zero of=%s/dd.bin bs=1M count=%d conv=fdatasync 2>&1")
                   :format(dir, mb))
local dd = p:read("*a")
p:close()
local bytes, secs = dd:match("(%d+) bytes .- copied, ([%d%.]+) s")
local dd_gbs = bytes and tonumber(bytes) / tonumber(secs) / 1e9 or 0
os.execute("rm -rf '" .. dir .. "'")

local gb = s.raw_bytes / 1e9
print(("checkpoint of %s: %d parameters, %.2f GB raw (fp32 master, m, v), %.2f GB on disk, " ..
       "ratio %.3f (zstd %d, %d threads)"):format(cfg.name, s.numel, gb,
       s.compressed_bytes / 1e9, s.ratio, flags.zstd_level, lz.threads()))
print(("save  %.2f GB/s raw  (%.2f s, fsync included)"):format(gb / t_save, t_save))
print(("load  %.2f GB/s raw  (%.2f s, verified)"):format(gb / t_load, t_load))
print(("dd    %.2f GB/s      (raw disk write of the same bytes, fdatasync) -- the yardstick")
      :format(dd_gbs))
engine:free()
