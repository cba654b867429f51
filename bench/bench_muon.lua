-- bench_muon.lua — Muon's step time per parameter (optim/muon.lua: the
-- momentum, 5 fp32 Newton-Schulz steps on the engine's GEMM, the update)
-- on whole matrices of a Llama's shapes, beside AdamW's fused step over as
-- many parameters and the GEMM yardstick (the same n x n x n lz_matmul rate
-- bench_support measures). One line per shape:
--   muon AxB  time per parameter <ns>  <parameters/s>  <Newton-Schulz GFLOP/s>  adamw <ns> <parameters/s>
-- and at the end the time per parameter of a whole model's worth of these matrices (the
-- shapes' parameter-weighted mean).
--   luazero bench/bench_muon.lua [--reps R] [--shapes 768x768,2048x768,...]
local lz = require("luazero")
local optim = require("luazero.optim")
local clock = require("luazero.clock")
local bench = dofile(lz.root .. "/bench/bench_support.lua")

local reps, shapes_arg = 5, "768x768,2048x768,768x2048,2048x2048,5632x2048"
for i = 1, #arg do
  if arg[i] == "--reps" then reps = tonumber(arg[i + 1]) end
  if arg[i] == "--shapes" then shapes_arg = arg[i + 1] end
end

local muon = optim.new({ type = "Muon", params = { lr = 0.02 } })
local adamw = optim.new({ type = "AdamW", params = { lr = 1e-3, weight_decay = 0.1 } })

-- Deterministic values of either sign (the timing does not depend on them).
local function randomize(t, seed)
  local x = require("ffi").cast("float *", t.data)
  for i = 0, t:numel() - 1 do x[i] = ((i * 7919 + seed * 104729) % 2003) / 2003 - 0.5 end
end

local total_s, total_n = 0, 0
local peak = bench.gemm_gflops(2048, "f32")
print(("bench_muon: %d threads; lz_matmul 2048^3 fp32 %.0f GFLOP/s (the yardstick)")
      :format(lz.threads(), peak))
for a, b in shapes_arg:gmatch("(%d+)x(%d+)") do
  local A, B = tonumber(a), tonumber(b)
  local n = A * B
  local p, g = lz.tensor({ n }, "f32"), lz.tensor({ n }, "f32")
  local m, v = lz.tensor({ n }, "f32"), lz.tensor({ n }, "f32")
  randomize(p, 1)
  local call = { p = p, g = g, s = { m, v }, decay = true, matrix = { A, B } }
  local times, atimes = {}, {}
  for t = 1, reps do
    randomize(g, 100 + t)
    local t0 = clock.now()
    muon:prepare(call, t, 1)
    local u = v:view(0, { A, B })
    muon:orthogonalize(u, A, B)
    u:free()
    muon:update(call, t, 0.02, 1)
    times[#times + 1] = clock.now() - t0
  end
  local plain = { p = p, g = g, s = { m, v }, decay = true }
  for t = 1, reps do
    local t0 = clock.now()
    adamw:update(plain, t, 1e-3, 1)
    atimes[#atimes + 1] = clock.now() - t0
  end
  local s, as = bench.median(times), bench.median(atimes)
  local k, l = math.min(A, B), math.max(A, B)
  local flops = muon.ns_steps * (4 * k * k * l + 2 * k * k * k)
  print(("muon %dx%d  time per parameter %.2f ns  %.3g params/s  NS %.0f GFLOP/s  adamw %.2f ns %.3g params/s")
        :format(A, B, s * 1e9 / n, n / s, flops / s / 1e9, as * 1e9 / n, n / as))
  total_s, total_n = total_s + s, total_n + n
  for _, t in ipairs({ p, g, m, v }) do t:free() end
end
print(("muon all shapes  time per parameter %.2f ns (%d parameters)"):format(total_s * 1e9 / total_n,
      total_n))
