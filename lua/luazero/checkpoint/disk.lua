-- checkpoint/disk.lua — a checkpoint's folder on disk: the names of its
-- step folders and shards, the step folder a path names (itself or its
-- `latest`), its manifest checked against the shards' sizes, and a shard
-- read forward block by block. docs/checkpoints.md, docs/formats.md.
--
-- A shard holds one rank's optimizer elements in its own layout, its
-- states (the fp32 master, then the optimizer's: the manifest's `states`)
-- interleaved per block of block_elems elements: block k = master[k*B, ...),
-- m[...], v[...]. The manifest maps each shard's elements to canonical
-- parameter coordinates (runs).
local ffi = require("ffi")
local bit = require("bit")
local lz = require("luazero")
local manifest_io = require("luazero.checkpoint.manifest")

local C = lz.C

local M = {}

M.BLOCK = 262144 -- elements per block: 3 MiB of states
M.SB = manifest_io.STATE_BYTES
local SB = M.SB
M.SHARD_HEADER = 48 -- bytes before a shard's zstd stream (docs/formats.md)
local SHARD_HEADER = M.SHARD_HEADER

-- The states a manifest's shards interleave (version 1: master, m, v).
function M.states_of(m) return m.states or manifest_io.STATES end

function M.fail(fmt, ...) error("checkpoint: " .. fmt:format(...), 0) end
local fail = M.fail

-- A C call's status: its error raised as is (the C message names the file).
function M.check(st) if st ~= 0 then error(lz.last_error(), 0) end end
local check = M.check

M.exists = require("luazero.io.fs").exists
local exists = M.exists

local read_file = lz.read_file

function M.step_name(step) return ("step-%06d"):format(step) end
M.shard_name = manifest_io.shard_name

function M.hex(u64) return bit.tohex(u64, 16) end

local function parse_hex(s)
  local v = ffi.new("uint64_t", 0)
  for i = 1, #s do v = v * 16 + tonumber(s:sub(i, i), 16) end
  return v
end

local function info_of(s)
  return ffi.new("lz_shard_info", {
    raw_bytes = s.raw_bytes, compressed_bytes = s.compressed_bytes,
    xxh64_compressed = parse_hex(s.xxh64_compressed), xxh64_raw = parse_hex(s.xxh64_raw) })
end


------------------------------------------------------------------ opening

-- The step folder `path` names: itself (it holds manifest.json), or the one
-- its `latest` file names.
-- Text as one quoted line: control characters, quotes and backslashes escaped.
local ESCAPES = { ["\n"] = "\\n", ["\t"] = "\\t", ["\r"] = "\\r", ['"'] = '\\"',
                  ["\\"] = "\\\\" }
local function quoted(text)
  local body = text:gsub('[%c"\\]', function(c)
    return ESCAPES[c] or ("\\%03d"):format(c:byte())
  end)
  return '"' .. body .. '"'
end

function M.resolve(path)
  path = path:gsub("/+$", "")
  if exists(path .. "/manifest.json") then return path end
  if not exists(path .. "/.") then
    if exists(path) then
      fail("%s: is a file, not a checkpoint folder; give a step folder (DIR/step-000020) or " ..
           "the --save folder", path)
    end
    fail("%s: no such folder; give a step folder (DIR/step-000020) or the --save folder", path)
  end
  local latest = read_file(path .. "/latest")
  if latest then
    local name = latest:match("^%s*(step%-%d+)%s*$")
    if not name then
      fail("%s/latest: holds %s, not a step folder name (step-NNNNNN); fix or remove it",
           path, quoted(latest:sub(1, 60)))
    end
    if not exists(path .. "/" .. name .. "/manifest.json") then
      fail("%s/latest names %s, which has no manifest.json; point latest at a complete step " ..
           "folder", path, name)
    end
    return path .. "/" .. name
  end
  -- (a save that stopped before its rename leaves only its temporary folder)
  local cut
  for _, name in ipairs(require("luazero.io.fs").list(path)) do
    if name:match("^%.step%-%d+%.tmp%-") and (not cut or name > cut) then cut = name end
  end
  if cut then
    fail("%s: holds no complete checkpoint, only %s, a save that was interrupted before it " ..
         "finished; resume from an earlier checkpoint, or start the run again", path, cut)
  end
  if exists(path .. "/adapter_config.json") then
    fail("%s: is PEFT's adapter folder, not a luazero checkpoint: adapters do not seed a " ..
         "resumed run (its optimizer states and step are not there); evaluate or generate " ..
         "with --hf BASE --adapters %s, or merge them into the base (PEFT's merge_and_unload) " ..
         "and start from that with --init", path, path)
  end
  fail("%s: holds neither manifest.json nor latest; give a step folder (DIR/step-000020) or " ..
       "the --save folder", path)
end

function M.read_manifest(dir)
  local path = dir .. "/manifest.json"
  local text = read_file(path)
  if not text then fail("%s: missing or unreadable; the checkpoint is incomplete: restore it, or resume " ..
                         "from another checkpoint", path) end
  local m = manifest_io.decode(text, path)
  -- Each shard's size agrees with its entry (its header and hashes are
  -- checked when it is read).
  for _, s in ipairs(m.shards) do
    local file = dir .. "/" .. s.file
    local f = io.open(file, "rb")
    local size = f and f:seek("end")
    if f then f:close() end
    if not size then fail("%s: missing or unreadable; the checkpoint is incomplete: restore it, or " ..
                          "resume from another checkpoint", file) end
    if size ~= SHARD_HEADER + s.compressed_bytes then
      fail("%s: %d bytes, but %s says %d (%d-byte header + compressed_bytes %d, xxh64 %s); " ..
           "the shard is truncated or damaged: restore it, or resume from another checkpoint",
           file, size, path, SHARD_HEADER + s.compressed_bytes, SHARD_HEADER,
           s.compressed_bytes, s.xxh64_compressed)
    end
  end
  return m
end

---------------------------------------------------------- shard streaming

-- One shard opened for sequential block reads.
local Shard = {}
Shard.__index = Shard

function M.open_shard(dir, entry, B, nstates)
  local out = ffi.new("lz_shard_reader *[1]")
  check(C.lz_shard_reader_open(out, dir .. "/" .. entry.file, info_of(entry)))
  return setmetatable({ h = out[0], entry = entry, B = B, block = -1, n = entry.elems,
                        ns = nstates }, Shard)
end

function Shard:block_len(k) return math.min(self.B, self.n - k * self.B) end

-- Block k (k > the last one read) into buf (f32, ns*B): its states.
function Shard:read_block(k, buf)
  for j = self.block + 1, k - 1 do
    check(C.lz_shard_reader_read(self.h, nil, self.ns * self:block_len(j) * SB))
  end
  check(C.lz_shard_reader_read(self.h, buf.data, self.ns * self:block_len(k) * SB))
  self.block = k
end

function Shard:close(verify)
  if self.h ~= nil then
    local h = self.h
    self.h = nil
    check(C.lz_shard_reader_close(h, verify == false and 0 or 1))
  end
end

-- Calls fn(state, canonical, ptr, n) for every run piece of shard `entry`
-- (state: the index in the manifest's states, 1 the master; ptr: float *),
-- in shard order. Reads it whole. nstates: #states (3).
function M.stream_shard(dir, entry, B, fn, on_bytes, nstates)
  local NSTATES = nstates or #manifest_io.STATES
  local sh = M.open_shard(dir, entry, B, NSTATES)
  local buf = lz.tensor({ NSTATES * B }, "f32", "workspace")
  local ok, err = pcall(function()
    local runs, ri = entry.runs, 1
    local nblocks = math.ceil(entry.elems / B)
    for k = 0, nblocks - 1 do
      sh:read_block(k, buf)
      local bstart, blen = k * B, sh:block_len(k)
      local p = ffi.cast("float *", buf.data)
      while ri <= #runs do
        local off, canon, n = runs[ri][1], runs[ri][2], runs[ri][3]
        local a, b = math.max(off, bstart), math.min(off + n, bstart + blen)
        if a >= bstart + blen then break end
        if b > a then
          for s = 1, NSTATES do fn(s, canon + a - off, p + (s - 1) * blen + a - bstart, b - a) end
        end
        if off + n <= bstart + blen then ri = ri + 1 else break end
      end
      if on_bytes then on_bytes(NSTATES * blen * SB) end
    end
  end)
  buf:free()
  if not ok then
    pcall(sh.close, sh, false)
    error(err, 0)
  end
  sh:close(true)
end

return M
