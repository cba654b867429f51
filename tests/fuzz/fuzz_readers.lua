-- tests/fuzz/fuzz_readers.lua — a seeded mutation loop over every Lua reader
-- of a user's file: safetensors (checkpoint/safetensors.lua), a DeepSpeed
-- config (config.lua), a Hugging Face config.json (hf.model_config) and
-- model.safetensors.index.json (hf.open),
-- tokenizer.json (tokenizer/), token and instruction files and instruction
-- data as JSON Lines (data.load), a
-- checkpoint's manifest.json (checkpoint/manifest.lua) alone and beside its
-- shards (checkpoint.open, then what tools/ckpt inspect reads). Each input is a
-- seed file mutated by tests/fuzz/mutate.lua from its own number. A reader
-- must accept it or raise its own one-line error ("safetensors FILE: ",
-- "config: ", "model config FILE: ", "tokenizer: FILE: ", "data: FILE: ",
-- "checkpoint: FILE: "); a stray error, a traceback, more than
-- LZ_FUZZ_INPUT_SECONDS (default 5) on one input or a jump of the ledger's
-- or the Lua heap's peak past 1 GiB fails, printing the input's number.
-- What a loaded tokenizer gives must also encode and decode a text.
--
--   luazero tests/fuzz/fuzz_readers.lua SEEDS SECONDS [TARGET]   # SECONDS per target
--   luazero tests/fuzz/fuzz_readers.lua SEEDS replay TARGET N    # input N again, saved
--   luazero tests/fuzz/fuzz_readers.lua SEEDS selfcheck          # the checks catch canaries
--
-- SEEDS holds one folder per target (safetensors, ds_config, hf_config,
-- hf_index, tokenizer, jsonl, tokens, manifest) of seed files, and shards/ the shards of the
-- manifests' checkpoint (tests/fuzz/run.sh makes it).
-- LZ_FUZZ_SEED (default 1) picks the inputs' numbers: N from SEED * 1000000.
-- Before each input, SEEDS/current names it, so a crash or a hang the
-- caller sees can be replayed. Ends with "N passed, N failed".
local here = arg[0]:match("^(.*)/[^/]*$") or "."
package.path = here .. "/?.lua;" .. package.path
local lz = require("luazero")
local mutate = require("mutate")
local clock = require("luazero.clock")

local seeds_dir, mode = arg[1], arg[2]
if not seeds_dir or not mode then
  io.stderr:write("usage: luazero tests/fuzz/fuzz_readers.lua SEEDS SECONDS [TARGET] | " ..
                  "SEEDS replay TARGET N\n")
  os.exit(2)
end
local INPUT_SECONDS = tonumber(os.getenv("LZ_FUZZ_INPUT_SECONDS") or "") or 5
local BIG = 2 ^ 30
local work = seeds_dir .. "/work"
os.execute(("mkdir -p '%s'"):format(work))

local function read(path) return assert(lz.read_file(path), path) end

local write = dofile(lz.root .. "/tests/lua/support.lua").write

local function files_in(dir)
  local out = {}
  local p = io.popen(("ls '%s' 2>/dev/null"):format(dir))
  for name in p:lines() do out[#out + 1] = dir .. "/" .. name end
  p:close()
  return out
end

-- A tokenizer that loads must do its work: encode a text with every kind
-- of character, decode the ids, decode them one by one.
local TEXT = "The answer, then: 42 ab\tc  \n\n<|endoftext|></s> caf\195\169 \226\150\129 " ..
             "\240\159\152\128 \0 end"
local function exercise_tokenizer(tok)
  local ids = tok:encode(TEXT)
  tok:decode(ids)
  tok:decode(ids, { skip_special_tokens = true })
  for _, id in ipairs(ids) do tok:decode({ id }) end
  tok:vocab_size()
end

local manifest = require("luazero.checkpoint.manifest")

local fixtures = lz.root .. "/tests/fixtures"
local fixture_tokenizer = function()
  local tok = require("luazero.tokenizer").load(fixtures .. "/tokenizer/byte_level.json")
  fixture_tokenizer = function() return tok end
  return tok
end
local function chatml() return require("luazero.chat_template").load(fixtures .. "/chat/chatml") end

-- A manifest mutated, mostly with its checksum made right so the checks
-- behind it run.
local function mutate_manifest(r, s, others)
  return mutate.json(r, s, others, function(text)
    local ok, t = pcall(manifest.json.decode, text)
    if not ok or type(t) ~= "table" then return text end
    t.manifest_xxh64 = nil
    local body = mutate.encode(t)
    if not body or body:sub(-1) ~= "}" or body == "{}" then return text end
    body = body:sub(1, -2)
    return body .. ',"manifest_xxh64":"' .. manifest.xxh64(body) .. '"}\n'
  end)
end

-- name -> { mutate(r, seed text, other seeds), run(path), the error prefix for
-- path; seeds: another target's folder; file(): where the input goes }
local targets = {
  safetensors = {
    mutate = mutate.safetensors, ext = ".safetensors",
    prefix = function(p) return "safetensors " .. p .. ": " end,
    run = function(p)
      local ffi = require("ffi")
      local st = require("luazero.checkpoint.safetensors").open(p)
      local buf = ffi.new("float[64]")
      for _, name in ipairs(st.names) do
        local t = st.tensors[name]
        st:read(t, 0, math.min(t.numel, 64), buf)
        if t.numel > 64 then st:read(t, t.numel - 64, 64, buf) end
      end
      st:close()
    end,
  },
  ds_config = {
    mutate = mutate.json, ext = ".json",
    prefix = function() return "config: " end,
    run = function(p)
      local config = require("luazero.config")
      local cfg = config.load(p, 1, {})
      config.load(p, 2, { stage = 2, micro_batch = 1 })
      return cfg
    end,
  },
  hf_config = {
    mutate = mutate.json, ext = ".json",
    prefix = function(p) return "model config " .. p .. ": " end,
    run = function(p) return require("luazero.hf").model_config(require("models.registry"), p, {}) end,
  },
  tokenizer = {
    mutate = mutate.json, ext = ".json",
    prefix = function(p) return "tokenizer: " .. p .. ": " end,
    run = function(p) exercise_tokenizer(require("luazero.tokenizer").load(p)) end,
  },
  -- instruction data as JSON Lines, through the byte-level fixture and
  -- ChatML's template (tests/fixtures)
  jsonl = {
    mutate = mutate.jsonl, ext = ".jsonl",
    prefix = function(p) return "data: " .. p .. ":" end,
    run = function(p)
      local data = require("luazero.data")
      data.free(data.load(p, { tokenizer = fixture_tokenizer(), template = chatml, max_len = 64 }))
    end,
  },
  -- a Hugging Face folder's model.safetensors.index.json beside the real
  -- model.safetensors (SEEDS/safetensors/fp32.safetensors), opened as --init does
  hf_index = {
    mutate = mutate.json, ext = ".json",
    file = function() return work .. "/hf/model.safetensors.index.json" end,
    prefix = function() return { "init: ", "safetensors " .. work .. "/hf" } end,
    run = function(p)
      local hf = require("luazero.hf")
      hf.close(hf.open(p:match("^(.*)/[^/]*$")))
    end,
  },
  tokens = {
    mutate = mutate.token_file, ext = ".bin",
    prefix = function(p) return "data: " .. p .. ": " end,
    run = function(p)
      local data = require("luazero.data")
      data.free(data.load(p))
    end,
  },
  manifest = {
    mutate = mutate_manifest, ext = ".json",
    prefix = function(p) return "checkpoint: " .. p .. ": " end,
    run = function(p) return manifest.decode(read(p), p) end,
  },
  -- a manifest beside the real shards (SEEDS/shards), read as tools/ckpt
  -- inspect does: what the manifest says must hold for the shards too
  checkpoint = {
    seeds = "manifest", mutate = mutate_manifest, ext = ".json",
    file = function() return work .. "/ck/manifest.json" end,
    prefix = function() return "checkpoint: " end,
    run = function(p)
      local ck = require("luazero.checkpoint").open(p:match("^(.*)/[^/]*$"))
      ck:summary()
      ck:shard_table()
      ck:norms()
    end,
  },
}
local ORDER = { "safetensors", "ds_config", "hf_config", "hf_index", "tokenizer", "jsonl",
                "tokens", "manifest", "checkpoint" }
os.execute(("mkdir -p '%s/ck' '%s/hf' && cp '%s'/shards/* '%s/ck/' && cp " ..
            "'%s/safetensors/fp32.safetensors' '%s/hf/model.safetensors'")
           :format(work, work, seeds_dir, work, seeds_dir, work))

-- The seed texts of a target: its folder's files, read once; ds_config's
-- "@WORK@" is this run's work folder (an nvme_path that exists).
local seed_cache = {}
local function seeds_of(name)
  if seed_cache[name] then return seed_cache[name] end
  local list = {}
  for _, f in ipairs(files_in(seeds_dir .. "/" .. (targets[name].seeds or name))) do
    list[#list + 1] = (read(f):gsub("@WORK@", work))
  end
  assert(#list > 0, ("fuzz: no seeds in %s/%s"):format(seeds_dir, name))
  seed_cache[name] = list
  return list
end

-- Input n of a target: a seed picked and mutated by n alone.
local function input(name, n)
  local r = mutate.rng(n)
  local list = seeds_of(name)
  return targets[name].mutate(r, list[r(#list)], list)
end

-- Runs input n; nil when the reader behaved, else what went wrong.
local function try(name, n, path)
  local t = targets[name]
  write(path, input(name, n))
  write(seeds_dir .. "/current", ("%s %d reading\n"):format(name, n))
  local heap0, ledger0 = collectgarbage("count") * 1024, lz.mem_total_peak()
  local t0 = clock.now()
  local ok, err = xpcall(t.run, debug.traceback, path)
  local dt = clock.now() - t0
  if ok then t.accepted = (t.accepted or 0) + 1 end
  local heap = collectgarbage("count") * 1024
  if not ok then
    err = tostring(err)
    local msg = err:gsub("\nstack traceback:.*$", "")
    local prefixes = t.prefix(path)
    if type(prefixes) == "string" then prefixes = { prefixes } end
    local own = false
    for _, prefix in ipairs(prefixes) do own = own or msg:sub(1, #prefix) == prefix end
    if not own or msg:find("\n") then
      return ("a stray error (not one line starting %s):\n%s"):format(
        table.concat(prefixes, " or "), err)
    end
  end
  if lz.mem_total_peak() - ledger0 > BIG then
    return ("allocated %.3f GiB of C memory"):format((lz.mem_total_peak() - ledger0) / 2 ^ 30)
  end
  if heap - heap0 > BIG then
    return ("grew the Lua heap by %.3f GiB"):format((heap - heap0) / 2 ^ 30)
  end
  if dt > INPUT_SECONDS then
    return ("took %.1f s (over LZ_FUZZ_INPUT_SECONDS=%g)"):format(dt, INPUT_SECONDS)
  end
  return nil
end

local function input_path(name)
  local t = targets[name]
  return t.file and t.file() or ("%s/input%s"):format(work, t.ext)
end

local function save_failure(name, n)
  local out = ("%s/failed-%s-%d%s"):format(seeds_dir, name, n, targets[name].ext)
  write(out, input(name, n))
  return out
end

-- selfcheck: the checks above catch what they are for. Readers that
-- misbehave on purpose must each be reported; one that refuses in its own
-- line must not.
if mode == "selfcheck" then
  local function canary(run)
    return { mutate = function(r, s) return s .. r(9) end, ext = ".txt", run = run,
             prefix = function(p) return "canary: " .. p .. ": " end }
  end
  os.execute(("mkdir -p '%s/canary' && echo seed > '%s/canary/seed.txt'"):format(seeds_dir,
             seeds_dir))
  INPUT_SECONDS, BIG = 0.2, 2 ^ 20
  local cases = {
    { "refuses", nil, function(p) error("canary: " .. p .. ": refused; fix it", 0) end },
    { "stray", "a stray error", function() error("oops") end },
    { "two_lines", "a stray error", function(p) error("canary: " .. p .. ": a\nb", 0) end },
    { "slow", "took", function() clock.sleep(0.3) end },
    { "big", "allocated", function() lz.tensor({ 2 ^ 19 }, "f32", "workspace"):free() end },
  }
  local passed, failed = 0, 0
  for _, c in ipairs(cases) do
    local name = "canary_" .. c[1]
    targets[name] = canary(c[3])
    targets[name].seeds = "canary"
    local why = try(name, 1, input_path(name))
    local ok = (why == nil) == (c[2] == nil) and (why == nil or why:find(c[2], 1, true))
    print(("%s fuzz.selfcheck.%s%s"):format(ok and "ok  " or "FAIL", c[1],
          ok and "" or (": got " .. tostring(why))))
    if ok then passed = passed + 1 else failed = failed + 1 end
  end
  print(("%d passed, %d failed"):format(passed, failed))
  os.exit(failed == 0 and 0 or 1)
end

if mode == "replay" then
  local name, n = arg[3], tonumber(arg[4])
  assert(targets[name] and n, "replay TARGET N: TARGET one of " .. table.concat(ORDER, ", "))
  local why = try(name, n, input_path(name))
  print(why and ("FAIL %s input %d: %s"):format(name, n, why) or ("ok   %s input %d"):format(name, n))
  print(("input saved as %s"):format(save_failure(name, n)))
  os.exit(why and 1 or 0)
end

local seconds = tonumber(mode)
assert(seconds, "SECONDS must be a number")
local base = (tonumber(os.getenv("LZ_FUZZ_SEED") or "") or 1) * 1000000
local passed, failed = 0, 0
for _, name in ipairs(ORDER) do
  if not arg[3] or arg[3] == name then
    local path = input_path(name)
    local t_end = clock.now() + seconds
    local n, bad, count = base, nil, 0
    while clock.now() < t_end do
      n = n + 1
      write(seeds_dir .. "/current", ("%s %d\n"):format(name, n))
      local why = try(name, n, path)
      if why then
        bad = ("FAIL fuzz.%s input %d (replay: luazero tests/fuzz/fuzz_readers.lua %s " ..
               "replay %s %d; saved as %s): %s"):format(name, n, seeds_dir, name, n,
               save_failure(name, n), why)
        break
      end
      if n % 64 == 0 then collectgarbage() end
      count = count + 1
    end
    if bad then
      print(bad)
      failed = failed + 1
    else
      print(("ok   fuzz.%s %d inputs in %gs (%d accepted, the rest refused), heap %.0f MiB")
            :format(name, count, seconds, targets[name].accepted or 0,
                    collectgarbage("count") / 1024))
      passed = passed + 1
    end
    io.stdout:flush()
  end
end
os.remove(seeds_dir .. "/current")
print(("%d passed, %d failed"):format(passed, failed))
os.exit(failed == 0 and 0 or 1)
