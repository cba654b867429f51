-- bench/bench_train.lua — GPT-2 training throughput, luazero beside PyTorch.
--   luazero bench/bench_train.lua [--model gpt2] [--micro-batch 4] [--seq-len 64]
--                                   [--steps 3] [--threads 2] [--torch-steps 2]
-- In one run, on the same machine, threads, batch and model, in fp32:
--   1. the GEMM yardstick: a large sgemm through lz_matmul (oneDNN), GFLOP/s;
--   2. luazero: full optimizer steps through the ZeRO engine at stage 0, one
--      rank (forward, backward, clipping, AdamW);
--   3. PyTorch 1.13 (/usr/bin/python3, bench/bench_train_torch.py): the same.
-- Prints tokens/s of both, the ratio, and model FLOP utilisation (MFU) against
-- the GEMM figure. FLOPs per token: 6 N + 12 L C T, nanoGPT's estimate (N: the
-- parameters without the position table; the attention term counts the whole
-- T x T square, though causal attention computes half of it).
local lz = require("luazero")
local clock = require("luazero.clock")
local rng = require("luazero.rng")
local zero = require("luazero.zero")
local gpt2 = require("models.gpt2")

local bench = dofile(lz.root .. "/bench/bench_support.lua")
local flags = bench.flags("bench_train", arg, {
  { "model", "string", "gpt2", "model size" },
  { "micro-batch", "int", 4, "sequences per step" },
  { "seq-len", "int", 64, "tokens per sequence" },
  { "steps", "int", 3, "timed luazero steps (after one warm-up step)" },
  { "torch-steps", "int", 2, "timed PyTorch steps (after one warm-up step); 0 skips PyTorch" },
  { "threads", "int", 2, "compute threads for both" },
  { "gemm", "int", 2048, "size n of the n x n x n yardstick GEMM" },
})

local B, T, threads = flags.micro_batch, flags.seq_len, flags.threads
lz.threads(threads)

------------------------------------------------------------- GEMM peak

local gemm_gflops = bench.gemm_gflops

-- Measured before and after the training runs; the better figure counts, so
-- a burst of load from elsewhere does not pass for the machine's peak.
local peak = gemm_gflops(flags.gemm)

------------------------------------------------------------- luazero

local cfg = gpt2.config(flags.model)
local model = gpt2.new(cfg)
local engine = zero.initialize({
  model = model, seed = 1, batch = { B, T }, comm = require("luazero.comm").init("local"),
  config = { train_micro_batch_size_per_gpu = B, gradient_clipping = 1.0,
             optimizer = { type = "AdamW", params = { lr = 1e-4 } } } })
local batches = require("luazero.data.random").new(B, T, cfg.vocab, rng.new(1))

local n_params = model:count_params()
local flops_per_token = 6 * (n_params - cfg.context * cfg.n_embd) +
                        12 * cfg.n_layer * cfg.n_embd * T
print(bench.machine())
print(("model %s: %.1fM parameters, batch %d x %d, fp32; %.2f GFLOP per token")
      :format(cfg.name, n_params / 1e6, B, T, flops_per_token / 1e9))

engine:train_batch(batches) -- warm-up
local t0 = clock.now()
for _ = 1, flags.steps do engine:train_batch(batches) end
local dt = (clock.now() - t0) / flags.steps
local ours = B * T / dt
peak = math.max(peak, gemm_gflops(flags.gemm))
print(("gemm     %d x %d x %d sgemm (lz_matmul, oneDNN), %d threads: %.1f GFLOP/s")
      :format(flags.gemm, flags.gemm, flags.gemm, threads, peak))
local mfu = ours * flops_per_token / (peak * 1e9)
print(("luazero  %8.1f tokens/s  (%.0f ms/step, %d steps)  MFU %.1f%% of the GEMM figure")
      :format(ours, dt * 1000, flags.steps, mfu * 100))
io.stdout:flush()
engine:free()

------------------------------------------------------------- PyTorch

if flags.torch_steps > 0 then
  local cmd = ("/usr/bin/python3 %s/bench/bench_train_torch.py --n-layer %d --n-head %d " ..
               "--n-embd %d --context %d --vocab %d --micro-batch %d --seq-len %d " ..
               "--steps %d --threads %d 2>&1")
              :format(lz.root, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.context,
                      cfg.vocab, B, T, flags.torch_steps, threads)
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  local theirs = tonumber(out:match("torch_tokens_per_s ([%d.e+-]+)"))
  if not theirs then
    print("pytorch  failed:\n" .. out)
    os.exit(1)
  end
  local tmfu = theirs * flops_per_token / (peak * 1e9)
  print(("pytorch  %8.1f tokens/s  (%.0f ms/step, %d steps)  MFU %.1f%%")
        :format(theirs, B * T / theirs * 1000, flags.torch_steps, tmfu * 100))
  print(("ratio    luazero / pytorch = %.2fx (target >= 3x)"):format(ours / theirs))
end
