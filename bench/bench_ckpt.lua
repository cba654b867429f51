-- bench/bench_ckpt.lua — checkpoint save and load speed and compression
-- ratio for GPT-2 124M (fp32 master + Adam moments after one training step,
-- one rank, stage 0), with the raw disk write speed of the same bytes
-- (dd, fdatasync) beside it.
--   luazero bench/bench_ckpt.lua [--model gpt2] [--dir /tmp] [--zstd-level 3]
local ffi = require("ffi")
local lz = require("luazero")
local args = require("luazero.args")
local clock = require("luazero.clock")
local gpt2 = require("models.gpt2")
local checkpoint = require("luazero.checkpoint")

local flags = assert(args.parse(arg, {
  { "model", "string", "gpt2", "model size" },
  { "dir", "string", "/tmp", "folder on the disk to measure (a scratch folder is made in it)" },
  { "zstd-level", "int", 3, "zstd level" },
}))

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
