-- bench_muon.lua — Muon's step time per parameter (optim/muon.lua: the
-- momentum, 5 Newton-Schulz steps on the engine's GEMM, the update) on whole
-- matrices of a Llama's shapes, with Newton-Schulz in each ns_dtype (fp32, and
-- bf16 as torch.optim.Muon runs it) in the same run, beside AdamW's fused step
-- over as many parameters and the GEMM yardstick (the same n x n x n
-- lz_matmul rate bench_support measures). One line per shape and dtype:
--   muon AxB ns <dtype>  time per parameter <ns>  <parameters/s>  <Newton-Schulz GFLOP/s>  adamw <ns> <parameters/s>
-- and at the end, per dtype, the time per parameter of a whole model's worth of these
-- matrices (the shapes' parameter-weighted mean).
--   luazero bench/bench_muon.lua [--reps R] [--shapes 768x768,2048x768,...]
--                                [--ns-dtypes float32,bfloat16] [--cpu-time]
-- --cpu-time: the steps timed in the process's CPU time (os.clock, all threads' together), not
-- the wall clock: on a machine shared with other jobs, with one thread, what the step costs.
local lz = require("luazero")
local optim = require("luazero.optim")
local clock = require("luazero.clock")
local bench = dofile(lz.root .. "/bench/bench_support.lua")

local flags = bench.flags("bench_muon", arg, {
  { "reps", "int", 5, "timed steps per shape and dtype", min = 1 },
  { "shapes", "string", "768x768,2048x768,768x2048,2048x2048,5632x2048",
    "the matrices, AxB comma-separated" },
  { "ns-dtypes", "string", "float32,bfloat16", "Newton-Schulz's dtypes, comma-separated" },
  { "cpu-time", "flag", false, "time in the process's CPU time, not the wall clock" },
})
local reps, shapes_arg, dtypes_arg = flags.reps, flags.shapes, flags.ns_dtypes
local now = flags.cpu_time and os.clock or clock.now

local function refuse(msg)
  io.stderr:write("bench_muon: ", msg, "\n")
  os.exit(2)
end
-- (each shape AxB, A and B at least 2: Newton-Schulz of a matrix)
for s in shapes_arg:gmatch("[^,]+") do
  local a, b = s:match("^(%d+)x(%d+)$")
  if not a or tonumber(a) < 2 or tonumber(b) < 2 then
    refuse(("--shapes: %s is not AxB with A and B of 2 or more (e.g. 768x2048)"):format(s))
  end
end

local muons, dtypes = {}, {}
for dt in dtypes_arg:gmatch("[^,]+") do
  if dt ~= "float32" and dt ~= "bfloat16" then
    refuse(("--ns-dtypes: %s is not float32 or bfloat16"):format(dt))
  end
  dtypes[#dtypes + 1] = dt
  muons[dt] = optim.new({ type = "Muon", params = { lr = 0.02, ns_dtype = dt } })
end
local adamw = optim.new({ type = "AdamW", params = { lr = 1e-3, weight_decay = 0.1 } })

-- Deterministic values of either sign (the timing does not depend on them).
local function randomize(t, seed)
  local x = require("ffi").cast("float *", t.data)
  for i = 0, t:numel() - 1 do x[i] = ((i * 7919 + seed * 104729) % 2003) / 2003 - 0.5 end
end

local total_s, total_n = {}, 0
for _, dt in ipairs(dtypes) do total_s[dt] = 0 end
local peak = bench.gemm_gflops(2048, "f32")
print(("bench_muon: %d threads%s; lz_matmul 2048^3 fp32 %.0f GFLOP/s (the yardstick, wall clock); " ..
       "bf16 GEMM %s"):format(lz.threads(), flags.cpu_time and ", steps in CPU time" or "", peak,
                              lz.bf16_matmul()))
for a, b in shapes_arg:gmatch("(%d+)x(%d+)") do
  local A, B = tonumber(a), tonumber(b)
  local n = A * B
  local p, g = lz.tensor({ n }, "f32"), lz.tensor({ n }, "f32")
  local m, v = lz.tensor({ n }, "f32"), lz.tensor({ n }, "f32")
  local plain = { p = p, g = g, s = { m, v }, decay = true }
  local atimes = {}
  for t = 1, reps do
    local t0 = now()
    adamw:update(plain, t, 1e-3, 1)
    atimes[#atimes + 1] = now() - t0
  end
  local as = bench.median(atimes)
  for _, dt in ipairs(dtypes) do
    local muon = muons[dt]
    randomize(p, 1)
    m:fill(0)
    local call = { p = p, g = g, s = { m, v }, decay = true, matrix = { A, B } }
    local times = {}
    for t = 1, reps do
      randomize(g, 100 + t)
      local t0 = now()
      muon:prepare(call, t, 1)
      local u = v:view(0, { A, B })
      muon:orthogonalize(u, A, B)
      u:free()
      muon:update(call, t, 0.02, 1)
      times[#times + 1] = now() - t0
    end
    local s = bench.median(times)
    local k, l = math.min(A, B), math.max(A, B)
    local flops = muon.ns_steps * (4 * k * k * l + 2 * k * k * k)
    print(("muon %dx%d ns %-8s  time per parameter %.2f ns  %.3g params/s  NS %.0f GFLOP/s  adamw %.2f ns %.3g params/s")
          :format(A, B, dt, s * 1e9 / n, n / s, flops / s / 1e9, as * 1e9 / n, n / as))
    total_s[dt] = total_s[dt] + s
  end
  total_n = total_n + n
  for _, t in ipairs({ p, g, m, v }) do t:free() end
end
for _, dt in ipairs(dtypes) do
  print(("muon all shapes ns %-8s  time per parameter %.2f ns (%d parameters)%s"):format(dt,
        total_s[dt] * 1e9 / total_n, total_n,
        dt ~= dtypes[1] and (" %.2fx %s's"):format(total_s[dtypes[1]] / total_s[dt], dtypes[1]) or ""))
end
