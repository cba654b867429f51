-- checkpoint/manifest.lua — a checkpoint's manifest.json: encoding, and a
-- decoder that checks every field the loader relies on, so a garbled file
-- fails with "checkpoint: PATH: FIELD: what is wrong" and never deeper in.
-- Plain LuaJIT over cjson (no luazero library): the fuzz target
-- (tests/fuzz) runs it too. The fields: docs/checkpoints.md.
--
-- Version 2 ends the file with its own checksum: `,"manifest_xxh64":"H"}`
-- where H is xxh64 (seed 0) of every byte before that comma, so any changed
-- byte is refused; version 1 (no checksum) still loads.
local oneline = require("luazero.io.oneline")
local ffi = require("ffi")
local bit = require("bit")
local cjson = require("cjson")

local M = {}

M.FORMAT = "luazero-checkpoint"
M.VERSION = 2
M.VERSIONS = { [1] = true, [2] = true } -- read
M.STATES = { "master", "m", "v" } -- f32 each, interleaved per block (the default)
M.STATE_BYTES = 4

-- Its own cjson instance at its most digits (14): what resuming needs
-- exactly is whole numbers, powers of two or hex strings.
local json = cjson.new()
json.encode_number_precision(14)
json.encode_sparse_array(true)
M.json = json

-- xxh64 of a Lua string, seed 0, in LuaJIT's 64-bit integers.
local U64 = ffi.typeof("uint64_t")
local P1, P2 = U64(0x9E3779B1) * 2 ^ 32 + 0x85EBCA87, U64(0xC2B2AE3D) * 2 ^ 32 + 0x27D4EB4F
local P3, P4 = U64(0x165667B1) * 2 ^ 32 + 0x9E3779F9, U64(0x85EBCA77) * 2 ^ 32 + 0xC2B2AE63
local P5 = U64(0x27D4EB2F) * 2 ^ 32 + 0x165667C5
local rol, bxor, rshift = bit.rol, bit.bxor, bit.rshift

local function round(acc, lane) return rol(acc + lane * P2, 31) * P1 end
local function merge(h, v) return bxor(h, round(U64(0), v)) * P1 + P4 end

function M.xxh64(s)
  local n = #s
  local buf = ffi.new("uint8_t[?]", n + 8)
  ffi.copy(buf, s, n)
  local p = 0
  local h
  if n >= 32 then
    local v1, v2, v3, v4 = P1 + P2, U64(P2), U64(0), U64(0) - P1
    while p + 32 <= n do
      local l = ffi.cast("const uint64_t *", buf + p)
      v1, v2, v3, v4 = round(v1, l[0]), round(v2, l[1]), round(v3, l[2]), round(v4, l[3])
      p = p + 32
    end
    h = rol(v1, 1) + rol(v2, 7) + rol(v3, 12) + rol(v4, 18)
    h = merge(merge(merge(merge(h, v1), v2), v3), v4)
  else
    h = U64(P5)
  end
  h = h + n
  while p + 8 <= n do
    h = rol(bxor(h, round(U64(0), ffi.cast("const uint64_t *", buf + p)[0])), 27) * P1 + P4
    p = p + 8
  end
  if p + 4 <= n then
    h = rol(bxor(h, U64(ffi.cast("const uint32_t *", buf + p)[0]) * P1), 23) * P2 + P3
    p = p + 4
  end
  while p < n do
    h = rol(bxor(h, U64(buf[p]) * P5), 11) * P1
    p = p + 1
  end
  h = bxor(h, rshift(h, 33)) * P2
  h = bxor(h, rshift(h, 29)) * P3
  return bit.tohex(bxor(h, rshift(h, 32)), 16)
end

local CHECKSUM_KEY = ',"manifest_xxh64":"'

-- The manifest's text, its checksum last.
function M.encode(t)
  local body = json.encode(t):gsub("}$", "")
  return body .. CHECKSUM_KEY .. M.xxh64(body) .. '"}\n'
end

local function fail(path, field, msg)
  error(oneline.of(("checkpoint: %s: %s: %s"):format(path, field, msg)), 0)
end

local MAX_INT = 2 ^ 53

local function is_int(v, lo, hi)
  return type(v) == "number" and v == math.floor(v) and v >= (lo or 0) and v <= (hi or MAX_INT)
end

local function int(path, t, key, field, lo, hi)
  local v = t[key]
  if not is_int(v, lo, hi) then
    fail(path, field, ("expected a whole number in %s..%s (got %s)")
         :format(tostring(lo or 0), hi and tostring(hi) or "2^53", tostring(v)))
  end
  return v
end

local function str(path, t, key, field)
  local v = t[key]
  if type(v) ~= "string" then fail(path, field, ("expected a string (got %s)"):format(type(v))) end
  return v
end

local function tbl(path, t, key, field)
  local v = t[key]
  if type(v) ~= "table" then fail(path, field, ("expected an object or array (got %s)")
                                      :format(type(v))) end
  return v
end

local function hex64(path, t, key, field)
  local v = str(path, t, key, field)
  if not v:match("^%x+$") or #v ~= 16 then
    fail(path, field, ("expected 16 hex digits (got %q)"):format(v:sub(1, 40)))
  end
  return v
end

M.DTYPES = { fp32 = true, bf16 = true, fp16 = true }

local function finite(v) return type(v) == "number" and v >= 0 and v < math.huge end

-- model: { name, config } of the saving run; config.n_embd, when given, is
-- the width of the token embedding (GPT-2's wte, Llama's embed_tokens).
local function check_model(path, m, params)
  local model = tbl(path, m, "model", "model")
  if model.name ~= nil then str(path, model, "name", "model.name") end
  local cfg = tbl(path, model, "config", "model.config")
  if cfg.n_embd == nil then return end
  local n_embd = int(path, cfg, "n_embd", "model.config.n_embd", 1)
  for i, p in ipairs(params) do
    if p.name:match("wte%.weight$") or p.name:match("embed_tokens%.weight$") then
      if #p.shape ~= 2 or p.shape[2] ~= n_embd then
        fail(path, "model.config.n_embd", ("%d, but params[%d] (%s) has shape [%s]")
             :format(n_embd, i, p.name, table.concat(p.shape, ", ")))
      end
      return
    end
  end
end

-- Shard i's file name in a checkpoint of n shards (0-based i).
function M.shard_name(i, n) return ("shard-%05d-of-%05d.zst"):format(i, n) end

-- How many ranks wrote shards: the manifest's writers, which a save
-- records (stages 1-3: every rank; stage 0: one, or every rank where the
-- experts lived in their groups, each saving its slices). A manifest from
-- before that field has the count its shards imply: world at stage 0 when
-- it lists one a rank, else one.
local function writers_of(path, m, world, listed)
  if m.writers == nil then
    return m.stage == 0 and listed ~= world and 1 or world
  end
  local writers = int(path, m, "writers", "writers", 1, world)
  if writers ~= world and (m.stage ~= 0 or writers ~= 1) then
    fail(path, "writers", ("%d at stage %d, world size %d (expected %s)"):format(writers, m.stage,
         world, m.stage == 0 and world > 1 and ("1 or " .. world) or tostring(world)))
  end
  return writers
end

-- Checks a decoded manifest; returns it. Errors name path and field.
function M.validate(m, path)
  if type(m) ~= "table" then fail(path, "(top level)", "expected a JSON object") end
  if m.format ~= M.FORMAT then
    fail(path, "format", ("expected %q (got %s): not a luazero checkpoint")
         :format(M.FORMAT, tostring(m.format)))
  end
  local version = int(path, m, "version", "version", 1, 1e9)
  if not M.VERSIONS[version] then
    fail(path, "version", ("%d is not supported (this luazero reads version %d)")
         :format(version, M.VERSION))
  end
  local world = int(path, m, "world_size", "world_size", 1, 1e6)
  int(path, m, "stage", "stage", 0, 3)
  local dtype = str(path, m, "dtype", "dtype")
  if not M.DTYPES[dtype] then
    fail(path, "dtype", ("%q is not a training dtype (fp32, bf16 or fp16)"):format(dtype:sub(1, 40)))
  end
  int(path, m, "block_elems", "block_elems", 1, 2 ^ 30)
  for _, k in ipairs({ "optimizer_steps", "global_steps", "skipped_steps" }) do
    int(path, m, k, k)
  end
  if m.optimizer_steps + m.skipped_steps ~= m.global_steps then
    fail(path, "skipped_steps", ("optimizer_steps %d + skipped_steps %d is not global_steps %d")
         :format(m.optimizer_steps, m.skipped_steps, m.global_steps))
  end
  local sched = tbl(path, m, "lr_schedule", "lr_schedule")
  for _, k in ipairs({ "lr", "base_lr" }) do
    local v = sched[k]
    if (v ~= nil or k == "lr") and not finite(v) then
      fail(path, "lr_schedule." .. k, ("expected a finite number >= 0 (got %s)")
           :format(type(v) == "string" and ("%q"):format(v:sub(1, 40)) or tostring(v)))
    end
  end
  if m.lr_schedule.optimizer_steps ~= nil and
     m.lr_schedule.optimizer_steps ~= m.optimizer_steps then
    fail(path, "lr_schedule.optimizer_steps", ("%s, but optimizer_steps is %d")
         :format(tostring(m.lr_schedule.optimizer_steps), m.optimizer_steps))
  end
  -- The states each shard interleaves: the fp32 master, then the optimizer's
  -- own (AdamW: m, v; Lion: m). Absent: master, m, v.
  local states = M.STATES
  if m.states ~= nil then
    states = tbl(path, m, "states", "states")
    for i = 1, #states do str(path, states, i, ("states[%d]"):format(i)) end
    if states[1] ~= "master" or #states < 1 or #states > 8 then
      fail(path, "states", "expected \"master\" then up to 7 optimizer states")
    end
  end
  local params = tbl(path, m, "params", "params")
  local numel = int(path, m, "numel", "numel")
  local offset = 0
  for i = 1, #params do
    local f = ("params[%d]"):format(i)
    local p = tbl(path, params, i, f)
    str(path, p, "name", f .. ".name")
    local shape = tbl(path, p, "shape", f .. ".shape")
    local n = 1
    for d = 1, #shape do n = n * int(path, shape, d, ("%s.shape[%d]"):format(f, d), 0, 2 ^ 40) end
    if #shape < 1 or #shape > 4 then fail(path, f .. ".shape", "expected 1 to 4 sizes") end
    if int(path, p, "numel", f .. ".numel") ~= n then
      fail(path, f .. ".numel", ("%d is not the product of its shape (%d)"):format(p.numel, n))
    end
    if int(path, p, "offset", f .. ".offset") ~= offset then
      fail(path, f .. ".offset", ("%d, expected %d (the previous tensors' sizes)")
           :format(p.offset, offset))
    end
    offset = offset + n
  end
  if #params == 0 or offset ~= numel then
    fail(path, "numel", ("%d, but the parameter table holds %d elements"):format(numel, offset))
  end
  check_model(path, m, params)
  -- Shards: their runs must cover canonical [0, numel) exactly once.
  local shards = tbl(path, m, "shards", "shards")
  local writers = writers_of(path, m, world, #shards)
  local where = ("writers %d (world size %d, stage %d)"):format(writers, world, m.stage)
  if #shards < writers then
    fail(path, "shards", ("%s is missing: %d listed, expected %d for %s")
         :format(M.shard_name(#shards, writers), #shards, writers, where))
  elseif #shards > writers then
    local extra = shards[writers + 1]
    fail(path, ("shards[%d]"):format(writers + 1), ("%q is one too many: %d listed, expected %d " ..
         "for %s"):format(tostring(type(extra) == "table" and extra.file):sub(1, 60), #shards,
                          writers, where))
  end
  local all = {}
  for i = 1, #shards do
    local f = ("shards[%d]"):format(i)
    local s = tbl(path, shards, i, f)
    local file = str(path, s, "file", f .. ".file")
    if not file:match("^shard%-%d+%-of%-%d+%.zst$") then
      fail(path, f .. ".file", ("%q is not a shard file name (shard-NNNNN-of-NNNNN.zst)")
           :format(file:sub(1, 60)))
    end
    local want = M.shard_name(i - 1, writers)
    if file ~= want then fail(path, f .. ".file", ("%q, expected %q"):format(file, want)) end
    int(path, s, "rank", f .. ".rank", i - 1, i - 1)
    local elems = int(path, s, "elems", f .. ".elems")
    local raw = int(path, s, "raw_bytes", f .. ".raw_bytes")
    if raw ~= elems * #states * M.STATE_BYTES then
      fail(path, f .. ".raw_bytes", ("%d, expected %d (%d elements x %d states x 4 bytes)")
           :format(raw, elems * #states * M.STATE_BYTES, elems, #states))
    end
    int(path, s, "compressed_bytes", f .. ".compressed_bytes")
    hex64(path, s, "xxh64_compressed", f .. ".xxh64_compressed")
    hex64(path, s, "xxh64_raw", f .. ".xxh64_raw")
    local runs = tbl(path, s, "runs", f .. ".runs")
    local last = 0
    for j = 1, #runs do
      local rf = ("%s.runs[%d]"):format(f, j)
      local r = tbl(path, runs, j, rf)
      local off = int(path, r, 1, rf .. "[1] (offset)")
      local canon = int(path, r, 2, rf .. "[2] (canonical)")
      local n = int(path, r, 3, rf .. "[3] (numel)", 1)
      if off < last or off + n > elems then
        fail(path, rf, ("elements %d..%d are out of order or outside the shard's %d")
             :format(off, off + n, elems))
      end
      last = off + n
      all[#all + 1] = { canon, n }
    end
  end
  table.sort(all, function(a, b) return a[1] < b[1] end)
  local pos = 0
  for _, r in ipairs(all) do
    if r[1] ~= pos then
      fail(path, "shards[].runs", ("canonical elements from %d are %s")
           :format(math.min(pos, r[1]), r[1] > pos and "held by no shard" or "held twice"))
    end
    pos = pos + r[2]
  end
  if pos ~= numel then
    fail(path, "shards[].runs", ("they cover %d of %d canonical elements"):format(pos, numel))
  end
  if m.loss_scaler ~= nil and type(m.loss_scaler) ~= "table" then
    fail(path, "loss_scaler", "expected an object")
  end
  if m.extra ~= nil and type(m.extra) ~= "table" then fail(path, "extra", "expected an object") end
  if m.generators ~= nil then
    local g = tbl(path, m, "generators", "generators")
    for k in pairs(g) do hex64(path, g, k, "generators." .. tostring(k)) end
  end
  -- The optimizer that saved it: the type its config named and the
  -- hyperparameters (absent in checkpoints saved before it was recorded).
  if m.optimizer ~= nil then
    local o = tbl(path, m, "optimizer", "optimizer")
    str(path, o, "type", "optimizer.type")
    local p = tbl(path, o, "params", "optimizer.params")
    if p[1] ~= nil then fail(path, "optimizer.params", "expected an object (got a list)") end
  end
  local pos_ = type(m.extra) == "table" and m.extra.data
  if pos_ ~= nil then
    if type(pos_) ~= "table" then fail(path, "extra.data", "expected an object") end
    if pos_.rng_state ~= nil then hex64(path, pos_, "rng_state", "extra.data.rng_state") end
    local gas = type(m.config) == "table" and m.config.gradient_accumulation_steps
    if pos_.batches ~= nil and type(gas) == "number" and
       int(path, pos_, "batches", "extra.data.batches") ~= m.global_steps * gas then
      fail(path, "extra.data.batches", ("%d, expected global_steps %d x " ..
           "gradient_accumulation_steps %d"):format(pos_.batches, m.global_steps, gas))
    end
  end
  return m
end

-- The optimizer that saved m, as { type, params }, and where that came
-- from: "record" (its optimizer field), "config" (a checkpoint from before
-- that field: the optimizer block of the config it holds), or nil when
-- neither says.
function M.optimizer_of(m)
  if type(m.optimizer) == "table" then return m.optimizer, "record" end
  local c = type(m.config) == "table" and m.config.optimizer
  if type(c) == "table" and type(c.type) == "string" then
    return { type = c.type, params = type(c.params) == "table" and c.params or {} }, "config"
  end
  return nil
end

-- The text's checksum (version 2): the bytes before it hash to it.
local function verify(text, m, path)
  local body, sum = text:match('^(.*),"manifest_xxh64":"(%x+)"}\n?$')
  if not body then
    if m.version == 1 and m.manifest_xxh64 == nil then return end -- written before checksums
    fail(path, "manifest_xxh64", "missing or not the last field; the manifest is damaged")
  end
  local actual = M.xxh64(body)
  if sum ~= actual then
    fail(path, "manifest_xxh64", ("the file hashes to %s, it says %s: the manifest was changed " ..
         "or damaged; restore it or resume from another checkpoint"):format(actual, sum:sub(1, 20)))
  end
end

-- Decodes and checks manifest text.
function M.decode(text, path)
  local ok, m = pcall(json.decode, text)
  if not ok then
    fail(path, "(file)", ("not valid JSON (%s); the manifest is damaged"):format(
      tostring(m):gsub("^.-: ", ""):sub(1, 120)))
  end
  M.validate(m, path)
  verify(text, m, path)
  return m
end

return M
