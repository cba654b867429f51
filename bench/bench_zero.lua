-- bench/bench_zero.lua — the ZeRO engine's benchmarks (not tests):
--   1. gpt2 (124M) on one rank: bf16 vs fp32 vs PyTorch fp32, same batch and
--      threads; tokens/s and the ratios (target: bf16 >= 1.5x our fp32).
--   2. a ~100M-parameter GPT-2 (8 layers, width 768) at world size 2, each
--      stage: tokens/s, peak RSS and model-state bytes per rank side by side,
--      stage 3 / stage 0 throughput (target >= 0.85); PyTorch DDP and
--      ZeroRedundancyOptimizer (gloo, 2 ranks, same threads) as yardstick.
--   luazero bench/bench_zero.lua [--part 1|2] [--steps N] [--seq-len T]
-- Takes minutes and both cores: run it on a quiet machine.
local cjson = require("cjson")
local lz = require("luazero")

local bench = dofile(lz.root .. "/bench/bench_support.lua")
local flags = bench.flags("bench_zero", arg, {
  { "part", "int", 0, "1 or 2 (0: both)" },
  { "steps", "int", 4, "timed steps per run (the first step is not counted)" },
  { "seq-len", "int", 64, "tokens per sequence" },
  { "micro-batch", "int", 4, "sequences per rank" },
  { "data", "string", nil, "corpus (default: a generated text)" },
})

local root = lz.root
local q = bench.quote
local exe = lz.executable

local tmp = bench.scratch()
local data = bench.corpus(tmp, flags.data)

local sh = bench.sh

-- Mean tokens/s over steps 2.., last record's mem; via train.lua's log.
local function luazero(n, model_flags, extra)
  local log = tmp .. "/bench.jsonl"
  local out = sh(("cd %s && %s %s scripts/train.lua %s --data %s --steps %d --seq-len %d " ..
                  "--micro-batch %d --sample 0 --eval-batches 0 --log %s %s")
                 :format(q(root), q(exe()), n > 1 and ("-n " .. n) or "", model_flags, data,
                         flags.steps + 1, flags.seq_len, flags.micro_batch, log, extra))
  local recs = {}
  local f = io.open(log)
  if not f then error("run failed:\n" .. out) end
  for l in f:lines() do recs[#recs + 1] = cjson.decode(l) end
  f:close()
  local sum = 0
  for i = 2, flags.steps + 1 do sum = sum + recs[i].step_ms end
  local ms = sum / flags.steps
  local tokens = recs[2].tokens - recs[1].tokens
  local mem = recs[flags.steps + 1].mem
  return tokens / ms * 1000, mem
end

local function torch_line(out, key)
  return tonumber(out:match(key .. " ([%d%.]+)"))
end

if flags.part == 0 or flags.part == 1 then
  print(bench.machine())
  print(("1. gpt2 124M, one rank, batch %d x %d, %d threads"):format(flags.micro_batch,
        flags.seq_len, lz.threads()))
  local m = "--model gpt2"
  local fp32 = luazero(1, m, "--dtype fp32")
  local bf16 = luazero(1, m, "--dtype bf16")
  local tout = sh(("/usr/bin/python3 %s/bench/bench_train_torch.py --micro-batch %d " ..
                   "--seq-len %d --steps %d --threads %d"):format(q(root), flags.micro_batch,
                   flags.seq_len, flags.steps, lz.threads()))
  local torch = torch_line(tout, "torch_tokens_per_s")
  print(("   luazero fp32 %8.1f tok/s\n   luazero bf16 %8.1f tok/s  (bf16/fp32 %.2fx, target >= 1.5)")
        :format(fp32, bf16, bf16 / fp32))
  print(("   PyTorch fp32 %8s tok/s  (luazero fp32/PyTorch %s)")
        :format(torch and ("%.1f"):format(torch) or "n/a",
                torch and ("%.2fx"):format(fp32 / torch) or "n/a"))
end

if flags.part == 0 or flags.part == 2 then
  local shape = "--model gpt2 --n-layer 8 --context 256"
  print(("2. gpt2 8 layers x 768 (~107M parameters), world 2, batch %d x %d per rank, fp32")
        :format(flags.micro_batch, flags.seq_len))
  print("   stage  tok/s     peak RSS/rank  model states/rank  comm buffers")
  local t = {}
  for stage = 0, 3 do
    local tps, mem = luazero(2, shape, "--stage " .. stage)
    t[stage] = tps
    print(("   %d      %8.1f  %8.0f MiB   %8.0f MiB         %6.0f MiB"):format(stage, tps,
          mem.peak_rss / 2 ^ 20, (mem.params + mem.grads + mem.optimizer) / 2 ^ 20,
          mem.comm / 2 ^ 20))
  end
  print(("   stage 3 / stage 0 throughput %.2f (target >= 0.85)"):format(t[3] / t[0]))
  -- Same threads per rank as luazero's launcher gives each of 2 ranks
  -- (the CPUs this process may use, divided by the ranks).
  local threads = math.max(1, math.floor(lz.threads() / 2))
  for _, mode in ipairs({ "ddp", "zero1" }) do
    local out = sh(("/usr/bin/python3 %s/bench/bench_zero_torch.py --mode %s --n-layer 8 " ..
                    "--context 256 --micro-batch %d --seq-len %d --steps %d --threads %d")
                   :format(q(root), mode, flags.micro_batch, flags.seq_len, flags.steps, threads))
    local tps = torch_line(out, "torch_" .. mode .. "_tokens_per_s")
    local rss = torch_line(out, "torch_" .. mode .. "_peak_rss")
    if not tps then
      -- Say why instead of a bare n/a: the last line of the failure.
      local last = out:match("([^\n]+)%s*$") or "no output"
      print(("   PyTorch %-5s failed: %s"):format(mode, last))
    else
      print(("   PyTorch %-5s %8.1f tok/s  peak RSS %s/rank  (stage 0 / PyTorch %.2fx, %d thread%s per rank)")
            :format(mode, tps, rss and ("%.0f MiB"):format(rss / 2 ^ 20) or "n/a", t[0] / tps,
                    threads, threads == 1 and "" or "s"))
    end
  end
end
bench.cleanup(tmp)
