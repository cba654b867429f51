-- test_generate.lua — decoding with a key/value cache (lua/luazero/generate.lua,
-- CausalLM:forward_cached, core/kernels/attention_decode.c): its logits are
-- the full forward's, position by position, for GPT-2 (learned positions)
-- and Llama (rotary, grouped-query), prompt by prompt or rows of different
-- lengths together; a bf16 cache stays close; the choice of the next token
-- (greedy, top-k, top-p, eos); and the kernel's refusals. Then the
-- scripts: a checkpoint's scripts/eval.lua loss is the val_loss
-- scripts/train.lua --val-data logged for it, and scripts/generate.lua
-- continues prompts from a checkpoint as luazero.generate does.
local ffi = require("ffi")
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local models = require("models.registry")
local generate = require("luazero.generate")

local T = {}
local eq = support.eq

local function model_of(name, overrides, seed)
  local m = models.new(models.config(name, overrides))
  m:allocate()
  m:init_weights(seed or 5)
  return m
end

local function ids_tensor(ids)
  return lz.from_table(ids, { 1, #ids }, "i32", "workspace")
end

-- Pseudo-random token ids below V.
local function some_ids(n, V, k)
  local ids = {}
  for i = 1, n do ids[i] = (i * 7919 + (k or 0) * 104729) % V end
  return ids
end

-- The full forward's logits of `ids`, a host copy [#ids * Vp].
local function full_logits(m, ids)
  m:prepare(1, #ids)
  local t = ids_tensor(ids)
  local _, logits = m:forward(t, nil)
  local copy = lz.tensor({ logits:numel() }, "f32", "workspace"):copy(logits:view(0, { logits:numel() }))
  t:free()
  return copy
end

-- The largest difference between position t's logits of the cached run
-- (row b of logits [B, T', Vp] at t') and the full forward's.
local function max_diff(cached, b, tc, full, t, V)
  local Tc, Vp = cached:dim(2), cached:dim(3)
  local a = ffi.cast("float *", cached.data) + ((b - 1) * Tc + tc) * Vp
  local f = ffi.cast("float *", full.data) + t * Vp
  local d = 0
  for j = 0, V - 1 do d = math.max(d, math.abs(a[j] - f[j])) end
  return d
end

-- Prompt of 5 in one call, then one position per call: every position's
-- logits within tol of the full forward's over the same ids.
local function check_cached_equals_full(m, dtype, tol)
  local V, n, k = m.cfg.vocab, 12, 5
  local ids = some_ids(n, V)
  local full = full_logits(m, ids)
  local cache = generate.Cache.new(m, 1, n, dtype)
  local prompt = ids_tensor({ unpack(ids, 1, k) })
  m:prepare(1, n)
  local logits = m:forward_cached(prompt, cache)
  local worst = 0
  for t = 0, k - 1 do worst = math.max(worst, max_diff(logits, 1, t, full, t, V)) end
  for t = k, n - 1 do
    local one = ids_tensor({ ids[t + 1] })
    logits = m:forward_cached(one, cache)
    worst = math.max(worst, max_diff(logits, 1, 0, full, t, V))
    one:free()
  end
  eq(cache.at[1], n, "positions cached")
  prompt:free(); full:free(); cache:free()
  assert(worst <= tol, ("%s cache: logits differ from the full forward's by %g (tolerance %g)")
         :format(dtype, worst, tol))
  return worst
end

function T.gpt2_cached_logits_equal_the_full_forward()
  local m = model_of("gpt2-nano", { n_layer = 2, n_embd = 64, n_head = 4, context = 32 })
  check_cached_equals_full(m, "f32", 1e-5)
  m:free()
end

function T.llama_cached_logits_equal_the_full_forward()
  local m = model_of("llama-tiny", { context = 32 })
  check_cached_equals_full(m, "f32", 1e-5)
  m:free()
end

-- A prompt's call with `last` gives each row's last logits alone, within
-- 1e-5 of the call's without it (the head runs on one position); and no
-- block's activations outlive the next block, so the arena's peak over a
-- prompt stays far below a training forward's of the same shape.
function T.a_prompt_keeps_one_block_and_with_last_its_last_logits()
  local m = model_of("llama-tiny", { context = 32, n_layer = 6 })
  local V, Vp, n = m.cfg.vocab, m.cfg.padded_vocab, 16
  local ids = some_ids(n, V, 3)
  m:prepare(1, n)
  local prompt = ids_tensor(ids)
  local cache = generate.Cache.new(m, 1, n, "f32")
  local all = m:forward_cached(prompt, cache)
  eq(all:dim(2), n, "positions without last")
  local want = lz.tensor({ Vp }, "f32", "workspace"):copy(all:view((n - 1) * Vp, { Vp }))
  local cached_peak = m.ctx.arena:peak()
  cache:set(1, 0)
  local last = m:forward_cached(prompt, cache, true)
  eq(last:dim(1), 1, "rows")
  eq(last:dim(2), 1, "positions with last")
  local a, w, worst = ffi.cast("float *", last.data), ffi.cast("float *", want.data), 0
  for j = 0, V - 1 do worst = math.max(worst, math.abs(a[j] - w[j])) end
  assert(worst <= 1e-5, ("last logits differ by %g"):format(worst))
  m:forward(prompt, nil)
  local full_peak = m.ctx.arena:peak()
  assert(cached_peak < full_peak / 2,
         ("a prompt's arena peak %d against a forward's %d"):format(cached_peak, full_peak))
  want:free(); prompt:free(); cache:free(); m:free()
end

-- A windowed model keeps a ring of W positions a layer, and a prompt
-- longer than the ring still matches the full (windowed) forward.
function T.windowed_cache_is_a_ring_of_the_window()
  local m = model_of("mistral-tiny", { context = 32, window = 3 })
  local cache = generate.Cache.new(m, 2, 12, "f32")
  eq(cache.layers[1].k:dim(2), 3, "ring positions")
  cache:free()
  check_cached_equals_full(m, "f32", 1e-5)
  m:free()
end

-- A bf16 cache rounds keys and values once: close, not the same.
function T.bf16_cache_is_close_to_the_full_forward()
  local m = model_of("llama-tiny", { context = 32 })
  local worst = check_cached_equals_full(m, "bf16", 5e-2)
  assert(worst > 0, "a bf16 cache should round something")
  m:free()
end

-- Heads of 32 (a whole bf16 vector pair) decode on the bf16 attention
-- kernel's path where the CPU has it (the query rounded too), else in fp32.
function T.bf16_cache_with_heads_of_32_is_close_to_the_full_forward()
  local m = model_of("llama-tiny", { context = 32, n_head = 2, n_kv_head = 1 })
  eq(m.cfg.n_embd / m.cfg.n_head, 32, "head size")
  local worst = check_cached_equals_full(m, "bf16", 5e-2)
  assert(worst > 0, "a bf16 cache should round something")
  m:free()
end

-- Rows of different lengths decode together: row b at its own position
-- (GPT-2's position table and Llama's rotation per row).
function T.rows_at_different_positions_decode_together()
  for _, spec in ipairs({ { "gpt2-nano", { n_layer = 2, n_embd = 64, n_head = 4, context = 32 } },
                          { "llama-tiny", { context = 32 } } }) do
    local m = model_of(spec[1], spec[2])
    local V = m.cfg.vocab
    local rows = { some_ids(9, V, 1), some_ids(4, V, 2), some_ids(7, V, 3) }
    local steps = 3
    local fulls = {}
    for b, ids in ipairs(rows) do fulls[b] = full_logits(m, ids) end
    local cache = generate.Cache.new(m, 3, 9, "f32")
    m:prepare(1, 9)
    local prompt_len = { 6, 1, 4 }
    for b, ids in ipairs(rows) do
      local p = ids_tensor({ unpack(ids, 1, prompt_len[b]) })
      m:forward_cached(p, cache:row(b))
      p:free()
    end
    eq(cache.at[2], 1, "row 2's cached positions")
    local worst = 0
    for s = 0, steps - 1 do
      local next_ids = {}
      for b = 1, 3 do next_ids[b] = rows[b][prompt_len[b] + s + 1] end
      local t = lz.from_table(next_ids, { 3, 1 }, "i32", "workspace")
      local logits = m:forward_cached(t, cache)
      for b = 1, 3 do
        worst = math.max(worst, max_diff(logits, b, 0, fulls[b], prompt_len[b] + s, V))
      end
      t:free()
    end
    for _, f in ipairs(fulls) do f:free() end
    cache:free()
    m:free()
    assert(worst <= 1e-5, ("%s: batched rows differ by %g"):format(spec[1], worst))
  end
end

-- Greedy continuation through the cache is the argmax of the full forward
-- over the growing sequence, token for token.
function T.greedy_run_follows_the_full_forward()
  local m = model_of("llama-tiny", { context = 32 }, 11)
  local V = m.cfg.vocab
  local prompts = { some_ids(5, V, 1), some_ids(2, V, 2) }
  local outs = generate.run(m, prompts, { max_new = 6, temperature = 0 })
  for i, p in ipairs(prompts) do
    local seq = { unpack(p) }
    for k = 1, 6 do
      local full = full_logits(m, seq)
      local row = ffi.cast("float *", full.data) + (#seq - 1) * m.cfg.padded_vocab
      local want = generate.pick(row, V, { temperature = 0 })
      full:free()
      eq(outs[i].ids[k], want, ("prompt %d, new token %d"):format(i, k))
      seq[#seq + 1] = want
    end
    eq(outs[i].reason, "length", "reason")
  end
  m:free()
end

-- eos ends a row (the id kept); stop() ends it; the context ends it.
function T.rows_end_at_eos_stop_or_the_context()
  local m = model_of("gpt2-nano", { n_layer = 2, n_embd = 64, n_head = 4, context = 16 }, 3)
  local V = m.cfg.vocab
  local prompt = some_ids(4, V)
  local free_run = generate.run(m, { prompt }, { max_new = 8 })[1]
  local eos_id = free_run.ids[3]
  local first = 1
  while free_run.ids[first] ~= eos_id do first = first + 1 end
  local o = generate.run(m, { prompt, prompt }, { max_new = 8, eos = { [eos_id] = true } })
  for i = 1, 2 do
    eq(#o[i].ids, first, "ids up to eos")
    eq(o[i].reason, "eos", "reason")
  end
  o = generate.run(m, { prompt }, { max_new = 8, stop = function(_, ids) return #ids == 2 end })[1]
  eq(#o.ids, 2, "ids up to stop"); eq(o.reason, "stop", "reason")
  o = generate.run(m, { some_ids(10, V) }, { max_new = 100 })[1]
  eq(#o.ids, 7, "ids up to the context (16 - 10 + 1)"); eq(o.reason, "context", "reason")
  -- a prompt that fills the context still gives one token (its last
  -- position's logits), beside a row that goes on; one past it is refused
  local outs = generate.run(m, { some_ids(16, V), prompt }, { max_new = 3 })
  eq(#outs[1].ids, 1, "one id after a full context"); eq(outs[1].reason, "context", "reason")
  eq(#outs[2].ids, 3, "the other row"); eq(outs[2].reason, "length", "reason")
  local ok, err = pcall(generate.run, m, { some_ids(17, V) }, { max_new = 3 })
  assert(not ok and tostring(err):find("prompt 1 has 17 tokens; the model's context is 16", 1, true),
         tostring(err))
  m:free()
end

-- Sampling: top_k = 1 is greedy; a seed repeats; top_p keeps the likeliest.
function T.sampling_follows_temperature_top_k_and_top_p()
  local V = 5
  local row = ffi.new("float[5]", { 1.0, 3.0, 2.0, 3.0, -1.0 })
  eq(generate.pick(row, V, { temperature = 0 }), 1, "greedy takes the first largest")
  local r = require("luazero.rng").new(1, 4)
  local tied = {}
  for _ = 1, 100 do
    local k1 = generate.pick(row, V, { temperature = 1, top_k = 1 }, r)
    assert(k1 == 1 or k1 == 3, "top_k 1 keeps the largest and its ties; got " .. k1)
    tied[k1] = true
  end
  assert(tied[1] and tied[3], "top_k 1 keeps both ids tied for the largest")
  local plain = ffi.new("float[5]", { 1.0, 3.5, 2.0, 3.0, -1.0 })
  for _ = 1, 20 do
    eq(generate.pick(plain, V, { temperature = 1, top_k = 1 }, r), 1, "top_k 1 is greedy")
  end
  local seen = {}
  for _ = 1, 200 do
    local id = generate.pick(row, V, { temperature = 1, top_p = 0.5 }, r)
    seen[id] = true
  end
  -- p(1) = p(3) ~ 0.4 each: the set reaching 0.5 is {1, 3}
  assert(seen[1] and seen[3] and not seen[0] and not seen[2] and not seen[4],
         "top_p 0.5 keeps ids 1 and 3")
  -- the draw follows the softmax
  local count, n = { [0] = 0, 0, 0, 0, 0 }, 4000
  for _ = 1, n do
    local id = generate.pick(row, V, { temperature = 1 }, r)
    count[id] = count[id] + 1
  end
  local z = 0
  for j = 0, 4 do z = z + math.exp(row[j]) end
  for j = 0, 4 do
    local want = math.exp(row[j]) / z
    assert(math.abs(count[j] / n - want) < 0.03,
           ("id %d drawn %.3f of the time, softmax %.3f"):format(j, count[j] / n, want))
  end
  local a, b = {}, {}
  local ra, rb = require("luazero.rng").new(9, 4), require("luazero.rng").new(9, 4)
  for i = 1, 10 do
    a[i] = generate.pick(row, V, { temperature = 2 }, ra)
    b[i] = generate.pick(row, V, { temperature = 2 }, rb)
  end
  eq(table.concat(a, ","), table.concat(b, ","), "one seed, one draw")
end

function T.decode_kernel_refuses_a_full_cache()
  local m = model_of("llama-tiny", { context = 32 })
  local cache = generate.Cache.new(m, 1, 4, "f32")
  m:prepare(1, 8)
  local t = ids_tensor(some_ids(5, 256))
  local ok, err = pcall(m.forward_cached, m, t, cache)
  assert(not ok and tostring(err):find("row 0 holds 0 cached positions and 5 new ones come; " ..
                                       "the cache has room for 4", 1, true), tostring(err))
  t:free(); cache:free(); m:free()
end

------------------------------------------------------------- scripts

local q = support.quote
local MODEL = "--model gpt2-nano --n-layer 2 --n-embd 64 --n-head 4 --context 32 --seq-len 16 " ..
              "--micro-batch 2 --sample 0 --seed 7 "

local function corpus(n, k)
  local lines = {}
  for i = 1, n do lines[i] = ("line %d of part %d: %d words\n"):format(i, k, (i * 7919) % 1000) end
  return table.concat(lines)
end

local function script(name, flags)
  return support.sh(("cd %s && %s scripts/%s.lua %s"):format(q(lz.root), q(lz.executable()),
                                                            name, flags))
end

-- The checkpoint of a short run validated on --val-data, its log and files.
local function trained(extra)
  local write, dir = support.scratch()
  local train, val = write("train.txt", corpus(300, 1)), write("val.txt", corpus(40, 2))
  local out, st = script("train", MODEL .. ("--data %s --val-data %s --steps 3 --eval-batches " ..
                                            "1000 --save %s/ck --log %s/log.jsonl %s")
                                          :format(q(train), q(val), dir, dir, extra or ""))
  assert(st == 0, out)
  assert(out:find(" held out in --val-data " .. val, 1, true), out)
  return dir, train, val, out
end

function T.eval_of_a_checkpoint_is_the_val_loss_train_logged()
  for _, dtype in ipairs({ "fp32", "bf16" }) do
    local dir, train, val = trained("--dtype " .. dtype)
    local recs = support.records(dir .. "/log.jsonl")
    local logged = assert(recs[3].val_loss, "step 3 logs val_loss")
    -- The run at its saved step prints the loss of the weights to the last bit.
    local again, st = script("train", MODEL .. ("--data %s --val-data %s --steps 3 " ..
                             "--eval-batches 1000 --resume %s/ck --dtype %s")
                             :format(q(train), q(val), dir, dtype))
    assert(st == 0, again)
    local exact = assert(again:match("val_loss (%S+)"), again)
    local out, st2 = script("eval", ("--load %s/ck --data %s --seq-len 16"):format(dir, q(val)))
    assert(st2 == 0, out)
    eq(out:match("val_loss (%S+)"), exact, dtype .. ": eval's loss, to the last bit")
    assert(math.abs(tonumber(exact) - logged) <= 1e-12 * logged, dtype .. ": the logged val_loss")
    local batches = tonumber(out:match("over (%d+) batches"))
    -- 40 lines of the val file, in windows of 2 x 16 tokens
    local f = io.open(val, "rb"); local n = #f:read("*a"); f:close()
    eq(batches, math.floor((n - 1) / 32), "eval walks the whole file")
    local ppl = tonumber(out:match("perplexity (%S+)"))
    assert(math.abs(ppl - math.exp(tonumber(exact))) < 1e-3, "perplexity is exp(loss)")
    out = script("eval", ("--load %s/ck --data %s --seq-len 16 --max-batches 2 --json")
                         :format(dir, q(val)))
    eq(require("cjson").decode(out).batches, 2, "--max-batches")
  end
end

function T.generate_continues_prompts_from_a_checkpoint()
  local dir = trained()
  local out, st = script("generate", ("--load %s/ck --prompt-ids 108,105,110 --prompt 'line 7' " ..
                                      "--max-new-tokens 5 --out %s/o.jsonl --stats")
                                     :format(dir, dir))
  assert(st == 0, out)
  -- --stats: both prompts' 9 tokens, then 4 steps of 2 rows (each prompt's
  -- forward gives its first token)
  assert(out:find("generate: prompts 9 tokens in [%d.]+ s %([%d.]+ tokens/s%); 8 new tokens " ..
                  "after them in [%d.]+ s %([%d.]+ tokens/s, rows of up to 8 together%)"), out)
  local recs = support.records(dir .. "/o.jsonl")
  eq(#recs, 2, "one record per prompt")
  -- --prompt first, then --prompt-ids
  eq(table.concat(recs[1].prompt_ids, ","), "108,105,110,101,32,55", "'line 7' as bytes")
  eq(table.concat(recs[2].prompt_ids, ","), "108,105,110", "prompt ids")
  -- The same continuation as luazero.generate on the checkpoint's weights.
  local w = require("luazero.inference").open({ models = models, load = dir .. "/ck" })
  local o = generate.run(w.model, { { 108, 105, 110 } }, { max_new = 5 })
  w.free()
  eq(table.concat(recs[2].ids, ","), table.concat(o[1].ids, ","), "greedy ids")
  eq(#recs[2].ids, 5, "--max-new-tokens"); eq(recs[2].finish, "length", "finish")
  -- A completion the context (32) cuts before --max-new-tokens is said.
  out, st = script("generate", ("--load %s/ck --prompt-ids 108,105,110 --max-new-tokens 40")
                               :format(dir))
  assert(st == 0 and out:find("generate: completion 1 stopped at the model's context of 32 " ..
                              "tokens, before --max-new-tokens 40", 1, true), out)
  out, st = script("generate", ("--load %s/ck --prompt hi --top-p 0"):format(dir))
  assert(st == 2 and out:find("generate: --top-p must be in (0, 1]", 1, true), out)
  -- ids past the vocabulary, refused by the flag (not in the embedding kernel)
  out, st = script("generate", ("--load %s/ck --prompt-ids 1,300"):format(dir))
  assert(st == 2 and out:find("generate: --prompt-ids: token id 300 is not below the model's " ..
                              "vocabulary 256", 1, true), out)
  -- a luazero checkpoint given as PEFT's adapters: where it goes instead
  out, st = support.sh(("cd %s && %s tools/ckpt.lua export %s/ck %s/hf"):format(q(lz.root),
                       q(lz.executable()), dir, dir))
  assert(st == 0, out)
  out, st = script("generate", ("--hf %s/hf --adapters %s/ck --prompt hi"):format(dir, dir))
  assert(st == 2 and out:find(dir .. "/ck is a luazero checkpoint: give it to --load", 1, true),
         out)
  out, st = script("generate", ("--load %s/ck"):format(dir))
  assert(st == 2 and out:find("no prompt: give --prompt TEXT", 1, true), out)
  out, st = script("generate", ("--load %s/ck --prompt x --chat"):format(dir))
  assert(st == 2 and out:find("--chat needs the model's Hugging Face folder", 1, true), out)
  -- An empty --stop would cut every completion to nothing.
  out, st = script("generate", ("--load %s/ck --prompt hi --stop ''"):format(dir))
  assert(st == 2 and out:find("generate: --stop '' matches at every position", 1, true), out)
  -- --out naming the --prompts file would empty it: refused, the prompts intact.
  local prompts = dir .. "/prompts.txt"
  local f = assert(io.open(prompts, "wb")); f:write("line 7\n"); f:close()
  out, st = script("generate", ("--load %s/ck --prompts %s --out %s"):format(dir, prompts, prompts))
  assert(st == 2 and out:find("--out", 1, true) and out:find("--prompts", 1, true), out)
  f = assert(io.open(prompts, "rb")); eq(f:read("*a"), "line 7\n", "the prompts stay whole"); f:close()
  -- A prompts file that is not UTF-8 (here Latin-1 "caf\xE9") is named with line and byte.
  f = assert(io.open(prompts, "wb")); f:write("ok\n{\"prompt\": \"caf\233\"}\n"); f:close()
  out, st = script("generate", ("--load %s/ck --prompts %s"):format(dir, prompts))
  assert(st == 2 and out:find(("--prompts %s: line 2 is not UTF-8 (byte 16 of the line is 0xE9); " ..
                               "save the file as UTF-8"):format(prompts), 1, true), out)
  -- prompt_ids that are not whole numbers are named (2.5 was read as 2).
  f = assert(io.open(prompts, "wb")); f:write('{"prompt_ids": [108, 2.5]}\n'); f:close()
  out, st = script("generate", ("--load %s/ck --prompts %s"):format(dir, prompts))
  assert(st == 2 and out:find("line 1: prompt_ids[1] is 2.5, not a token id", 1, true), out)
  -- A text file's line that is not a prompt object is a prompt as written,
  -- "{" or not; in a .jsonl file it is refused.
  f = assert(io.open(prompts, "wb")); f:write('{"prompt": "ab"}\n{"x": 1}\n'); f:close()
  out, st = script("generate", ("--load %s/ck --prompts %s --max-new-tokens 1 --out %s/p.jsonl")
                               :format(dir, prompts, dir))
  assert(st == 0, out)
  local p = support.records(dir .. "/p.jsonl")
  eq(table.concat(p[1].prompt_ids, ","), "97,98", "the object's prompt")
  eq(#p[2].prompt_ids, #'{"x": 1}', "the other line as written")
  local jl = dir .. "/prompts.jsonl"
  f = assert(io.open(jl, "wb")); f:write('{"prompt": "ab"}\n{"x": 1}\n'); f:close()
  out, st = script("generate", ("--load %s/ck --prompts %s"):format(dir, jl))
  assert(st == 2 and out:find(("--prompts %s: line 2 is not a JSON object with"):format(jl), 1,
                              true), out)
end

-- A checkpoint of one step of MODEL (with `extra` flags) on data, in
-- dir/ck, and its export, dir/hf. Returns tools/ckpt's command line.
local function exported(dir, data, extra)
  local out, st = script("train", MODEL .. (extra or "") ..
                                  (" --data %s --steps 1 --save %s/ck"):format(q(data), dir))
  assert(st == 0, out)
  local ckpt = ("%s %s"):format(q(lz.executable()), q(lz.root .. "/tools/ckpt.lua"))
  out, st = support.sh(("%s export %s/ck %s/hf"):format(ckpt, dir, dir))
  assert(st == 0, out)
  return ckpt
end

-- A Hugging Face folder's generation_config.json eos_token_id ends a
-- completion as config.json's does (transformers' generate stops at both).
-- A --seq-len past a GPT-2 folder's position table: --context cannot grow
-- the table --init loads, so the refusal does not offer it.
function T.a_learned_position_tables_context_is_not_offered_to_grow()
  local write, dir = support.scratch()
  local data = write("d.txt", corpus(200, 6))
  exported(dir, data)
  local out, st = script("train", ("--init %s/hf --data %s --seq-len 64 --steps 0"):format(dir,
                                                                                      q(data)))
  assert(st == 2 and out:find("use --seq-len 32 or less (its position table, from --init, " ..
                              "holds 32 positions)", 1, true) and not out:find("--context", 1, true),
         out)
end

function T.generation_configs_eos_ends_a_completion()
  local write, dir = support.scratch()
  exported(dir, write("d.txt", corpus(200, 6)))
  local function gen()
    local o, s = script("generate", ("--hf %s/hf --prompt-ids 108,105 --max-new-tokens 8 " ..
                                     "--out %s/g.jsonl"):format(dir, dir))
    assert(s == 0, o)
    return support.records(dir .. "/g.jsonl")[1]
  end
  local free = gen()
  eq(free.finish, "length", "without an eos")
  local eos = free.ids[3]
  local n = 1
  while free.ids[n] ~= eos do n = n + 1 end
  support.write(dir .. "/hf/generation_config.json",
                require("cjson").encode({ eos_token_id = { 99999, eos } }))
  local r = gen()
  eq(r.finish, "eos", "finish"); eq(#r.ids, n, "ids up to the eos")
  -- A model trained from that folder exports its bos and eos ids and the
  -- generation_config.json (transformers' generate would take its config's
  -- defaults and stop elsewhere): the export generates as the folder does.
  local cjson = require("cjson")
  local cfg = cjson.decode(lz.read_file(dir .. "/hf/config.json"))
  cfg.bos_token_id, cfg.eos_token_id = 5, { 7, eos }
  support.write(dir .. "/hf/config.json", cjson.encode(cfg))
  local out, st = script("train", ("--init %s/hf --data %s/d.txt --seq-len 16 --micro-batch 2 " ..
                                   "--sample 0 --steps 1 --lr 1e-9 --save %s/ck2"):format(dir, dir, dir))
  assert(st == 0, out)
  local ckpt = ("%s %s"):format(q(lz.executable()), q(lz.root .. "/tools/ckpt.lua"))
  out, st = support.sh(("%s export %s/ck2 %s/hf2"):format(ckpt, dir, dir))
  assert(st == 0, out)
  local got = cjson.decode(lz.read_file(dir .. "/hf2/config.json"))
  eq(got.bos_token_id, 5, "bos_token_id")
  eq(table.concat(got.eos_token_id, ","), "7," .. eos, "eos_token_id")
  eq(lz.read_file(dir .. "/hf2/generation_config.json"),
     lz.read_file(dir .. "/hf/generation_config.json"), "generation_config.json")
end

-- --merge-lora on GPT-2: the base file names its weights without
-- "transformer." and holds c_attn as Conv1D ([in, out]); the adapters fold
-- in there (W^T += s A^T B^T), and the merged folder evaluates as the LoRA
-- checkpoint does (it was refused: no tensor transformer.h.0.attn.c_attn.weight).
function T.merge_lora_folds_gpt2s_conv1d_weights()
  local write, dir = support.scratch()
  local data = write("d.txt", corpus(200, 5))
  local ckpt = exported(dir, data)
  local out, st = script("train", ("--init %s/hf --seq-len 16 --micro-batch 2 --sample 0 --seed 7 " ..
                             "--data %s --steps 2 --lora-r 4 --lr 3e-2 --save %s/lora")
                            :format(dir, q(data), dir))
  assert(st == 0, out)
  out, st = support.sh(("%s export %s/lora %s/merged --merge-lora"):format(ckpt, dir, dir))
  assert(st == 0 and out:find("with adapters folded in", 1, true), out)
  local got = {}
  for _, src in ipairs({ "--load " .. dir .. "/lora", "--hf " .. dir .. "/merged" }) do
    out, st = script("eval", src .. (" --data %s --seq-len 16 --micro-batch 2"):format(q(data)))
    assert(st == 0, out)
    got[#got + 1] = tonumber(out:match("val_loss (%S+)"))
  end
  assert(math.abs(got[1] - got[2]) < 1e-5 * math.abs(got[1]),
         ("%.9g vs %.9g"):format(got[1], got[2]))
  -- A base as GPT2LMHeadModel.save_pretrained writes it, its names under
  -- "transformer.": the same merge.
  local cjson = require("cjson")
  local text = assert(lz.read_file(dir .. "/hf/model.safetensors"))
  local n = 0
  for i = 8, 1, -1 do n = n * 256 + text:byte(i) end
  local header, renamed = cjson.decode(text:sub(9, 8 + n)), {}
  for k, v in pairs(header) do renamed[k == "__metadata__" and k or "transformer." .. k] = v end
  local h = cjson.encode(renamed)
  h = h .. (" "):rep((8 - #h % 8) % 8)
  local len = {}
  for i = 0, 7 do len[i + 1] = string.char(math.floor(#h / 256 ^ i) % 256) end
  os.execute(("mkdir -p %s/hfp && cp %s/hf/config.json %s/hfp/"):format(dir, dir, dir))
  support.write(dir .. "/hfp/model.safetensors", table.concat(len) .. h .. text:sub(9 + n))
  out, st = script("train", ("--init %s/hfp --seq-len 16 --micro-batch 2 --sample 0 --seed 7 " ..
                              "--data %s --steps 2 --lora-r 4 --lr 3e-2 --save %s/lora2")
                             :format(dir, q(data), dir))
  assert(st == 0, out)
  out, st = support.sh(("%s export %s/lora2 %s/merged2 --merge-lora"):format(ckpt, dir, dir))
  assert(st == 0 and out:find("with adapters folded in", 1, true), out)
  for i, src in ipairs({ "--load " .. dir .. "/lora2", "--hf " .. dir .. "/merged2" }) do
    out, st = script("eval", src .. (" --data %s --seq-len 16 --micro-batch 2"):format(q(data)))
    assert(st == 0, out)
    local loss = tonumber(out:match("val_loss (%S+)"))
    assert(math.abs(loss - got[1]) < 1e-5 * math.abs(got[1]), ("%s: %.9g vs %.9g")
           :format(src, loss, got[1]))
  end
end

-- A full fine-tune of a Hugging Face folder (--init, no LoRA) reads its
-- prompts with that folder's tokenizer under --load, as a LoRA checkpoint
-- does (it read them as bytes): a SentencePiece tokenizer's "ab ab" is
-- pieces 263 261 263 261, not the bytes 97 98 32 97 98.
function T.a_fine_tunes_load_reads_with_its_init_folders_tokenizer()
  local write, dir = support.scratch()
  local data = write("d.txt", corpus(200, 3))
  exported(dir, data, " --vocab 268")
  -- (without a tokenizer, a text prompt to a model of more than 256 ids is
  -- read as bytes: said so)
  local gout, gst = script("generate", ("--hf %s/hf --prompt 'ab' --max-new-tokens 1"):format(dir))
  assert(gst == 0 and gout:find("generate: " .. dir .. "/hf holds no tokenizer.json: text is " ..
                                "read and written as bytes (ids 0-255), which a model of 268 ids",
                                1, true), gout)
  support.write(dir .. "/hf/tokenizer.json",
                require("cjson").encode(support.sentencepiece_tokenizer()))
  -- (text beside a folder with a tokenizer is refused: its ids, made first)
  local out, st = script("train", ("--init %s/hf --data %s --seq-len 16 --micro-batch 2 --sample 0 " ..
                         "--steps 1"):format(dir, q(data)))
  assert(st == 2 and out:find("is text, read as bytes (each byte a token), but the model reads " ..
                              "the ids of --init " .. dir .. "/hf's tokenizer.json", 1, true), out)
  out, st = support.sh(("cd %s && LUAZERO=%s tools/prepare-data --tokenizer %s/hf %s %s/d.bin")
                       :format(q(lz.root), q(lz.executable()), dir, q(data), dir))
  assert(st == 0, out)
  out, st = script("train", ("--init %s/hf --data %s/d.bin --seq-len 16 --micro-batch 2 " ..
                             "--sample 0 --steps 1 --save %s/ft"):format(dir, dir, dir))
  assert(st == 0, out)
  out, st = script("generate", ("--load %s/ft --prompt 'ab ab' --max-new-tokens 2 --out %s/g.jsonl")
                               :format(dir, dir))
  assert(st == 0, out)
  local ids = table.concat(support.records(dir .. "/g.jsonl")[1].prompt_ids, ",")
  assert(ids:find("263,261,263,261", 1, true), "prompt_ids " .. ids)
  -- its export holds --init's tokenizer (twice: the second replaces the
  -- first), so generate --hf on it reads the prompt with it
  for _ = 1, 2 do
    out, st = support.sh(("cd %s && LUAZERO=%s tools/ckpt export %s/ft %s/ex")
                         :format(q(lz.root), q(lz.executable()), dir, dir))
    assert(st == 0, out)
  end
  support.eq(lz.read_file(dir .. "/ex/tokenizer.json"), lz.read_file(dir .. "/hf/tokenizer.json"),
             "the export's tokenizer.json")
  out, st = script("generate", ("--hf %s/ex --prompt 'ab ab' --max-new-tokens 2 --out %s/g2.jsonl")
                               :format(dir, dir))
  assert(st == 0, out)
  ids = table.concat(support.records(dir .. "/g2.jsonl")[1].prompt_ids, ",")
  assert(ids:find("263,261,263,261", 1, true), "the export's prompt_ids " .. ids)
end

-- A checkpoint trained on data read with --tokenizer (no --init) records
-- it: generate --load reads and writes text with it (it took bytes), and
-- names it when it is gone; an --out it cannot write fails before any work.
function T.a_checkpoint_generates_with_the_tokenizer_its_data_was_read_with()
  local write, dir = support.scratch()
  local data = write("d.txt", corpus(200, 3))
  local tok = dir .. "/sp/tokenizer.json"
  lz.mkdir(dir .. "/sp")
  support.write(tok, require("cjson").encode(support.sentencepiece_tokenizer()))
  local out, st = support.sh(("cd %s && LUAZERO=%s tools/prepare-data --tokenizer %s/sp %s %s/d.bin")
                             :format(q(lz.root), q(lz.executable()), dir, q(data), dir))
  assert(st == 0, out)
  out, st = script("train", ("--model gpt2-nano --n-layer 1 --vocab 268 --tokenizer %s " ..
                   "--data %s/d.bin --seq-len 16 --micro-batch 2 --sample 0 --steps 1 " ..
                   "--eval-batches 0 --save %s/ck"):format(dir .. "/sp", dir, dir))
  assert(st == 0, out)
  out, st = script("generate", ("--load %s/ck --prompt 'ab ab' --max-new-tokens 2 --out %s/g.jsonl")
                               :format(dir, dir))
  assert(st == 0 and out:find("the tokenizer the checkpoint trained with (", 1, true), out)
  local ids = table.concat(support.records(dir .. "/g.jsonl")[1].prompt_ids, ",")
  assert(ids:find("263,261,263,261", 1, true), "prompt_ids " .. ids)
  os.rename(dir .. "/sp", dir .. "/sp-moved")
  out, st = script("generate", ("--load %s/ck --prompt 'ab' --max-new-tokens 2"):format(dir))
  assert(st == 2 and out:find("was trained on data read with the tokenizer " .. dir ..
                              "/sp, which is not there now; give --tokenizer", 1, true), out)
  out, st = script("generate", ("--load %s/ck --tokenizer %s/sp-moved --prompt 'ab' " ..
                                "--max-new-tokens 2 --out %s/none/g.jsonl"):format(dir, dir, dir))
  assert(st == 2 and out:find("--out: cannot write " .. dir .. "/none/g.jsonl", 1, true) and
         not out:find("prompt_ids"), out)
end

-- The consolidated header's element count for a model of 2^31 elements or
-- more past a multiple of 2^32 (7-8B models: 7,615,616,512 here): its low
-- word's bits, read back whole (the header only; the floats are not written).
function T.consolidated_header_counts_billions()
  local dir = trained()
  local ck = require("luazero.checkpoint").open(dir .. "/ck")
  ck.manifest.numel = 7615616512
  ck.stream = function() end
  local path = dir .. "/big.bin"
  local build_file = require("luazero.io.atomic").build_file
  package.loaded["luazero.io.atomic"].build_file = function(out, _, fn)
    return build_file(out, 1024, fn)
  end
  local ok, err = pcall(ck.consolidate, ck, path)
  package.loaded["luazero.io.atomic"].build_file = build_file
  assert(ok, err)
  local raw = assert(lz.read_file(path))
  local u = ffi.cast("const uint32_t *", raw)
  eq(tonumber(u[3]) + tonumber(u[4]) * 2 ^ 32, 7615616512, "the element count read back")
end

-- A consolidated file (with the model's config.json) and a LoRA run's
-- checkpoint (with its base from --init, or the adapters exported for PEFT
-- on that base) give what their checkpoints give.
function T.consolidated_files_and_lora_adapters_load_alike()
  local dir = trained()
  local ckpt = ("%s %s"):format(q(lz.executable()), q(lz.root .. "/tools/ckpt.lua"))
  local out, st = support.sh(("%s consolidate %s/ck %s/all.bin && %s export %s/ck %s/hf")
                             :format(ckpt, dir, dir, ckpt, dir, dir))
  assert(st == 0, out)
  local ids = {}
  for _, src in ipairs({ "--load " .. dir .. "/ck",
                         ("--load %s/all.bin --model-config %s/hf/config.json"):format(dir, dir),
                         "--hf " .. dir .. "/hf" }) do
    out, st = script("generate", src .. " --prompt-ids 108,105 --max-new-tokens 6 --out " ..
                     dir .. "/g.jsonl")
    assert(st == 0, out)
    ids[#ids + 1] = table.concat(support.records(dir .. "/g.jsonl")[1].ids, ",")
  end
  eq(ids[2], ids[1], "consolidated file"); eq(ids[3], ids[1], "exported folder")
  out, st = script("generate", ("--load %s/all.bin --prompt x"):format(dir))
  assert(st == 2 and out:find("add --model NAME or --model-config", 1, true), out)
  -- LoRA on the exported folder
  local lora = "--model llama-tiny --context 32 --seq-len 16 --micro-batch 2 --sample 0 --seed 7 "
  local write = support.scratch()
  local data = write("d.txt", corpus(200, 3))
  out, st = script("train", lora .. ("--data %s --steps 2 --save %s/base"):format(q(data), dir))
  assert(st == 0, out)
  out, st = support.sh(("%s export %s/base %s/lhf"):format(ckpt, dir, dir))
  assert(st == 0, out)
  out, st = script("train", ("--init %s/lhf --seq-len 16 --micro-batch 2 --sample 0 --seed 7 " ..
                             "--data %s --steps 3 --lora-r 4 --lr 3e-2 --save %s/lora")
                            :format(dir, q(data), dir))
  assert(st == 0, out)
  out, st = support.sh(("%s export %s/lora %s/adapters"):format(ckpt, dir, dir))
  assert(st == 0, out)
  local got = {}
  for _, src in ipairs({ "--load " .. dir .. "/lora",
                         ("--hf %s/lhf --adapters %s/adapters"):format(dir, dir),
                         "--hf " .. dir .. "/lhf" }) do
    out, st = script("eval", src .. (" --data %s --seq-len 16 --micro-batch 2"):format(q(data)))
    assert(st == 0, out)
    got[#got + 1] = out:match("val_loss (%S+)")
  end
  eq(got[2], got[1], "eval: the PEFT adapters on their base, as the LoRA checkpoint")
  assert(got[3] ~= got[1], "the adapters change the loss")
  -- the base alone (its weights frozen in the engine) as train.lua --init measures it
  out, st = script("train", ("--init %s/lhf --seq-len 16 --micro-batch 2 --sample 0 --data %s " ..
                             "--val-data %s --eval-batches 100000 --steps 0")
                            :format(dir, q(data), q(data)))
  assert(st == 0, out)
  eq(got[3], out:match("val_loss (%S+)"), "eval --hf: train --init --steps 0's val_loss")
end

-- A --val-data file too small for one batch, or absent: one line naming it.
function T.val_data_too_small_or_absent_is_one_line()
  local write = support.scratch()
  local train, tiny = write("t.txt", corpus(100, 1)), write("v.txt", "short")
  local out, st = script("train", MODEL .. ("--data %s --val-data %s --steps 1")
                                          :format(q(train), q(tiny)))
  assert(st == 2 and out:find("train: data: " .. tiny .. ": 5 tokens, too few for one " ..
                              "validation batch of 2 x 16 (needs 33)", 1, true), out)
  out, st = script("train", MODEL .. ("--data %s --val-data %s.gone --steps 1")
                                     :format(q(train), q(tiny)))
  assert(st == 2 and out:find("train: data: " .. tiny .. ".gone", 1, true), out)
  out, st = script("eval", ("--hf %s --data %s"):format(q(tiny), q(train)))
  assert(st == 2 and out:find("eval: --hf " .. tiny .. ": no config.json there", 1, true), out)
end

-- train.lua's sample at the end runs through the cache: the checkpoint of
-- the same weights, sampled by luazero.generate with the run's seed, gives it.
function T.train_samples_through_the_cache()
  local write, dir = support.scratch()
  local data = write("d.txt", corpus(300, 1))
  local flags = ("--model gpt2-nano --n-layer 2 --n-embd 64 --n-head 4 --context 32 " ..
                 "--seq-len 16 --micro-batch 2 --seed 7 --steps 2 --sample 12 --data %s " ..
                 "--save %s/ck"):format(q(data), dir)
  local out, st = script("train", flags)
  assert(st == 0, out)
  local text = assert(out:match("\nsample:\n(.*)$"), out):gsub("\n$", "")
  local w = require("luazero.inference").open({ models = models, load = dir .. "/ck" })
  local o = generate.run(w.model, { { 10 } }, { max_new = 12, temperature = 1, seed = 7 })[1]
  w.free()
  local want = require("luazero.data").decode_bytes({ 10, unpack(o.ids) })
  eq(text, want:gsub("\n$", ""), "the sample")
end

return T
