-- bench/bench_optimizers.lua — the optimizers' quality benchmark (not CI): llama-100m's shape
-- as a byte-level model (vocabulary 256, the text's bytes are its tokens) trained on a text
-- with each optimizer from the same initial weights, the same batches and the same schedule,
-- the validation loss every --eval-every steps; then the curves (gnuplot) and the table of
-- final validation losses against fp32 AdamW's.
--   luazero bench/bench_optimizers.lua --data /path/tinyshakespeare.txt --out DIR
--           [--only fp32,bf16,8bit,muon] [--steps 1000] [--micro-batch 2] [--seq-len 32]
--           [--threads 1] [--report-only] [--png docs/optimizers.png]
--           [--runs-file docs/optimizers-runs.json] [--record] [--save-every 50]
-- Each run is scripts/train.lua in its own process, one at a time, its ds_config written to
-- DIR/NAME.json, its log to DIR/NAME.log and its steps to DIR/NAME.jsonl. It saves a
-- checkpoint every --save-every steps into DIR/NAME.ckpt (the newest only): a run stopped
-- midway continues from there, bitwise as if never stopped, when the bench is started again
-- with the same --out, its later steps logged to DIR/NAME.jsonl.2, .3, ...; a run whose log
-- reached --steps is not run again. --report-only reads
-- the .jsonl files already there (of runs finished or still going) and draws and tabulates
-- them without training. A run with no .jsonl in DIR is taken from --runs-file (the
-- validation curves and median step times docs/optimizers.md shows, kept in the repository);
-- --record writes the runs drawn back into it. A run that has not reached --steps is drawn
-- as far as it got, its title saying how far.
local lz = require("luazero")
local json = require("cjson")
local exists = require("luazero.io.fs").exists

-- The optimizers: AdamW's betas, eps, weight decay and lr for all (llama-100m's lr); Muon
-- with Moonlight's lr adjustment, which lets it take AdamW's lr and weight decay, and its
-- Newton-Schulz in bf16 as torch.optim.Muon runs it.
local ADAMW = { lr = 6e-4, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1 }
local function with(extra)
  local t = {}
  for k, v in pairs(ADAMW) do t[k] = v end
  for k, v in pairs(extra) do t[k] = v end
  return t
end
local RUNS = {
  { name = "fp32", title = "AdamW, fp32 moments", optimizer = { type = "AdamW", params = with({}) } },
  { name = "bf16", title = "AdamW, bf16 moments", optimizer = { type = "AdamW",
    params = with({ momentum_dtype = "bfloat16", variance_dtype = "bfloat16" }) } },
  { name = "8bit", title = "AdamW, 8-bit moments", optimizer = { type = "AdamW8bit", params = with({}) } },
  { name = "muon", title = "Muon, bf16 Newton-Schulz (AdamW on the rest)",
    optimizer = { type = "Muon",
    params = { lr = 6e-4, weight_decay = 0.1, adjust_lr_fn = "match_rms_adamw", momentum = 0.95,
               betas = { 0.9, 0.95 }, adam_eps = 1e-8, ns_dtype = "bfloat16" } } },
}

local bench = dofile(lz.root .. "/bench/bench_support.lua")
local flags = bench.flags("bench_optimizers", arg, {
  { "data", "string", nil, "the text to train on (bytes are tokens)" },
  { "out", "string", "/tmp/bench_optimizers", "folder of the configs, logs and curves" },
  { "only", "string", "fp32,bf16,8bit,muon", "the runs, comma-separated" },
  { "steps", "int", 1000, "optimizer steps of each run" },
  { "micro-batch", "int", 2, "sequences per step" },
  { "seq-len", "int", 32, "tokens per sequence" },
  { "eval-every", "int", 50, "validation loss every N steps" },
  { "eval-batches", "int", 16, "validation batches per evaluation" },
  { "threads", "int", 1, "compute threads of each run" },
  { "report-only", "flag", false, "draw and tabulate the runs' logs without training" },
  { "png", "string", nil, "write the curves to this PNG (gnuplot)" },
  { "runs-file", "string", lz.root .. "/docs/optimizers-runs.json",
    "recorded runs, for those with no log in --out" },
  { "record", "flag", false, "write the runs drawn into --runs-file" },
  { "save-every", "int", 50, "a checkpoint of each run every N steps, to continue it if stopped (0: none)" },
})

local function fail(msg)
  io.stderr:write("bench_optimizers: ", msg, "\n")
  os.exit(1)
end

local wanted, chosen = {}, {}
for name in flags.only:gmatch("[^,]+") do wanted[name] = true end
for _, r in ipairs(RUNS) do
  if wanted[r.name] then chosen[#chosen + 1] = r; wanted[r.name] = nil end
end
if next(wanted) then fail("--only: unknown run '" .. next(wanted) .. "' (fp32, bf16, 8bit, muon)") end
os.execute("mkdir -p '" .. flags.out .. "'")

local function path(name, ext) return flags.out .. "/" .. name .. ext end

local function write(p, text)
  local f = assert(io.open(p, "w"))
  f:write(text)
  f:close()
end

-- A run's logs in order: DIR/NAME.jsonl, then one DIR/NAME.jsonl.K for each time it
-- was continued from its checkpoint.
local function logs(name)
  local files, k = {}, 1
  while true do
    local p = path(name, ".jsonl") .. (k == 1 and "" or "." .. k)
    if not exists(p) then return files, p end
    files[#files + 1], k = p, k + 1
  end
end

-- (step, validation loss) pairs of a run's logs, its median step time (ms) and the steps it
-- has made; from the recorded runs (saved) where DIR has no log of it. Defined below.
local curve

local function train(r)
  if not flags.data then fail("--data: the text to train on is required to train") end
  local ckpt = path(r.name, ".ckpt")
  local resume = flags.save_every > 0 and exists(ckpt .. "/latest")
  local _, _, made = curve(r, {})
  if resume and made and made >= flags.steps then
    print(("bench_optimizers: %s: already made its %d steps (%s)"):format(r.name, flags.steps, ckpt))
    return
  end
  local log
  if resume then
    _, log = logs(r.name)
  else
    for _, p in ipairs((logs(r.name))) do os.remove(p) end
    log = path(r.name, ".jsonl")
  end
  local warmup = math.max(2, math.min(100, math.floor(flags.steps / 10)))
  write(path(r.name, ".json"), json.encode({
    train_micro_batch_size_per_gpu = flags.micro_batch, gradient_clipping = 1.0,
    optimizer = r.optimizer,
    scheduler = { type = "WarmupCosineLR", params = { warmup_num_steps = warmup,
                  total_num_steps = flags.steps, warmup_min_ratio = 0, cos_min_ratio = 0.1 } } }))
  local save = flags.save_every > 0 and ("--save '%s' --save-every %d --keep 1 %s"):format(ckpt,
               flags.save_every, resume and ("--resume '%s'"):format(ckpt) or "") or ""
  local cmd = ("OMP_NUM_THREADS=%d '%s/build/bin/luazero' '%s/scripts/train.lua' --model llama-100m " ..
               "--vocab 256 --data '%s' --steps %d --micro-batch %d --seq-len %d --eval-every %d " ..
               "--eval-batches %d --seed 1337 --sample 0 --config '%s' --log '%s' %s >> '%s' 2>&1")
              :format(flags.threads, lz.root, lz.root, flags.data, flags.steps, flags.micro_batch,
                      flags.seq_len, flags.eval_every, flags.eval_batches, path(r.name, ".json"),
                      log, save, path(r.name, ".log"))
  if not resume then os.remove(path(r.name, ".log")) end
  print(("bench_optimizers: %s: %s (%s)"):format(r.name, resume and "continuing from " .. ckpt
        or "training", path(r.name, ".log")))
  io.stdout:flush()
  local rc = os.execute(cmd)
  if rc ~= 0 and rc ~= true then print(("bench_optimizers: %s: failed, see %s"):format(r.name, path(r.name, ".log"))) end
end

-- The recorded runs: name -> { steps, median_step_ms, val_loss = { { step, loss }, ... } }.
local function recorded()
  local f = io.open(flags.runs_file)
  if not f then return {} end
  local text = f:read("*a")
  f:close()
  local okj, rec = pcall(json.decode, text)
  if not okj or type(rec) ~= "table" or type(rec.runs) ~= "table" then
    fail(flags.runs_file .. ": not a runs file ({\"runs\": {NAME: {...}}}); remove it or fix it")
  end
  return rec.runs
end

function curve(r, saved)
  local files = logs(r.name)
  if #files == 0 then
    local s = saved[r.name]
    if not s then return nil end
    return s.val_loss, s.median_step_ms, s.steps
  end
  -- a continued run repeats the steps after its checkpoint: the later log's record counts
  local val, ms, last = {}, {}, 0
  for _, p in ipairs(files) do
    local f = assert(io.open(p))
    for line in f:lines() do
      local okj, rec = pcall(json.decode, line)
      if okj and type(rec) == "table" and rec.step then
        if rec.val_loss then val[rec.step] = rec.val_loss end
        if rec.step_ms and rec.step > 1 then ms[rec.step] = rec.step_ms end
        last = math.max(last, rec.step)
      end
    end
    f:close()
  end
  local points, times = {}, {}
  for step, loss in pairs(val) do points[#points + 1] = { step, loss } end
  table.sort(points, function(a, b) return a[1] < b[1] end)
  for _, t in pairs(ms) do times[#times + 1] = t end
  table.sort(times)
  return points, times[math.max(1, math.ceil(#times / 2))], last
end

if not flags.report_only then for _, r in ipairs(chosen) do train(r) end end

local curves, base, saved = {}, nil, recorded()
for _, r in ipairs(chosen) do
  local points, ms, steps = curve(r, saved)
  if points and #points > 0 then
    -- a run still going (or stopped early) says how far it got
    local title = steps < flags.steps and ("%s, %d of %d steps"):format(r.title, steps, flags.steps)
                  or r.title
    curves[#curves + 1] = { run = r, points = points, ms = ms, steps = steps, title = title }
    if r.name == "fp32" then base = points end
  end
end
if #curves == 0 then fail("no run has a validation loss yet in " .. flags.out) end

if flags.record then
  local runs = saved
  for _, c in ipairs(curves) do
    runs[c.run.name] = { steps = c.steps, median_step_ms = c.ms, val_loss = c.points }
  end
  local lines, names = {}, {}
  for name in pairs(runs) do names[#names + 1] = name end
  table.sort(names)
  for i, name in ipairs(names) do
    lines[i] = ("    %s: %s"):format(json.encode(name), json.encode(runs[name]))
  end
  write(flags.runs_file, '{"runs": {\n' .. table.concat(lines, ",\n") .. "\n}}\n")
  print("bench_optimizers: runs recorded in " .. flags.runs_file)
end

local function at(points, step)
  for _, p in ipairs(points) do if p[1] == step then return p[2] end end
end

print(("| optimizer | steps | final validation loss | vs fp32 AdamW | median step |"))
print("| --- | --- | --- | --- | --- |")
for _, c in ipairs(curves) do
  local last = c.points[#c.points]
  local ref = base and at(base, last[1])
  print(("| %s | %d | %.4f | %s | %s |"):format(c.title, last[1], last[2],
        ref and ("%+.2f%%"):format((last[2] / ref - 1) * 100) or "n/a",
        c.ms and ("%.2f s"):format(c.ms / 1000) or "n/a"))
end

if flags.png then
  local dat = {}
  for i, c in ipairs(curves) do
    local lines = {}
    for _, p in ipairs(c.points) do lines[#lines + 1] = ("%d %.6f"):format(p[1], p[2]) end
    dat[i] = path(c.run.name, ".dat")
    write(dat[i], table.concat(lines, "\n") .. "\n")
  end
  local plots = {}
  for i, c in ipairs(curves) do
    plots[i] = ("'%s' using 1:2 with linespoints pt 7 ps 0.5 lw 2 title '%s'"):format(dat[i], c.title)
  end
  write(path("curves", ".gp"), table.concat({
    "set terminal pngcairo size 900,560 font 'sans,11'",
    ("set output '%s'"):format(flags.png),
    ("set title 'llama-100m shape, bytes of tinyshakespeare, batch %d x %d, %d steps'")
      :format(flags.micro_batch, flags.seq_len, flags.steps),
    "set xlabel 'optimizer step'", "set ylabel 'validation loss (nats per byte)'",
    "set grid", "set key top right",
    "plot " .. table.concat(plots, ", \\\n     "), "" }, "\n"))
  if os.execute("gnuplot '" .. path("curves", ".gp") .. "'") ~= 0 and not io.open(flags.png) then
    fail("gnuplot failed on " .. path("curves", ".gp"))
  end
  print("bench_optimizers: curves in " .. flags.png)
end
