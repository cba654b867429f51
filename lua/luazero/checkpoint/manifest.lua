-- checkpoint/manifest.lua — a checkpoint's manifest.json: encoding, and a
-- decoder that checks every field the loader relies on, so a garbled file
-- fails with "checkpoint: PATH: FIELD: what is wrong" and never deeper in.
-- Plain Lua over cjson (no FFI): the fuzz target (tests/fuzz) runs it too.
-- The fields: docs/checkpoints.md.
local cjson = require("cjson")

local M = {}

M.FORMAT = "luazero-checkpoint"
M.VERSION = 1
M.STATES = { "master", "m", "v" } -- f32 each, interleaved per block
M.STATE_BYTES = 4

-- Its own cjson instance at its most digits (14): what resuming needs
-- exactly is whole numbers, powers of two or hex strings.
local json = cjson.new()
json.encode_number_precision(14)
json.encode_sparse_array(true)
M.json = json

function M.encode(t) return json.encode(t) end

local function fail(path, field, msg)
  error(("checkpoint: %s: %s: %s"):format(path, field, msg), 0)
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

-- Checks a decoded manifest; returns it. Errors name path and field.
function M.validate(m, path)
  if type(m) ~= "table" then fail(path, "(top level)", "expected a JSON object") end
  if m.format ~= M.FORMAT then
    fail(path, "format", ("expected %q (got %s): not a luazero checkpoint")
         :format(M.FORMAT, tostring(m.format)))
  end
  local version = int(path, m, "version", "version", 1, 1e9)
  if version ~= M.VERSION then
    fail(path, "version", ("%d is not supported (this luazero reads version %d)")
         :format(version, M.VERSION))
  end
  local world = int(path, m, "world_size", "world_size", 1, 1e6)
  int(path, m, "stage", "stage", 0, 3)
  str(path, m, "dtype", "dtype")
  int(path, m, "block_elems", "block_elems", 1, 2 ^ 30)
  for _, k in ipairs({ "optimizer_steps", "global_steps", "skipped_steps" }) do
    int(path, m, k, k)
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
  -- Shards: their runs must cover canonical [0, numel) exactly once.
  local shards = tbl(path, m, "shards", "shards")
  if #shards < 1 or #shards > world then
    fail(path, "shards", ("%d shards for world size %d"):format(#shards, world))
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
    int(path, s, "rank", f .. ".rank", 0, world - 1)
    local elems = int(path, s, "elems", f .. ".elems")
    local raw = int(path, s, "raw_bytes", f .. ".raw_bytes")
    if raw ~= elems * #M.STATES * M.STATE_BYTES then
      fail(path, f .. ".raw_bytes", ("%d, expected %d (%d elements x 3 states x 4 bytes)")
           :format(raw, elems * 12, elems))
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
  return m
end

-- Decodes and checks manifest text.
function M.decode(text, path)
  local ok, m = pcall(json.decode, text)
  if not ok then
    fail(path, "(file)", ("not valid JSON (%s); the manifest is damaged"):format(
      tostring(m):gsub("^.-: ", ""):sub(1, 120)))
  end
  return M.validate(m, path)
end

return M
