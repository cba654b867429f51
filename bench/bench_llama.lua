-- bench/bench_llama.lua — Llama training throughput at the ~100M size, in fp32
-- and bf16, on one rank and on two, beside GPT-2 of the same depth and width
-- and beside PyTorch and Hugging Face transformers on the same shapes; or
-- (--lora) LoRA fine-tuning of a TinyLlama-1.1B shape beside PEFT.
--   luazero bench/bench_llama.lua [--model llama-100m] [--gpt2 gpt2] [--beside gemma-100m]
--                                 [--micro-batch 4]
--                                 [--seq-len 64] [--steps 3] [--torch-steps 2] [--hf-steps 2]
--                                 [--hf5-steps 2]
--                                 [--threads 2] [--ranks 2] [--stage 2] [--rounds 1] [--profile]
--   luazero bench/bench_llama.lua --lora [--model tinyllama-1.1b] [--lora-r 8]
--                                 [--micro-batch 2] [--seq-len 128] [--profile]
-- In one run, on the same machine, threads, batch and sequence length:
--   1. the GEMM yardsticks: a large GEMM through lz_matmul (oneDNN), fp32
--      (sgemm) and bf16 (bf16 inputs, fp32 output), GFLOP/s, measured
--      before and after the training runs (the better figure counts);
--   2. luazero: full optimizer steps through the ZeRO engine (forward,
--      backward, clipping, AdamW), random tokens, for Llama and GPT-2, fp32
--      and bf16, on one rank (stage 0) and on --ranks ranks (`luazero -n`,
--      ZeRO --stage, --micro-batch sequences per rank, the launcher's threads:
--      --threads / ranks each). Each run is its own process; --warmup
--      untimed steps (1), then --steps steps timed one by one, the median
--      counts;
--   3. PyTorch 1.13 (/usr/bin/python3, bench/bench_llama_torch.py): the same
--      Llama written from Hugging Face's equations, one rank, same threads,
--      fp32 and bf16 (torch.autocast on the CPU);
--   4. transformers 4.40.2 (the reference venv's python, build/ref-venv, made
--      by tools/setup; skipped when it cannot import transformers):
--      LlamaForCausalLM of the same config, eager attention, AdamW, fp32 and
--      bf16 under torch.autocast (bench/bench_llama_hf.py);
--   5. transformers 5.23 on torch 2.15 (the second reference venv's python,
--      tests/ref/refenv.py's VENV5: LZ_REF5_VENV, or luazero/ref5-venv in
--      the user's cache; skipped with one line when absent): the same
--      LlamaForCausalLM with eager and with sdpa attention, fp32 and bf16
--      under autocast; the ratio counts the faster of the two in each round
--      (the best PyTorch a user would run);
--   6. --beside: sizes of other families (qwen2-100m, qwen3-100m, ...) on one
--      rank, each dtype, with the ratio of their MFU to the Llama's.
-- --lora: the model (default tinyllama-1.1b, random weights) with LoRA
-- adapters of rank --lora-r (alpha = r) on q_proj and v_proj, everything
-- else frozen, bf16, one rank, batch 2 x 128 by default; beside it PEFT 0.10
-- LoRA (same rank and targets) on transformers' LlamaForCausalLM of the same
-- shape under autocast. No GPT-2, no multi-rank and no PyTorch-own rows.
-- --profile prints, under each luazero row, where its steps went
-- (luazero.profile: per kernel and engine phase, the GEMMs by module, part,
-- dtype and shape with the share of the yardstick they reach); the profiled
-- runs pay the profiler's small cost in their tokens/s.
-- --rounds N repeats 2 and 3 N times, interleaved, and prints the median of
-- each figure over the rounds. On a shared machine the ratios of one round
-- hold better than the absolute figures, and one rank of two threads loses
-- more to other jobs than two ranks of one thread each: use a quiet machine
-- for figures to compare (docs/models.md, "Speed").
-- Model FLOP utilisation (MFU) is against the GEMM figure of the run's dtype.
-- --beside lists more sizes (other families' 100M shapes: gemma-100m) run
-- on one rank as the Llama one is, with their MFU ratio to it.
-- FLOPs per token: 6 N + 12 L C T (nanoGPT's estimate; N: the parameters,
-- without a position table (GPT-2's); the attention term counts the whole T x T
-- square and the query heads, C = n_head * head_dim); with LoRA 4 N + 12 L C T
-- (the frozen weights' forward and input gradients, no weight gradients).
local lz = require("luazero")
local clock = require("luazero.clock")
local models = require("models.registry")

local spec = {
  { "model", "string", nil, "the Llama size (models/registry.lua; default llama-100m, with --lora tinyllama-1.1b)" },
  { "gpt2", "string", "gpt2", "the GPT-2 size beside it (\"none\" skips GPT-2)" },
  { "beside", "string", "none", "sizes of other families run beside the Llama on one rank, comma-separated (e.g. qwen2-100m,qwen3-100m,gemma-100m; \"none\": no more)" },
  { "micro-batch", "int", nil, "sequences per step (per rank; default 4, with --lora 2)" },
  { "seq-len", "int", nil, "tokens per sequence (default 64, with --lora 128)" },
  { "steps", "int", 3, "timed luazero steps per run (after --warmup steps)" },
  { "warmup", "int", 1, "untimed luazero steps before the timed ones (an MoE builds a GEMM kernel for each new expert row count in its first steps)" },
  { "torch-steps", "int", 2, "timed PyTorch steps per run (after one warm-up step); 0 skips PyTorch" },
  { "hf-steps", "int", 2, "timed transformers (PEFT with --lora) steps per run (after one warm-up step); 0 skips them" },
  { "hf5-steps", "int", 2, "timed transformers 5.23 (torch 2.15) steps per run, eager and sdpa attention; 0 skips them" },
  { "lora", "flag", false, "LoRA mode: adapters of --lora-r on q_proj, v_proj, bf16, one rank, beside PEFT" },
  { "lora-r", "int", 8, "--lora: the adapters' rank" },
  { "profile", "flag", false, "print each luazero run's profile (luazero.profile)" },
  { "threads", "int", 2, "compute threads in all (one rank: all of them; n ranks: threads / n each)" },
  { "ranks", "int", 2, "ranks of the multi-rank runs (1 skips them)" },
  { "stage", "int", 2, "ZeRO stage of the multi-rank runs (0-3)" },
  { "dtypes", "string", "fp32,bf16", "precisions, comma-separated (fp32, bf16)" },
  { "rounds", "int", 1, "times to repeat every run; figures are medians over the rounds" },
  { "gemm", "int", 2048, "size n of the n x n x n yardstick GEMMs" },
  -- internal: one run, in its own process (and ranks)
  { "run", "string", nil, "(internal) run one model in this process: MODEL:DTYPE:STAGE[:LORA_R]" },
  { "peak", "string", nil, "(internal) the yardsticks for --profile: F32,BF16 GFLOP/s" },
}

local function fail(msg)
  io.stderr:write("bench_llama: ", tostring(msg), "\n")
  os.exit(2)
end

local bench = dofile(lz.root .. "/bench/bench_support.lua")
local flags = bench.flags("bench_llama", arg, spec)

if flags.lora then
  flags.gpt2, flags.ranks, flags.torch_steps, flags.hf5_steps = "none", 1, 0, 0
  flags.dtypes = "bf16"
end
flags.model = flags.model or (flags.lora and "tinyllama-1.1b" or "llama-100m")
flags.micro_batch = flags.micro_batch or (flags.lora and 2 or 4)
flags.seq_len = flags.seq_len or (flags.lora and 128 or 64)
local B, T = flags.micro_batch, flags.seq_len
local function at_least(name, v, lo)
  if v < lo then fail(("--%s must be >= %d (got %d)"):format(name, lo, v)) end
end
at_least("micro-batch", B, 1)
at_least("seq-len", T, 1)
at_least("steps", flags.steps, 1)
at_least("warmup", flags.warmup, 1)
at_least("torch-steps", flags.torch_steps, 0)
at_least("hf-steps", flags.hf_steps, 0)
at_least("hf5-steps", flags.hf5_steps, 0)
at_least("lora-r", flags.lora_r, 1)
at_least("threads", flags.threads, 1)
at_least("ranks", flags.ranks, 1)
at_least("rounds", flags.rounds, 1)
at_least("gemm", flags.gemm, 64)
if flags.stage < 0 or flags.stage > 3 then
  fail(("--stage must be 0, 1, 2 or 3 (got %d)"):format(flags.stage))
end
local dtypes = {}
for d in (flags.dtypes .. ","):gmatch("([^,]*),") do
  if d ~= "fp32" and d ~= "bf16" then
    fail(("--dtypes must list fp32 and/or bf16, comma-separated (got '%s')"):format(flags.dtypes))
  end
  dtypes[#dtypes + 1] = d
end

-- A named size of the given family, with --seq-len inside its context.
local function model_config(name, family, flag)
  local ok_, cfg = pcall(models.config, name)
  if not ok_ then fail(("--%s: %s"):format(flag, cfg)) end
  if cfg.family ~= family then
    fail(("--%s: '%s' is not a %s size (%s sizes: %s)"):format(flag, name, family, family,
         table.concat(models.families[family].names, ", ")))
  end
  if T > cfg.context then
    fail(("--seq-len %d is beyond %s's context of %d"):format(T, name, cfg.context))
  end
  return cfg
end

-- FLOPs per token of a config (see the header); lora: adapters train.
local function flops_per_token(cfg, n, lora)
  local attn = cfg.n_head * (cfg.head_dim or cfg.n_embd / cfg.n_head)
  return (lora and 4 or 6) * n + 12 * cfg.n_layer * attn * T
end

--------------------------------------------------------------- one run

-- In its own process (under `luazero -n R` for R ranks): builds the model
-- and the engine, times the steps; rank 0 prints one "bench_llama_run" line.
if flags.run then
  local name, dtype, stage, lora_r = flags.run:match("^([^:]+):([^:]+):(%d):?(%d*)$")
  if not name or (dtype ~= "fp32" and dtype ~= "bf16") or tonumber(stage) > 3 then
    fail(("--run: '%s' is not MODEL:DTYPE:STAGE[:LORA_R] (DTYPE fp32 or bf16, STAGE 0-3)")
         :format(flags.run))
  end
  local ok_, cfg = pcall(models.config, name)
  if not ok_ then fail("--run: " .. cfg) end
  local comm = require("luazero.comm").init()
  local world = comm.size()
  lz.threads(math.max(1, math.floor(flags.threads / world)))
  local rng = require("luazero.rng")
  local zero = require("luazero.zero")
  local model = models.new(cfg)
  -- a position table is looked up, not multiplied: no FLOPs of its own; an
  -- MoE model counts the experts a token runs through (top-k of each block)
  local wpe = model.embedding.p.wpe
  local n_params = model:count_active_params() - (wpe and wpe:numel() or 0)
  if lora_r ~= "" then
    local r = tonumber(lora_r)
    require("models.lora").apply(model, { r = r, alpha = r, targets = { "q_proj", "v_proj" } })
  end
  local engine = zero.initialize({
    model = model, seed = 1, batch = { B, T }, comm = comm,
    config = { train_micro_batch_size_per_gpu = B, gradient_clipping = 1.0,
               bf16 = { enabled = dtype == "bf16" }, zero_optimization = { stage = tonumber(stage) },
               optimizer = { type = "AdamW", params = { lr = 1e-4 } } } })
  local batches = require("luazero.data.random").new(B, T, cfg.vocab, rng.new(1 + comm.rank()))
  for _ = 2, flags.warmup do engine:train_batch(batches) end -- untimed
  local prof = flags.profile and require("luazero.profile").attach(engine)
  engine:train_batch(batches) -- the last untimed step (the profile's warm-up too)
  local ms = {}
  for i = 1, flags.steps do
    local t0 = clock.now()
    engine:train_batch(batches)
    ms[i] = (clock.now() - t0) * 1000
  end
  if comm.rank() == 0 then
    local shown = {}
    for i, v in ipairs(ms) do shown[i] = ("%.1f"):format(v) end
    print(("bench_llama_run params %d world %d threads %d step_ms %s"):format(
          n_params, world, lz.threads(), table.concat(shown, ",")))
    if prof then
      local f32, bf16 = (flags.peak or ""):match("^([%d.]+),([%d.]+)$")
      print(prof:format({ peak = { f32 = tonumber(f32), bf16 = tonumber(bf16) } }))
    end
  end
  if prof then prof:detach() end
  io.stdout:flush()
  engine:free()
  os.exit(0)
end

------------------------------------------------------------- the whole run

local llama_cfg = model_config(flags.model, "llama", "model")
local gpt2_cfg = flags.gpt2 ~= "none" and model_config(flags.gpt2, "gpt2", "gpt2") or nil
local beside = {}
for name in (flags.beside .. ","):gmatch("([^,]*),") do
  if name ~= "none" and name ~= "" then
    local ok_, cfg = pcall(models.config, name)
    if not ok_ then fail("--beside: " .. cfg) end
    if T > cfg.context then
      fail(("--seq-len %d is beyond %s's context of %d"):format(T, name, cfg.context))
    end
    beside[#beside + 1] = cfg
  end
end
local q = bench.quote
local threads = flags.threads

local median = bench.median

-- The yardstick GEMMs run in this process; the training runs are children
-- (fork + exec through the shell), so this process's OpenMP state does not
-- reach them.
local gemm_gflops = bench.gemm_gflops

lz.threads(threads)
local peak = {}
for _, d in ipairs(dtypes) do peak[d] = gemm_gflops(flags.gemm, d) end

local sh = bench.sh

-- One luazero run: tokens/s (all ranks together) from the median step;
-- with --profile, the run's profile table (the lines after its figures).
local function luazero_run(cfg, dtype, ranks, stage)
  local lora = flags.lora and (":" .. flags.lora_r) or ""
  local out = sh(("cd %s && %s %s bench/bench_llama.lua --run %s --micro-batch %d " ..
                  "--seq-len %d --steps %d --warmup %d --threads %d%s")
                 :format(q(lz.root), q(lz.executable()), ranks > 1 and ("-n " .. ranks) or "",
                         q(("%s:%s:%d%s"):format(cfg.name, dtype, stage, lora)), B, T,
                         flags.steps, flags.warmup, threads,
                         flags.profile and (" --profile --peak %.1f,%.1f"):format(
                           peak.fp32 or 0, peak.bf16 or 0) or ""))
  local params, world, th, list =
    out:match("bench_llama_run params (%d+) world (%d+) threads (%d+) step_ms ([%d.,]+)")
  if not params then
    print(("luazero %s %s %d rank(s) failed:\n%s"):format(cfg.name, dtype, ranks, out))
    os.exit(1)
  end
  local ms = {}
  for v in list:gmatch("[%d.]+") do ms[#ms + 1] = tonumber(v) end
  return { tps = ranks * B * T / median(ms) * 1000, ms = ms, params = tonumber(params),
           threads = tonumber(th),
           profile = flags.profile and out:match("\n(profile: .*)$") or nil }
end

-- One Python run (bench_llama_torch.py: PyTorch's Llama written here;
-- bench_llama_hf.py: transformers'): tokens/s and the step times the script
-- printed as PREFIX_tokens_per_s and PREFIX_step_ms. extra: more flags.
local function python_run(python, script, prefix, name, cfg, dtype, steps, extra)
  local out = sh(("%s %s --n-layer %d --n-head %d --n-kv-head %d --n-embd %d --n-hidden %d " ..
                  "--vocab %d --tie %d --eps %g --rope-theta %g --micro-batch %d --seq-len %d " ..
                  "--steps %d --threads %d --dtype %s%s")
                 :format(q(python), q(lz.root .. "/bench/" .. script), cfg.n_layer, cfg.n_head,
                         cfg.n_kv_head, cfg.n_embd, cfg.n_hidden, cfg.vocab, cfg.tie and 1 or 0,
                         cfg.eps, cfg.rope_theta, B, T, steps, threads, dtype, extra or ""))
  local tps = tonumber(out:match(prefix .. "_tokens_per_s ([%d.e+-]+)"))
  local list = out:match(prefix .. "_step_ms ([%d. ]+)")
  if not tps then
    print(("%s %s failed:\n%s"):format(name, dtype, out))
    os.exit(1)
  end
  local ms = {}
  for v in list:gmatch("[%d.]+") do ms[#ms + 1] = tonumber(v) end
  return { tps = tps, ms = ms }
end

-- PyTorch at /usr/bin/python3, when it imports (else its rows are skipped,
-- said in one line).
local torch_missing
if flags.torch_steps > 0 then
  local out = sh(("/usr/bin/python3 -c %s"):format(q("import torch")))
  if out:find("%S") then
    torch_missing = "(torch not importable by /usr/bin/python3: apt-get install python3-torch; " ..
                    "the pytorch rows are skipped)"
  end
end

local function torch_run(cfg, dtype)
  return python_run("/usr/bin/python3", "bench_llama_torch.py", "torch", "pytorch", cfg, dtype,
                    flags.torch_steps)
end

-- transformers (PEFT with --lora) in the reference venv, when it imports.
local HF = flags.lora and "peft" or "transformers"
local hf_python = lz.root .. "/build/ref-venv/bin/python"
local hf_missing
if flags.hf_steps > 0 then
  local need = flags.lora and "transformers, peft" or "transformers"
  local out = sh(("%s -c %s"):format(q(hf_python), q("import " .. need)))
  if out:find("%S") then
    hf_missing = ("(%s not importable by %s: run tools/setup; the %s rows are skipped)")
                 :format(need, hf_python, HF)
  end
end

local function hf_run(cfg, dtype)
  return python_run(hf_python, "bench_llama_hf.py", "hf", HF, cfg, dtype, flags.hf_steps,
                    flags.lora and (" --lora-r %d --lora-targets q_proj,v_proj"):format(flags.lora_r))
end

-- transformers 5.23 over torch 2.15 in the second reference venv (where
-- tests/ref/refenv.py's VENV5 looks), when it imports.
local home = os.getenv("HOME") or ""
local hf5_python = (os.getenv("LZ_REF5_VENV") or ((os.getenv("XDG_CACHE_HOME") or
                    (home .. "/.cache")) .. "/luazero/ref5-venv")) .. "/bin/python"
local hf5_missing
if flags.hf5_steps > 0 then
  local out = sh(("%s -c %s"):format(q(hf5_python), q("import transformers")))
  if out:find("%S") then
    hf5_missing = ("(transformers 5.23 not importable by %s: run tools/setup or set " ..
                   "LZ_REF5_VENV; the transformers5 rows are skipped)"):format(hf5_python)
  end
end

local function hf5_run(cfg, dtype, attn)
  return python_run(hf5_python, "bench_llama_hf.py", "hf", "transformers5 " .. attn, cfg, dtype,
                    flags.hf5_steps, " --attn " .. attn)
end

-- The rows, in the order they run in each round.
local rows = {}
local function add(label, fn, cfg, dtype, ranks)
  rows[#rows + 1] = { label = label, fn = fn, cfg = cfg, dtype = dtype, ranks = ranks, tps = {} }
end
local multi = flags.ranks > 1 and ("%d ranks, stage %d"):format(flags.ranks, flags.stage)
for _, d in ipairs(dtypes) do
  add(("luazero %s %s, 1 rank"):format(llama_cfg.name, d),
      function() return luazero_run(llama_cfg, d, 1, 0) end, llama_cfg, d, 1)
  if gpt2_cfg then
    add(("luazero %s %s, 1 rank"):format(gpt2_cfg.name, d),
        function() return luazero_run(gpt2_cfg, d, 1, 0) end, gpt2_cfg, d, 1)
  end
  for _, cfg in ipairs(beside) do
    add(("luazero %s %s, 1 rank"):format(cfg.name, d),
        function() return luazero_run(cfg, d, 1, 0) end, cfg, d, 1)
  end
  if flags.torch_steps > 0 and not torch_missing then
    add(("pytorch %s %s, 1 rank"):format(llama_cfg.name, d),
        function() return torch_run(llama_cfg, d) end, llama_cfg, d, 1)
  end
  if flags.hf_steps > 0 and not hf_missing then
    add(("%s %s %s, 1 rank"):format(HF, llama_cfg.name, d),
        function() return hf_run(llama_cfg, d) end, llama_cfg, d, 1)
  end
  if flags.hf5_steps > 0 and not hf5_missing then
    for _, attn in ipairs({ "eager", "sdpa" }) do
      add(("transformers5 %s %s %s, 1 rank"):format(attn, llama_cfg.name, d),
          function() return hf5_run(llama_cfg, d, attn) end, llama_cfg, d, 1)
    end
  end
  if multi then
    add(("luazero %s %s, %s"):format(llama_cfg.name, d, multi),
        function() return luazero_run(llama_cfg, d, flags.ranks, flags.stage) end,
        llama_cfg, d, flags.ranks)
    if gpt2_cfg then
      add(("luazero %s %s, %s"):format(gpt2_cfg.name, d, multi),
          function() return luazero_run(gpt2_cfg, d, flags.ranks, flags.stage) end,
          gpt2_cfg, d, flags.ranks)
    end
  end
end

print(("llama %s%s and gpt2 %s, batch %d x %d per rank, %d threads in all, %d round%s")
      :format(llama_cfg.name,
              flags.lora and (" LoRA r%d on q_proj, v_proj"):format(flags.lora_r) or "",
              gpt2_cfg and gpt2_cfg.name or "(none)", B, T, threads,
              flags.rounds, flags.rounds == 1 and "" or "s"))
print(bench.machine())
if torch_missing then print(torch_missing) end
if hf_missing then print(hf_missing) end
if hf5_missing then print(hf5_missing) end
io.stdout:flush()
local n_params = {}
for round = 1, flags.rounds do
  for _, row in ipairs(rows) do
    local res = row.fn()
    row.tps[round] = res.tps
    if res.params then n_params[row.cfg] = res.params end
    local steps = {}
    for i, v in ipairs(res.ms) do steps[i] = ("%.0f"):format(v) end
    print(("  round %d  %-42s %8.1f tokens/s  (step ms %s)"):format(round, row.label, res.tps,
          table.concat(steps, " ")))
    if res.profile then print(res.profile) end
    io.stdout:flush()
  end
end

for _, d in ipairs(dtypes) do peak[d] = math.max(peak[d], gemm_gflops(flags.gemm, d)) end
for _, d in ipairs(dtypes) do
  print(("gemm  %d x %d x %d %s (lz_matmul, oneDNN), %d threads: %.1f GFLOP/s")
        :format(flags.gemm, flags.gemm, flags.gemm, d == "bf16" and "bf16 -> fp32" or "sgemm",
                threads, peak[d]))
end
local all_cfgs = { llama_cfg, gpt2_cfg or false }
for _, cfg in ipairs(beside) do all_cfgs[#all_cfgs + 1] = cfg end
for _, cfg in ipairs(all_cfgs) do
  if cfg and n_params[cfg] then
    print(("model %s: %.1fM parameters (no position table; of MoE experts the top-k), " ..
         "%.2f GFLOP per token%s")
          :format(cfg.name, n_params[cfg] / 1e6,
                  flops_per_token(cfg, n_params[cfg], flags.lora) / 1e9,
                  flags.lora and " (LoRA: 4 N + attention)" or ""))
  end
end

-- Figures: medians over the rounds; ratios: the median of each round's ratio.
local function find(label)
  for _, row in ipairs(rows) do if row.label == label then return row end end
end
print(("%-44s %10s %8s"):format("run", "tokens/s", "MFU"))
local function mfu_of(row, tps)
  local n = n_params[row.cfg] or n_params[llama_cfg]
  return tps * flops_per_token(row.cfg, n, flags.lora) / (peak[row.dtype] * 1e9)
end
for _, row in ipairs(rows) do
  local tps = median(row.tps)
  print(("%-44s %10.1f %7.1f%%"):format(row.label, tps, mfu_of(row, tps) * 100))
end
local function ratio(label, a, b)
  local ra, rb = find(a), find(b)
  if not ra or not rb then return end
  local rs = {}
  for i = 1, flags.rounds do rs[i] = ra.tps[i] / rb.tps[i] end
  print(("ratio %-58s %6.2fx"):format(label, median(rs)))
end
local L, G = llama_cfg.name, gpt2_cfg and gpt2_cfg.name
-- The median over the rounds of a row's MFU over the Llama row's.
local function mfu_ratio(cfg, d)
  local ra = find(("luazero %s %s, 1 rank"):format(cfg.name, d))
  local rb = find(("luazero %s %s, 1 rank"):format(L, d))
  local fa = flops_per_token(cfg, n_params[cfg], flags.lora)
  local fb = flops_per_token(llama_cfg, n_params[llama_cfg], flags.lora)
  local rs = {}
  for i = 1, flags.rounds do rs[i] = ra.tps[i] * fa / (rb.tps[i] * fb) end
  print(("ratio %-58s %6.2fx"):format(("MFU %s / %s, luazero %s"):format(cfg.name, L, d),
        median(rs)))
end
for _, d in ipairs(dtypes) do
  for _, cfg in ipairs(beside) do mfu_ratio(cfg, d) end
  ratio(("luazero / pytorch, %s %s"):format(L, d), ("luazero %s %s, 1 rank"):format(L, d),
        ("pytorch %s %s, 1 rank"):format(L, d))
  ratio(("luazero / %s, %s %s"):format(HF, L, d), ("luazero %s %s, 1 rank"):format(L, d),
        ("%s %s %s, 1 rank"):format(HF, L, d))
  local e5 = find(("transformers5 eager %s %s, 1 rank"):format(L, d))
  local s5 = find(("transformers5 sdpa %s %s, 1 rank"):format(L, d))
  local lzr = find(("luazero %s %s, 1 rank"):format(L, d))
  if e5 and s5 and lzr then
    local rs = {}
    for i = 1, flags.rounds do rs[i] = lzr.tps[i] / math.max(e5.tps[i], s5.tps[i]) end
    print(("ratio %-58s %6.2fx"):format(("luazero / transformers5 (faster attn), %s %s")
          :format(L, d), median(rs)))
  end
  if G then
    ratio(("%s / %s, luazero %s"):format(L, G, d), ("luazero %s %s, 1 rank"):format(L, d),
          ("luazero %s %s, 1 rank"):format(G, d))
  end
  if multi then
    ratio(("%s %s: %s / 1 rank"):format(L, d, multi), ("luazero %s %s, %s"):format(L, d, multi),
          ("luazero %s %s, 1 rank"):format(L, d))
  end
end
if #dtypes == 2 then
  ratio(("bf16 / fp32, luazero %s 1 rank"):format(L), ("luazero %s bf16, 1 rank"):format(L),
        ("luazero %s fp32, 1 rank"):format(L))
  ratio(("bf16 / fp32, pytorch %s"):format(L), ("pytorch %s bf16, 1 rank"):format(L),
        ("pytorch %s fp32, 1 rank"):format(L))
  ratio(("bf16 / fp32, transformers %s"):format(L), ("transformers %s bf16, 1 rank"):format(L),
        ("transformers %s fp32, 1 rank"):format(L))
  for _, attn in ipairs({ "eager", "sdpa" }) do
    ratio(("bf16 / fp32, transformers5 %s %s"):format(attn, L),
          ("transformers5 %s %s bf16, 1 rank"):format(attn, L),
          ("transformers5 %s %s fp32, 1 rank"):format(attn, L))
  end
end
