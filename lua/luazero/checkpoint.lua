-- checkpoint.lua — sharded, compressed, atomic checkpoints of the ZeRO
-- engine, loadable at any world size and stage; and a reading API for tools
-- and the REPL. docs/checkpoints.md describes the layout on disk.
--
--   engine:save(dir, extra, {zstd_level = 3, keep = 2})  -- dir/step-000020/, dir/latest
--   local manifest = engine:load(path)                  -- a step folder or a --save folder
--   local ck = checkpoint.open(path)                     -- reading without an engine
--   ck:summary(); ck:shard_table(); ck:norms(); ck:tensor("transformer.wte.weight")
--
-- A shard holds one rank's optimizer elements in its own layout, three f32
-- states (the fp32 master, then the optimizer's: m, v for AdamW, m for
-- Lion; the manifest's `states`) interleaved per block of block_elems
-- elements: block k = master[k*B, ...), m[...], v[...]. The manifest maps each
-- shard's elements to canonical parameter coordinates (runs), so a loader in
-- any other layout finds what it needs. The engine's states are reached only
-- through engine:visit_states, engine:state_layout and engine:after_load.
local ffi = require("ffi")
local bit = require("bit")
local lz = require("luazero")
local manifest_io = require("luazero.checkpoint.manifest")
local clock = require("luazero.clock")

local C, check = lz.C, lz.check

local M = {}

M.BLOCK = 262144 -- elements per block: 3 MiB of states
M.manifest = manifest_io

local SB = manifest_io.STATE_BYTES
local SHARD_HEADER = 48 -- bytes before a shard's zstd stream (docs/formats.md)
-- The states a manifest's shards interleave (version 1: master, m, v).
local function states_of(m) return m.states or manifest_io.STATES end

-- The states this engine saves: the master, then its optimizer's.
local function engine_states(engine)
  local out = { "master" }
  for _, name in ipairs(engine.optimizer.states) do out[#out + 1] = name end
  return out
end

local function fail(fmt, ...) error("checkpoint: " .. fmt:format(...), 0) end

local function exists(path)
  local f = io.open(path, "rb")
  if f then f:close() end
  return f ~= nil
end

local read_file = lz.read_file

function M.step_name(step) return ("step-%06d"):format(step) end
function M.shard_name(i, n) return ("shard-%05d-of-%05d.zst"):format(i, n) end

local function hex(u64) return bit.tohex(u64, 16) end

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

-- A progress bar on stderr, drawn only once the work has taken over 1 s.
local function progress(label, total)
  local t0, last, drawn = clock.now(), 0, false
  local p = {}
  function p.update(done)
    local now = clock.now()
    if now - t0 < 1 or now - last < 0.1 then return end
    last, drawn = now, true
    local frac = total > 0 and math.min(done / total, 1) or 1
    local w = 30
    local fill = math.floor(frac * w + 0.5)
    io.stderr:write(("\r%s [%s%s] %3d%% %.0f MB/s"):format(label, ("#"):rep(fill),
                    (" "):rep(w - fill), math.floor(frac * 100),
                    done / (now - t0) / 1e6))
    io.stderr:flush()
  end
  function p.finish()
    if drawn then
      p.update(total)
      io.stderr:write("\n")
    end
  end
  return p
end
M.progress = progress

--------------------------------------------------------------- agreement

-- Every rank's `vals` (numbers exact in a double), gathered on every rank:
-- all[r + 1][i].
local function gather(comm, vals)
  local K, W = #vals, comm.size()
  local send = lz.tensor({ 2 * K }, "i32", "workspace")
  local recv = lz.tensor({ 2 * K * W }, "i32", "workspace")
  local d = ffi.cast("double *", send.data)
  for i = 1, K do d[i - 1] = vals[i] end
  comm.all_gather(send, recv)
  local a = ffi.cast("double *", recv.data)
  local all = {}
  for r = 0, W - 1 do
    all[r + 1] = {}
    for i = 1, K do all[r + 1][i] = a[r * K + i - 1] end
  end
  send:free()
  recv:free()
  return all
end

-- Whether every rank succeeded; raises on every rank otherwise (its own
-- message where it failed, the failing ranks' numbers elsewhere).
local function agree(comm, ok, err, what, extra_vals)
  local vals = { ok and 1 or 0 }
  for _, v in ipairs(extra_vals or {}) do vals[#vals + 1] = v end
  local all = gather(comm, vals)
  local bad = {}
  for r, v in ipairs(all) do if v[1] ~= 1 then bad[#bad + 1] = r - 1 end end
  if #bad > 0 then
    -- A failure of some ranks only is named with the rank it happened on:
    -- the others hold only a pointer to it.
    if not ok and #bad < #all then
      error(("rank %d: %s"):format(comm.rank(), (tostring(err):gsub("^[^%s:]+%.lua:%d+: ", ""))), 0)
    end
    if not ok then error(err, 0) end
    fail("%s failed on rank%s %s (see %s message)", what, #bad > 1 and "s" or "",
         table.concat(bad, ", "), #bad > 1 and "their" or "its")
  end
  return all
end

------------------------------------------------------------------ saving

-- Streams (offset, master, state...) chunks into a shard writer as blocks
-- of NSTATES interleaved states.
local function block_writer(w, n, B, NSTATES)
  local stage_buf, cur = nil, -1
  local function put(ptr, bytes) check(C.lz_shard_writer_write(w, ptr, bytes)) end
  return function(off, ...)
    local views = { ... }
    local len = views[1]:numel()
    local src = {}
    for s = 1, NSTATES do src[s] = ffi.cast("char *", views[s].data) end
    local pos = 0
    while pos < len do
      local e = off + pos
      local k = math.floor(e / B)
      local bstart = k * B
      local blen = math.min(B, n - bstart)
      local take = math.min(len - pos, bstart + blen - e)
      if e == bstart and take == blen then
        for s = 1, NSTATES do put(src[s] + pos * SB, blen * SB) end
      else
        -- A block split across chunks: gathered, then written whole.
        stage_buf = stage_buf or lz.tensor({ NSTATES * B }, "f32", "workspace")
        cur = k
        local dst = ffi.cast("char *", stage_buf.data)
        for s = 1, NSTATES do
          ffi.copy(dst + ((s - 1) * blen + e - bstart) * SB, src[s] + pos * SB, take * SB)
        end
        if e - bstart + take == blen then
          put(dst, NSTATES * blen * SB)
          cur = -1
        end
      end
      pos = pos + take
    end
  end, function()
    if stage_buf then stage_buf:free() end
    assert(cur == -1, "checkpoint: the engine's chunks did not cover its states")
  end
end

local function write_shard(engine, path, opts)
  local n = engine:state_numel()
  local out = ffi.new("lz_shard_writer *[1]")
  check(C.lz_shard_writer_open(out, path, opts.zstd_level, opts.workers))
  local w = out[0]
  local ok, err = pcall(function()
    local feed, done = block_writer(w, n, M.BLOCK, #engine_states(engine))
    engine:visit_states(false, feed)
    done()
  end)
  if not ok then
    C.lz_shard_writer_abort(w)
    error(err, 0)
  end
  local info = ffi.new("lz_shard_info")
  check(C.lz_shard_writer_close(w, info))
  return info, n
end

local function scaler_state(sc)
  local t = {}
  for k, v in pairs(sc) do
    if type(v) == "number" or type(v) == "boolean" then t[k] = v end
  end
  return t
end

-- The parameters an engine trains (frozen ones are not saved).
local function param_table(engine)
  local t = {}
  for i, e in ipairs(engine.ptable) do
    t[i] = { name = e.name, shape = e.shape, offset = e.offset, numel = e.numel,
             decay = e.decay or false }
  end
  return t
end

-- The model's config: its scalar fields, and tables of scalars (Llama's
-- rope_scaling), which an export's config.json needs.
local function model_config(model)
  local cfg = {}
  for k, v in pairs(model.cfg or {}) do
    if type(v) == "table" then
      local t = {}
      for tk, tv in pairs(v) do
        if type(tv) ~= "table" and type(tv) ~= "function" then t[tk] = tv end
      end
      if next(t) then cfg[k] = t end
    elseif type(v) ~= "function" then
      cfg[k] = v
    end
  end
  return cfg
end

-- Step numbers of dir's step folders, ascending.
local function step_list(dir)
  local cap = 65536
  local steps = ffi.new("int64_t[?]", cap)
  local count = ffi.new("int[1]")
  check(C.lz_ckpt_steps(dir, steps, cap, count))
  local t = {}
  for i = 0, math.min(count[0], cap) - 1 do t[#t + 1] = tonumber(steps[i]) end
  return t
end

-- Names in a folder (readdir through libc: glibc's 64-bit struct dirent).
pcall(ffi.cdef, [[
typedef struct lz_dirent { uint64_t d_ino; int64_t d_off; unsigned short d_reclen;
                           unsigned char d_type; char d_name[256]; } lz_dirent;
void *opendir(const char *name);
lz_dirent *readdir(void *dirp);
int closedir(void *dirp);
int kill(int pid, int sig);
char *realpath(const char *path, char *resolved);
void free(void *p);
]])
local function list_dir(dir)
  local d = ffi.C.opendir(dir)
  if d == nil then return {} end
  local names = {}
  while true do
    local e = ffi.C.readdir(d)
    if e == nil then break end
    names[#names + 1] = ffi.string(e.d_name)
  end
  ffi.C.closedir(d)
  return names
end

local function real_path(path)
  local p = ffi.C.realpath(path, nil)
  if p == nil then return path end
  local s = ffi.string(p)
  ffi.C.free(p)
  return s
end

-- Whether process pid runs (a zombie, dead but not yet reaped, does not).
local function running(pid)
  if ffi.C.kill(pid, 0) ~= 0 then return false end
  local stat = read_file(("/proc/%d/stat"):format(pid))
  local state = stat and stat:match("^%d+ %b() (%a)")
  return state ~= "Z" and state ~= "X"
end

-- Leftovers of saves whose process died (.step-N.tmp-PID, .step-N.old-PID,
-- latest.tmp-PID): removed when PID is gone or is this process.
local function remove_dead_saves(dir)
  local me = tonumber(ffi.C.getpid())
  for _, name in ipairs(list_dir(dir)) do
    local pid = name:match("^%.step%-%d+%.tmp%-(%d+)$") or name:match("^%.step%-%d+%.old%-(%d+)$")
                or name:match("^latest%.tmp%-(%d+)$")
    pid = tonumber(pid)
    if pid and (pid == me or not running(pid)) then
      check(C.lz_ckpt_remove_tree(dir .. "/" .. name))
    end
  end
end

-- Where an engine's history in a --save folder starts: the step it resumed
-- from (0: a fresh run), and the folders of its first save (weak keys).
local history_checked = setmetatable({}, { __mode = "k" })

-- The first save of a run into dir: step folders numbered after the step the
-- run started from (and one with the number about to be written) belong to a
-- history this run rewound; they move to dir/.abandoned-TIME-PID/, and
-- `latest` never names a folder that is gone. Returns a line saying so, or nil.
local function set_aside_abandoned(dir, since, step, pid)
  local gone = {}
  for _, s in ipairs(step_list(dir)) do
    if s > since or s == step then gone[#gone + 1] = s end
  end
  if #gone == 0 then return nil end
  -- `latest` first: at the newest folder that stays, or none.
  local stay
  for _, s in ipairs(step_list(dir)) do
    if s <= since and s ~= step then stay = s end
  end
  if stay then
    local latest = M.step_name(stay) .. "\n"
    check(C.lz_ckpt_write_file(dir .. "/latest", latest, #latest))
  else
    os.remove(dir .. "/latest")
  end
  local aside = ("%s/.abandoned-%s-%d"):format(dir, os.date("!%Y%m%dT%H%M%SZ"), pid)
  check(C.lz_ckpt_mkdir(aside))
  for _, s in ipairs(gone) do
    check(C.lz_ckpt_rename(dir .. "/" .. M.step_name(s), aside .. "/" .. M.step_name(s)))
  end
  check(C.lz_ckpt_fsync(dir))
  local names = M.step_name(gone[1]) .. (#gone > 1 and (".." .. M.step_name(gone[#gone])) or "")
  return ("checkpoint: this run started at step %d, so %s in %s (%d folder%s, a history it " ..
          "rewound) moved to %s"):format(since, names, dir, #gone, #gone > 1 and "s" or "", aside)
end

-- Beyond the newest `keep` step folders, the oldest go (keep 0: none);
-- `protected` step numbers (the one just written, the one resumed from) stay.
local function prune(dir, keep, protected)
  if not keep or keep <= 0 then return end
  local steps = step_list(dir)
  for i = 1, #steps - keep do
    if not protected[steps[i]] then
      check(C.lz_ckpt_remove_tree(dir .. "/" .. M.step_name(steps[i])))
    end
  end
end

-- Saves engine's state as dir/step-NNNNNN (NNNNNN: engine.global_steps), then
-- points dir/latest at it. extra: a table stored as is (train.lua's RNG and
-- data position). opts: zstd_level (3), workers (zstd threads, default the
-- compute threads), keep (newest step folders kept, 0: all), config (the
-- normalised DeepSpeed configuration, stored whole). Collective:
-- every rank calls it; all succeed or all raise, and a failed save leaves
-- nothing but the previous checkpoints. Returns the step folder.
function M.save(engine, dir, extra, opts)
  opts = opts or {}
  local o = { zstd_level = opts.zstd_level or 3, workers = opts.workers or lz.threads(),
              keep = opts.keep or 0 }
  local comm, rank, W = engine.comm, engine.rank, engine.world
  local step = engine.global_steps
  local name = M.step_name(step)
  local final = dir .. "/" .. name

  -- 1. rank 0 makes the temporary folder; every rank learns its name.
  local ok, err, pid = true, nil, 0
  if rank == 0 then
    pid = tonumber(ffi.C.getpid())
    ok, err = pcall(function()
      check(C.lz_ckpt_mkdir(dir))
      remove_dead_saves(dir)
      check(C.lz_ckpt_mkdir(("%s/.%s.tmp-%d"):format(dir, name, pid)))
    end)
  end
  local all = agree(comm, ok, err, "save of " .. name, { pid })
  local tmp = ("%s/.%s.tmp-%d"):format(dir, name, all[1][2])

  -- 2. shards: every rank at stages 1-3; rank 0 alone at stage 0 (replicated).
  local writers = engine:states_replicated() and 1 or W
  local info, elems
  ok, err = true, nil
  if rank < writers then
    ok, err = pcall(function()
      info, elems = write_shard(engine, tmp .. "/" .. M.shard_name(rank, writers), o)
    end)
  end
  local function halves(u)
    return tonumber(bit.rshift(u, 32)), tonumber(bit.band(u, 0xffffffffULL))
  end
  local vals = { 0, 0, 0, 0, 0, 0, 0 }
  if ok and info then
    local a, b = halves(info.xxh64_compressed)
    local c, d = halves(info.xxh64_raw)
    vals = { tonumber(info.raw_bytes), tonumber(info.compressed_bytes), a, b, c, d, elems }
  end
  local ok_all, err_all = pcall(agree, comm, ok, err, "save of " .. name, vals)
  if not ok_all then
    if rank == 0 then C.lz_ckpt_remove_tree(tmp) end
    error(err_all, 0)
  end
  all = err_all

  -- 3. rank 0: manifest, fsync, set aside a rewound history, rename into
  -- place, then `latest`, then prune.
  ok, err = true, nil
  local note
  if rank == 0 then
    ok, err = pcall(function()
      local shards = {}
      for r = 0, writers - 1 do
        local v = all[r + 1]
        local u = function(hi, lo) return hex(ffi.new("uint64_t", hi) * 2 ^ 32 + lo) end
        shards[r + 1] = {
          file = M.shard_name(r, writers), rank = r, elems = v[8], raw_bytes = v[2],
          compressed_bytes = v[3], xxh64_compressed = u(v[4], v[5]), xxh64_raw = u(v[6], v[7]),
          runs = {},
        }
        for _, run in ipairs(M.runs_of(engine, r)) do
          local t = shards[r + 1].runs
          t[#t + 1] = { run.offset, run.canonical, run.numel }
        end
      end
      local s = engine.s
      local m = {
        format = manifest_io.FORMAT, version = manifest_io.VERSION,
        model = { config = model_config(engine.model), name = (engine.model.cfg or {}).name },
        world_size = W, stage = engine.stage, dtype = engine.dtype,
        master_dtype = "fp32", states = engine_states(engine), state_dtype = "f32",
        block_elems = M.BLOCK, zstd_level = o.zstd_level,
        numel = engine.L.numel, params = param_table(engine), shards = shards,
        -- A run with frozen parameters saves what trains: LoRA's settings,
        -- and where the frozen weights came from (--init), for the export.
        lora = engine.model.lora, init = engine.init_path,
        optimizer_steps = engine.optimizer_steps, global_steps = engine.global_steps,
        skipped_steps = engine.skipped_steps,
        lr_schedule = { optimizer_steps = engine.optimizer_steps,
                        lr = engine.lr(math.max(engine.optimizer_steps, 1)),
                        base_lr = s.lr },
        loss_scaler = scaler_state(engine.scaler),
        extra = extra or {}, config = opts.config or {},
        created = os.date("!%Y-%m-%dT%H:%M:%SZ"),
      }
      local text = manifest_io.encode(m)
      check(C.lz_ckpt_write_file(tmp .. "/manifest.json", text, #text))
      check(C.lz_ckpt_fsync(tmp))
      local seen = history_checked[engine] or {}
      history_checked[engine] = seen
      local real = real_path(dir)
      -- After the first save, only a folder of this very step is set aside
      -- (engine:save called twice at one step).
      local from = engine.resumed_from
      local since = seen[real] and math.huge or (from and from.step or 0)
      note = set_aside_abandoned(dir, since, step, all[1][2])
      seen[real] = true
      check(C.lz_ckpt_rename(tmp, final))
      local latest = name .. "\n"
      check(C.lz_ckpt_write_file(dir .. "/latest", latest, #latest))
      local protected = { [step] = true }
      if from and real_path(from.dir:match("^(.*)/[^/]+$") or ".") == real then
        protected[from.step] = true
      end
      prune(dir, o.keep, protected)
    end)
    if not ok then C.lz_ckpt_remove_tree(tmp) end
  end
  agree(comm, ok, err, "save of " .. name)
  if note then
    io.stdout:write(note, "\n")
    io.stdout:flush()
  end
  return final
end

-- Runs {offset, canonical, numel} of rank r's shard in engine's layout.
function M.runs_of(engine, r)
  local layout = require("luazero.zero.layout")
  if r == engine.rank then return engine:state_layout().runs end
  return layout.canonical_runs(engine.L, not engine:states_replicated() and r or nil)
end

pcall(ffi.cdef, "int getpid(void);")

------------------------------------------------------------------ opening

-- The step folder `path` names: itself (it holds manifest.json), or the one
-- its `latest` file names.
function M.resolve(path)
  path = path:gsub("/+$", "")
  if exists(path .. "/manifest.json") then return path end
  local latest = read_file(path .. "/latest")
  if latest then
    local name = latest:match("^%s*(step%-%d+)%s*$")
    if not name then
      fail("%s/latest: holds %q, not a step folder name (step-NNNNNN); fix or remove it",
           path, latest:sub(1, 60))
    end
    if not exists(path .. "/" .. name .. "/manifest.json") then
      fail("%s/latest names %s, which has no manifest.json; point latest at a complete step " ..
           "folder", path, name)
    end
    return path .. "/" .. name
  end
  fail("%s: holds neither manifest.json nor latest; give a step folder (DIR/step-000020) or " ..
       "the --save folder", path)
end

function M.read_manifest(dir)
  local path = dir .. "/manifest.json"
  local text = read_file(path)
  if not text then fail("%s: missing or unreadable; the checkpoint is incomplete", path) end
  local m = manifest_io.decode(text, path)
  -- Each shard's size agrees with its entry (its header and hashes are
  -- checked when it is read).
  for _, s in ipairs(m.shards) do
    local file = dir .. "/" .. s.file
    local f = io.open(file, "rb")
    local size = f and f:seek("end")
    if f then f:close() end
    if not size then fail("%s: missing or unreadable; the checkpoint is incomplete", file) end
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

local function open_shard(dir, entry, B, nstates)
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
  local sh = open_shard(dir, entry, B, NSTATES)
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

------------------------------------------------------------------ loading

-- The first tensor where the checkpoint's model and this one differ.
local function check_model(m, engine, dir)
  local here = engine.ptable
  local function shape(s) return "[" .. table.concat(s, ", ") .. "]" end
  for i = 1, math.max(#here, #m.params) do
    local a, b = m.params[i], here[i]
    if not a or not b or a.name ~= b.name or shape(a.shape) ~= shape(b.shape) then
      fail("%s holds a different model: parameter %d is %s there but %s here; load it with " ..
           "the model flags it was saved with (%s)", dir, i,
           a and (a.name .. " " .. shape(a.shape)) or "absent",
           b and (b.name .. " " .. shape(b.shape)) or "absent",
           m.model and m.model.name or "see its manifest.json")
    end
  end
end

-- Pieces {dst, shard, src, numel}: where each of this rank's optimizer
-- elements lies in the saved shards (shard: index into m.shards).
local function plan(m, runs)
  local saved = {}
  for i, s in ipairs(m.shards) do
    for _, r in ipairs(s.runs) do
      saved[#saved + 1] = { shard = i, offset = r[1], canonical = r[2], numel = r[3] }
    end
  end
  table.sort(saved, function(a, b) return a.canonical < b.canonical end)
  local pieces = {}
  for _, r in ipairs(runs) do
    -- the saved run holding r.canonical: binary search
    local lo, hi = 1, #saved
    while lo < hi do
      local mid = math.floor((lo + hi + 1) / 2)
      if saved[mid].canonical <= r.canonical then lo = mid else hi = mid - 1 end
    end
    local c, left, dst = r.canonical, r.numel, r.offset
    local i = lo
    while left > 0 do
      local s = saved[i]
      local a = c - s.canonical
      local n = math.min(left, s.numel - a)
      pieces[#pieces + 1] = { dst = dst, shard = s.shard, src = s.offset + a, numel = n }
      c, dst, left, i = c + n, dst + n, left - n, i + 1
    end
  end
  return pieces
end

-- Loads a checkpoint (a step folder, or a --save folder through latest) into
-- engine, whatever world size and stage it was saved at. Returns the
-- manifest (its `extra` holds what the trainer saved).
function M.load(engine, path)
  local dir = M.resolve(path)
  local m = M.read_manifest(dir)
  check_model(m, engine, dir)
  -- The optimizer's states must be the ones saved (the same optimizer).
  local saved, want = states_of(m), engine_states(engine)
  if table.concat(saved, ",") ~= table.concat(want, ",") then
    fail("%s holds the states %s; this run's optimizer %s keeps %s: resume with the optimizer " ..
         "that saved it", dir, table.concat(saved, ", "), engine.optimizer.name,
         table.concat(want, ", "))
  end
  local NSTATES = #saved
  local B = m.block_elems
  local layout = engine:state_layout()
  local pieces = plan(m, layout.runs)
  -- Each needed shard: opened on first use, read forward once, verified
  -- and closed after its last piece.
  local last_use = {}
  for i, p in ipairs(pieces) do last_use[p.shard] = i end
  local open, bufs = {}, {}
  local pi = 1
  local ok, err = pcall(function()
    engine:visit_states(true, function(off, ...)
      local views = { ... }
      local len = views[1]:numel()
      local dst = {}
      for s = 1, NSTATES do dst[s] = ffi.cast("char *", views[s].data) end
      -- Padding is in no piece: zero, as the engine keeps it.
      for s = 1, NSTATES do ffi.fill(dst[s], len * SB) end
      while pi <= #pieces and pieces[pi].dst < off + len do
        local p = pieces[pi]
        local a = math.max(p.dst, off) -- pieces may straddle chunks
        local b = math.min(p.dst + p.numel, off + len)
        local sh = open[p.shard]
        if not sh then
          sh = open_shard(dir, m.shards[p.shard], B, NSTATES)
          open[p.shard] = sh
          bufs[p.shard] = lz.tensor({ NSTATES * B }, "f32", "workspace")
        end
        local buf = bufs[p.shard]
        local src = p.src + a - p.dst
        local pos = a
        while pos < b do
          local k = math.floor(src / B)
          if sh.block < k then sh:read_block(k, buf) end
          local blen = sh:block_len(k)
          local n = math.min(b - pos, (k + 1) * B - src)
          local base = ffi.cast("char *", buf.data)
          for s = 1, NSTATES do
            ffi.copy(dst[s] + (pos - off) * SB, base + ((s - 1) * blen + src - k * B) * SB, n * SB)
          end
          pos, src = pos + n, src + n
        end
        if b == p.dst + p.numel then
          if last_use[p.shard] == pi then
            sh:close(true)
            bufs[p.shard]:free()
            open[p.shard], bufs[p.shard] = false, nil
          end
          pi = pi + 1
        else
          break -- the rest of this piece is in the next chunk
        end
      end
    end)
    if pi <= #pieces then fail("%s: the engine's chunks did not cover its states", dir) end
  end)
  for i, sh in pairs(open) do
    if sh then pcall(sh.close, sh, false) end
    if bufs[i] then bufs[i]:free() end
  end
  agree(engine.comm, ok, err, "load of " .. dir)
  engine:after_load()
  engine.optimizer_steps = m.optimizer_steps
  engine.global_steps = m.global_steps
  engine.skipped_steps = m.skipped_steps
  if engine.scaler.dynamic and m.dtype == "fp16" and engine.dtype == "fp16" then
    for k, v in pairs(m.loss_scaler or {}) do
      if type(engine.scaler[k]) == type(v) then engine.scaler[k] = v end
    end
  end
  m.dir = dir
  engine.resumed_from = { dir = dir, step = m.global_steps }
  return m
end

------------------------------------------------------------------ reading

-- Reading a checkpoint without an engine (tools/ckpt, the REPL).
local Checkpoint = {}
Checkpoint.__index = Checkpoint

function M.open(path)
  local dir = M.resolve(path)
  local m = M.read_manifest(dir)
  local by_name = {}
  for i, p in ipairs(m.params) do by_name[p.name] = i end
  return setmetatable({ dir = dir, manifest = m, by_name = by_name }, Checkpoint)
end

-- A one-table summary: step counters, world, stage, dtypes, sizes.
function Checkpoint:summary()
  local m = self.manifest
  local raw, comp = 0, 0
  for _, s in ipairs(m.shards) do raw, comp = raw + s.raw_bytes, comp + s.compressed_bytes end
  return {
    dir = self.dir, model = m.model and m.model.name, world_size = m.world_size,
    stage = m.stage, dtype = m.dtype, params = #m.params, numel = m.numel,
    optimizer_steps = m.optimizer_steps, global_steps = m.global_steps,
    skipped_steps = m.skipped_steps, loss_scale = m.loss_scaler and m.loss_scaler.scale,
    shards = #m.shards, raw_bytes = raw, compressed_bytes = comp,
    ratio = comp > 0 and raw / comp or 0, created = m.created,
  }
end

-- Per shard: file, rank, elems, raw and compressed bytes, canonical ranges.
function Checkpoint:shard_table()
  local t = {}
  for i, s in ipairs(self.manifest.shards) do
    local ranges = {}
    for j, r in ipairs(s.runs) do ranges[j] = { r[2], r[2] + r[3] } end
    t[i] = { file = s.file, rank = s.rank, elems = s.elems, raw_bytes = s.raw_bytes,
             compressed_bytes = s.compressed_bytes, ranges = ranges }
  end
  return t
end

-- Calls fn(state, canonical, ptr, n) over every shard (see stream_shard),
-- with a progress bar labelled `label` on long runs.
function Checkpoint:stream(fn, label)
  local m, total = self.manifest, 0
  for _, s in ipairs(m.shards) do total = total + s.raw_bytes end
  local bar, done = progress(label or "reading", total), 0
  for _, s in ipairs(m.shards) do
    M.stream_shard(self.dir, s, m.block_elems, fn, function(b)
      done = done + b
      bar.update(done)
    end, #states_of(m))
  end
  bar.finish()
end

-- The index of the tensor holding canonical element c (binary search).
local function tensor_at(params, c)
  local lo, hi = 1, #params
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    if params[mid].offset <= c then lo = mid else hi = mid - 1 end
  end
  return lo
end

-- { {name, shape, numel, norm (L2 of the fp32 master)}, ... } in canonical order.
function Checkpoint:norms()
  local params = self.manifest.params
  local sq = {}
  for i = 1, #params do sq[i] = 0 end
  self:stream(function(state, canon, p, n)
    if state ~= 1 then return end
    local i, k = tensor_at(params, canon), 0
    while k < n do
      local e = params[i]
      local stop = math.min(n, e.offset + e.numel - canon)
      local s = 0
      for j = k, stop - 1 do s = s + p[j] * p[j] end
      sq[i] = sq[i] + s
      k, i = stop, i + 1
    end
  end, "norms")
  local out = {}
  for i, e in ipairs(params) do
    out[i] = { name = e.name, shape = e.shape, numel = e.numel, norm = math.sqrt(sq[i]) }
  end
  return out
end

-- One tensor's fp32 master values, whole, as an f32 tensor of its shape.
-- state: "master" (default) or one of the optimizer's ("m", "v" for AdamW).
-- Reads only the shards holding it.
function Checkpoint:tensor(name, state)
  local i = self.by_name[name]
  if not i then fail("%s has no tensor %q (ck:norms() lists them)", self.dir, tostring(name)) end
  local names = states_of(self.manifest)
  local which
  for k, n in ipairs(names) do if n == (state or "master") then which = k end end
  if not which then
    fail("state %q is not one this checkpoint holds (%s)", tostring(state), table.concat(names, ", "))
  end
  local e = self.manifest.params[i]
  local t = lz.tensor(e.shape, "f32", "workspace")
  local out = ffi.cast("float *", t.data)
  local lo, hi = e.offset, e.offset + e.numel
  for _, s in ipairs(self.manifest.shards) do
    local needed = false
    for _, r in ipairs(s.runs) do
      if r[2] < hi and r[2] + r[3] > lo then needed = true end
    end
    if needed then
      M.stream_shard(self.dir, s, self.manifest.block_elems, function(state_, canon, p, n)
        if state_ ~= which then return end
        local a, b = math.max(canon, lo), math.min(canon + n, hi)
        if b > a then ffi.copy(out + (a - lo), p + (a - canon), (b - a) * SB) end
      end, nil, #names)
    end
  end
  return t
end

-- Writes the fp32 master weights in canonical order to `out`: a 256-int32
-- header (magic 20240521, version 1, tensor count, element count low and
-- high 32 bits) then the floats. Memory: one block per shard read.
M.CONSOLIDATED_MAGIC = 20240521
function Checkpoint:consolidate(out)
  local m = self.manifest
  local f, ferr = io.open(out, "wb")
  if not f then fail("%s: cannot write it (%s)", out, tostring(ferr)) end
  local header = ffi.new("int32_t[256]")
  header[0], header[1], header[2] = M.CONSOLIDATED_MAGIC, 1, #m.params
  header[3], header[4] = m.numel % 2 ^ 32, math.floor(m.numel / 2 ^ 32)
  f:write(ffi.string(header, 1024))
  local ok, err = pcall(self.stream, self, function(state, canon, p, n)
    if state ~= 1 then return end
    f:seek("set", 1024 + canon * SB)
    f:write(ffi.string(p, n * SB))
  end, "consolidate")
  f:close()
  if not ok then
    os.remove(out)
    error(err, 0)
  end
  return m.numel
end

return M
