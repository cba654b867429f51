-- bench/bench_hf_init.lua — what one rank holds while it loads Hugging Face
-- weights (luazero/hf.lua): the model's fp32 size beside this rank's peak
-- RSS during the load, measured from a reset high-water mark (VmHWM, reset
-- through /proc/self/clear_refs after the engine is built), and the time.
--   luazero -n 2 bench/bench_hf_init.lua FOLDER [--stage 3]
-- FOLDER: a Hugging Face folder (config.json, *.safetensors), e.g. from
-- tools/ckpt export CKPT FOLDER.
local lz = require("luazero")
local clock = require("luazero.clock")
local models = require("models.registry")
local hf = require("luazero.hf")

local folder = arg[1]
if folder == "--help" or folder == "-h" then folder = nil end
local rest = folder and {} or { "--help" }
for i = 2, #arg do rest[#rest + 1] = arg[i] end
local bench = dofile(lz.root .. "/bench/bench_support.lua")
local flags = bench.flags("bench_hf_init", rest, { { "stage", "int", 3, "ZeRO stage" } }, "FOLDER ")
assert(folder and hf.config_path(folder), "usage: luazero -n 2 bench/bench_hf_init.lua FOLDER [--stage 3]")

local function status(key)
  local s = lz.read_file("/proc/self/status")
  return tonumber(s:match(key .. ":%s*(%d+)")) * 1024
end
local function mib(b) return b / 2 ^ 20 end

local cfg = models.from_hf_config(hf.config_path(folder))
local model = models.new(cfg)
local comm = require("luazero.comm").init()
-- As train.lua --init builds it: nothing drawn, no whole-model buffer.
local engine = require("luazero.zero").initialize({
  model = model, comm = comm, batch = { 1, 16 }, draw_weights = false,
  config = { train_micro_batch_size_per_gpu = 1, zero_optimization = { stage = flags.stage } } })
local hwm_init = status("VmHWM")
local f = assert(io.open("/proc/self/clear_refs", "w"))
f:write("5")
f:close()
local before = status("VmRSS")
local t0 = clock.now()
hf.load_into(engine, folder)
local dt = clock.now() - t0
local peak = status("VmHWM")
local fp32 = model.n_params * 4
io.stdout:write(("rank %d of %d, stage %d: model %d parameters, %.1f MiB in fp32; this rank's " ..
                 "states %.1f MiB (fp32 master + %d optimizer states); RSS %.1f MiB before the " ..
                 "load, peak %.1f MiB during it (+%.1f MiB); peak while the engine was built " ..
                 "%.1f MiB; load %.2f s\n")
                :format(comm.rank(), comm.size(), flags.stage, model.n_params, mib(fp32),
                        mib(engine:state_numel() * 4 * (1 + #engine.optimizer.states)),
                        #engine.optimizer.states, mib(before), mib(peak), mib(peak - before),
                        mib(hwm_init), dt))
engine:free()
