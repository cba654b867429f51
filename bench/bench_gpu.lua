-- bench/bench_gpu.lua — GPU figures beside their yardsticks: GEMM TFLOP/s
-- through luazero's lz_matmul (cuBLASLt) against the GPU's dense peak, and
-- the main kernels' time per call at GPT-2 124M shapes (B=8, T=1024).
--   luazero bench/bench_gpu.lua [--peak-bf16 TFLOPS] [--peak-f32 TFLOPS]
-- The peaks default to the H200's data sheet (989 dense bf16, 67 fp32).
-- Without a GPU it says so and exits 0.
local ffi = require("ffi")
local lz = require("luazero")
local clock = require("luazero.clock")
local C = lz.C

local peak = { bf16 = 989, f32 = 67 }
for i = 1, #arg do
  if arg[i] == "--peak-bf16" then peak.bf16 = tonumber(arg[i + 1]) end
  if arg[i] == "--peak-f32" then peak.f32 = tonumber(arg[i + 1]) end
end

local ok, why = lz.cuda.available()
if not ok then
  print("bench_gpu: no GPU: " .. why)
  os.exit(0)
end
print(("bench_gpu: %s"):format(ffi.string(C.lz_cuda_device_name(lz.cuda.device()))))

-- Seconds per call of fn, after a warm-up, the device drained each time.
local function time_it(fn, reps)
  fn()
  lz.cuda.synchronize()
  local t0 = clock.now()
  for _ = 1, reps do fn() end
  lz.cuda.synchronize()
  return (clock.now() - t0) / reps
end

local function rand_dev(shape, dtype)
  local h = lz.tensor(shape, "f32", "workspace")
  local p = ffi.cast("float *", h.data)
  local seed = 12345
  for i = 0, h:numel() - 1 do
    seed = (seed * 1103515245 + 12345) % 2147483648
    p[i] = seed / 2147483648 - 0.5
  end
  local d = lz.tensor(shape, dtype, "workspace", "cuda")
  if dtype == "f32" then d:copy(h:to("cuda"))
  else
    local df = h:to("cuda")
    d:copy(df) -- converted on the device
    df:free()
  end
  h:free()
  return d
end

print("\nGEMM c = a @ b^T (lz_matmul, cuBLASLt)        ours TFLOP/s   peak   % of peak")
for _, dt in ipairs({ "bf16", "f32" }) do
  for _, n in ipairs({ 2048, 4096, 8192 }) do
    local a, b = rand_dev({ n, n }, dt), rand_dev({ n, n }, dt)
    local c = lz.tensor({ n, n }, "f32", "workspace", "cuda")
    local s = time_it(function() lz.check(C.lz_matmul(c, a, b, 0, 1, 1.0, 0.0)) end,
                      dt == "f32" and 5 or 20)
    local tf = 2 * n ^ 3 / s / 1e12
    print(("  %-5s %5d x %5d x %5d                  %8.1f %7.0f %8.1f%%")
          :format(dt, n, n, n, tf, peak[dt], 100 * tf / peak[dt]))
    a:free(); b:free(); c:free()
  end
end

-- GPT-2 124M shapes: B=8, T=1024, C=768, 12 heads, vocab 50304 (padded).
local B, T, Cc, NH, V = 8, 1024, 768, 12, 50304
print(("\nkernels at GPT-2 124M shapes (B=%d, T=%d)          ms per call"):format(B, T))
local x = rand_dev({ B, T, Cc }, "f32")
local w, bsz = rand_dev({ Cc }, "f32"), rand_dev({ Cc }, "f32")
local y = lz.tensor({ B, T, Cc }, "f32", "activations", "cuda")
local mu = lz.tensor({ B, T }, "f32", "activations", "cuda")
local rs = lz.tensor({ B, T }, "f32", "activations", "cuda")
local function row(name, fn, reps)
  print(("  %-44s %10.3f"):format(name, 1e3 * time_it(fn, reps or 10)))
end
row("layernorm_forward", function() lz.check(C.lz_layernorm_forward(y, mu, rs, x, w, bsz, 1e-5)) end)
local qkv = rand_dev({ B, T, 3 * Cc }, "f32")
local ao = lz.tensor({ B, T, Cc }, "f32", "activations", "cuda")
local lse = lz.tensor({ B, NH, T }, "f32", "activations", "cuda")
row("attention_forward", function() lz.check(C.lz_attention_forward(ao, lse, qkv, NH)) end, 3)
local dqkv = lz.tensor({ B, T, 3 * Cc }, "f32", "activations", "cuda")
row("attention_backward", function()
  lz.check(C.lz_attention_backward(dqkv, ao, qkv, ao, lse, NH)) end, 3)
local fc_w = rand_dev({ 4 * Cc, Cc }, "bf16")
local xb = rand_dev({ B, T, Cc }, "bf16")
local h4 = lz.tensor({ B, T, 4 * Cc }, "f32", "activations", "cuda")
row("linear_forward bf16 768 -> 3072", function()
  lz.check(C.lz_linear_forward(h4, xb, fc_w, nil)) end)
row("gelu_forward", function() lz.check(C.lz_gelu_forward(h4, h4)) end)
local wte = rand_dev({ V, Cc }, "bf16")
local logits = lz.tensor({ B, T, V }, "f32", "activations", "cuda")
row("linear_forward bf16 768 -> 50304 (lm head)", function()
  lz.check(C.lz_linear_forward(logits, xb, wte, nil)) end, 3)
local tg = lz.tensor({ B, T }, "i32", "activations", "cuda")
local losses = lz.tensor({ B, T }, "f32", "activations", "cuda")
row("cross_entropy_forward", function()
  lz.check(C.lz_cross_entropy_forward(losses, logits, tg, 50257)) end, 3)
print("\ngpt2 124M tokens/s: tools/gpu-check measures it beside these GEMMs (a training run " ..
      "on cuda, docs/cuda.md)")
