-- scripts/train.lua — trains a GPT-2 on one rank.
--   luazero scripts/train.lua --model gpt2-nano --data corpus.txt --steps 500 --log run.jsonl
-- Flags: luazero scripts/train.lua --help. Formats and fields: docs/training.md.
local ffi = require("ffi")
local cjson = require("cjson")
local lz = require("luazero")
local args = require("luazero.args")
local clock = require("luazero.clock")
local data = require("luazero.data")
local optim = require("luazero.optim")
local Trainer = require("luazero.trainer")
local gpt2 = require("models.gpt2")

local spec = {
  { "model", "string", "gpt2-nano", "model size: " .. table.concat(gpt2.names, ", ") },
  { "data", "string", nil, "a text file (bytes are tokens) or a token file (tools/prepare-data)" },
  { "steps", "int", 100, "optimizer steps" },
  { "micro-batch", "int", 8, "sequences per micro-batch" },
  { "grad-accum", "int", 1, "micro-batches per optimizer step" },
  { "seq-len", "int", nil, "tokens per sequence (default: the model's context)" },
  { "lr", "number", nil, "peak learning rate (default: the model size's)" },
  { "warmup", "int", nil, "linear warmup steps (default: 10% of --steps, at most 100)" },
  { "seed", "int", 1337, "seed of the initial weights, the batches and the sample" },
  { "dtype", "string", "fp32", "training precision: fp32" },
  { "eval-every", "int", 0, "validation loss every N steps (0: at the end only)" },
  { "eval-batches", "int", 20, "validation batches per evaluation (at most)" },
  { "log", "string", nil, "write one JSON object per step to this file (JSON Lines)" },
  { "sample", "int", 200, "tokens to generate at the end (0: none)" },
  { "n-layer", "int", nil, "override: transformer blocks" },
  { "n-head", "int", nil, "override: attention heads" },
  { "n-embd", "int", nil, "override: embedding width" },
  { "context", "int", nil, "override: the model's number of positions" },
  { "vocab", "int", nil, "override: vocabulary size" },
}

-- A user error: one line on stderr, exit status 2, no traceback.
local function user_error(msg)
  io.stderr:write("train: ", tostring(msg), "\n")
  os.exit(2)
end

-- Runs fn, turning any error it raises into a user error.
local function checked(fn, ...)
  local res = { pcall(fn, ...) }
  if not res[1] then user_error(res[2]) end
  return unpack(res, 2, table.maxn(res))
end

local function positive(flags, name, min)
  local v = flags[name:gsub("-", "_")]
  if v ~= nil and v < min then
    user_error(("--%s must be >= %d (got %s)"):format(name, min, tostring(v)))
  end
end

local function peak_rss()
  local f = io.open("/proc/self/status", "r")
  if not f then return 0 end
  local s = f:read("*a")
  f:close()
  local kb = s:match("VmHWM:%s*(%d+)")
  return kb and tonumber(kb) * 1024 or 0
end

local function mem_record()
  local m = lz.mem()
  m.peak_rss = peak_rss()
  return m
end

local function mib(b) return b / 2 ^ 20 end

local function checksum(t)
  return require("bit").tohex(lz.xxh64(t.data, t:bytes(), 0), 16)
end

local function main(argv)
  local flags, usage = checked(args.parse, argv, spec)
  if not flags then
    print("usage: luazero scripts/train.lua --data FILE [flags]\n" .. usage)
    return
  end
  if not flags.data then
    user_error("--data is required: a text file or a token file made by tools/prepare-data")
  end
  if flags.dtype ~= "fp32" then
    if flags.dtype == "bf16" or flags.dtype == "fp16" then
      user_error(("--dtype %s: not available until the ZeRO engine; use fp32")
                 :format(flags.dtype))
    end
    user_error(("--dtype %s: unknown precision; use fp32"):format(flags.dtype))
  end
  for _, n in ipairs({ "steps", "micro-batch", "grad-accum", "seq-len", "n-layer", "n-head",
                       "n-embd", "context", "vocab" }) do
    positive(flags, n, 1)
  end
  positive(flags, "warmup", 0)
  positive(flags, "eval-every", 0)
  positive(flags, "eval-batches", 0)
  positive(flags, "sample", 0)
  if flags.lr and flags.lr <= 0 then user_error("--lr must be > 0 (got " .. flags.lr .. ")") end

  local cfg = checked(gpt2.config, flags.model, {
    n_layer = flags.n_layer, n_head = flags.n_head, n_embd = flags.n_embd,
    context = flags.context, vocab = flags.vocab,
  })
  local B, T = flags.micro_batch, flags.seq_len or cfg.context
  if T > cfg.context then
    user_error(("--seq-len %d is longer than the model's context %d (%s); use --seq-len %d " ..
                "or less, or --context %d"):format(T, cfg.context, cfg.name, cfg.context, T))
  end
  local steps, accum = flags.steps, flags.grad_accum
  local lr = flags.lr or cfg.lr
  local warmup = flags.warmup or math.min(100, math.floor(steps * 0.1))

  local corpus = checked(data.load, flags.data)
  local loader = checked(data.loader, corpus, { B = B, T = T, seed = flags.seed,
                                                vocab = cfg.vocab })
  local log
  if flags.log then
    local err
    log, err = io.open(flags.log, "w")
    if not log then user_error(("--log %s: cannot write it (%s)"):format(flags.log, err)) end
  end

  local model = gpt2.new(cfg):allocate():init_weights(flags.seed)
  model:prepare(B, T)
  local optimizer = optim.AdamW.new(model.params_flat, model.grads_flat, model.param_table)
  local trainer = Trainer.new({
    model = model, optimizer = optimizer, grad_accum = accum, batches = loader,
    lr = optim.schedule.warmup_cosine(lr, warmup, steps),
  })
  local n_val = math.min(flags.eval_batches, loader.val_batches)

  print(("model %s: %d layers, %d heads, %d embd, context %d, vocab %d; %.2fM parameters")
        :format(cfg.name, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.context, cfg.vocab,
                model:count_params() / 1e6))
  print(("data %s (%s): %d tokens, %d for training, %d held out; %s")
        :format(corpus.path, corpus.kind, corpus.count, loader.n_train, loader.n_val,
                n_val > 0 and ("validation on " .. n_val .. " batches")
                or "the held-out part is too small for one validation batch"))
  print(("batch %d x %d tokens, %d micro-batches per step: %d tokens per step; lr %g, " ..
         "warmup %d, %d steps, %d threads")
        :format(B, T, accum, B * T * accum, lr, warmup, steps, lz.threads()))
  io.stdout:flush()

  local tokens_per_step = B * T * accum
  local comm = { all_reduce = 0, reduce_scatter = 0, all_gather = 0, broadcast = 0, barrier = 0 }
  for step = 1, steps do
    local t0 = clock.now()
    local loss, step_lr, norm = trainer:step()
    local dt = clock.now() - t0
    local rec = {
      step = step, loss = loss, lr = step_lr, grad_norm = norm, loss_scale = 1,
      skipped = false, tokens = step * tokens_per_step, tokens_per_s = tokens_per_step / dt,
      step_ms = dt * 1000, mem = mem_record(), comm = comm,
    }
    local val = ""
    if n_val > 0 and ((flags.eval_every > 0 and step % flags.eval_every == 0) or step == steps) then
      rec.val_loss = trainer:evaluate(loader, n_val)
      val = (" | val %.4f"):format(rec.val_loss)
    end
    if loss ~= loss then user_error(("step %d: the loss is NaN; lower --lr"):format(step)) end
    print(("step %5d/%d | loss %.4f%s | lr %.2e | norm %.3f | %.0f tok/s | %.0f ms | " ..
           "mem %.1f MiB, rss %.0f MiB")
          :format(step, steps, loss, val, step_lr, norm, rec.tokens_per_s, rec.step_ms,
                  mib(tonumber(lz.C.lz_mem_total_current())), mib(rec.mem.peak_rss)))
    io.stdout:flush()
    if log then
      log:write(cjson.encode(rec), "\n")
      log:flush()
    end
  end

  local sum = checksum(model.params_flat)
  if log then
    log:write(cjson.encode({ event = "end", params_checksum = sum }), "\n")
    log:close()
  end
  print("params_checksum " .. sum)

  if flags.sample > 0 then
    local prompt = { cfg.vocab == 50257 and 50256 or (cfg.vocab > 10 and 10 or 0) }
    local ids = model:generate(prompt, flags.sample, flags.seed)
    if cfg.vocab <= 256 then
      print("sample:\n" .. data.decode_bytes(ids))
    else
      print("sample (token ids): " .. table.concat(ids, " "))
    end
  end

  optimizer:free()
  loader:free()
  model:free()
  corpus.tokens:free()
end

main(arg)
