-- checkpoint/save.lua — saving a ZeRO engine's states: every rank streams
-- its shard (zstd, checksummed) into a temporary step folder, rank 0 writes
-- the manifest, fsyncs, renames the folder into place, points `latest` at it
-- and prunes; a failed save leaves nothing but the previous checkpoints.
-- The engine is read only through engine:state_parts() (zero/engine.lua's
-- state contract): its shard, counters, scaler and metadata.
local ffi = require("ffi")
local bit = require("bit")
local lz = require("luazero")
local manifest_io = require("luazero.checkpoint.manifest")
local disk = require("luazero.checkpoint.disk")
local agree = require("luazero.checkpoint.agree").agree
local lock = require("luazero.checkpoint.lock")

local C = lz.C
local check, fail, hex, exists = disk.check, disk.fail, disk.hex, disk.exists
local read_file = lz.read_file
local SB = disk.SB

pcall(ffi.cdef, "int getpid(void);")

local M = {}

-- Streams (offset, master, state...) chunks, as blocks of NSTATES
-- interleaved states, into put(ptr, bytes): the shard's raw bytes in order.
local function block_writer(put, n, B, NSTATES)
  local stage_buf, cur = nil, -1
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

local function write_shard(parts, path, opts)
  local shard = parts.shard
  local n = shard.numel
  local out = ffi.new("lz_shard_writer *[1]")
  check(C.lz_shard_writer_open(out, path, opts.zstd_level, opts.workers))
  local w = out[0]
  local ok, err = pcall(function()
    local function put(ptr, bytes) check(C.lz_shard_writer_write(w, ptr, bytes)) end
    local feed, done = block_writer(put, n, disk.BLOCK, #shard.states)
    shard.visit(false, feed)
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

-- This rank's states as its shard's raw bytes, copied into dst (char *,
-- shard.numel x #shard.states x 4 bytes; parts: engine:state_parts()): the
-- snapshot an asynchronous save writes from. Returns the bytes copied.
function M.snapshot(parts, dst)
  local at = 0
  local function put(ptr, bytes)
    ffi.copy(dst + at, ptr, bytes)
    at = at + bytes
  end
  local feed, done = block_writer(put, parts.shard.numel, disk.BLOCK, #parts.shard.states)
  parts.shard.visit(false, feed)
  done()
  return at
end

-- The parameters an engine trains (frozen ones are not saved).
local function param_table(parts)
  local t = {}
  for i, e in ipairs(parts.params) do
    t[i] = { name = e.name, shape = e.shape, offset = e.offset, numel = e.numel,
             decay = e.decay or false }
  end
  return t
end

-- The model's config, which an export's config.json needs: its plain
-- values (strings, numbers, booleans) and tables of them two levels down
-- (Phi-3's rope_scaling with its short_factor and long_factor lists);
-- functions and cdata left out.
local function plain(v, depth)
  local t = type(v)
  if t == "string" or t == "number" or t == "boolean" then return v end
  if t ~= "table" or depth == 0 then return nil end
  local out = {}
  for k, x in pairs(v) do out[k] = plain(x, depth - 1) end
  return next(out) and out or nil
end

local function model_config(model)
  local cfg = {}
  for k, v in pairs(model.cfg or {}) do cfg[k] = plain(v, 2) end
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

pcall(ffi.cdef, "int kill(int pid, int sig);")
local list_dir = require("luazero.io.fs").list

-- (a folder's one spelling: links, "." and ".." resolved)
local function real_path(path) return require("luazero.io.atomic").real_path(path) or path end

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
    -- a step folder's 16-bit export whose process died while writing it
    -- (io/atomic.lua's .hf16.tmp-PID, with its fp32 scratch inside; this
    -- process's own may be a background save's, still writing)
    if name:match("^step%-%d+$") then
      for _, inner in ipairs(list_dir(dir .. "/" .. name)) do
        local p = tonumber(inner:match("^%.hf16%.tmp%-(%d+)$"))
        if p and p ~= me and not running(p) then
          check(C.lz_ckpt_remove_tree(dir .. "/" .. name .. "/" .. inner))
        end
      end
    end
  end
end

-- Claims dir for this run (checkpoint/lock.lua: another live run saving
-- there is refused) and, holding it, removes what dead saves left there.
-- Rank 0's, before it writes in dir.
function M.claim(dir)
  if lock.claim(dir) then remove_dead_saves(dir) end
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
    local latest = disk.step_name(stay) .. "\n"
    check(C.lz_ckpt_write_file(dir .. "/latest", latest, #latest))
  else
    local gone, why = os.remove(dir .. "/latest")
    if not gone and exists(dir .. "/latest") then
      fail("%s/latest: cannot remove it (%s)", dir, tostring(why))
    end
  end
  local aside = ("%s/.abandoned-%s-%d"):format(dir, os.date("!%Y%m%dT%H%M%SZ"), pid)
  check(C.lz_ckpt_mkdir(aside))
  for _, s in ipairs(gone) do
    check(C.lz_ckpt_rename(dir .. "/" .. disk.step_name(s), aside .. "/" .. disk.step_name(s)))
  end
  check(C.lz_ckpt_fsync(dir))
  local names = disk.step_name(gone[1]) .. (#gone > 1 and (".." .. disk.step_name(gone[#gone])) or "")
  if since == math.huge then -- (a second save of this run at one step)
    return ("checkpoint: %s in %s, saved before at this step, moved to %s"):format(names, dir, aside)
  end
  return ("checkpoint: this run started at step %d, so %s in %s (%d folder%s, a history it " ..
          "rewound) moved to %s"):format(since, names, dir, #gone, #gone > 1 and "s" or "", aside)
end

-- Beyond the newest `keep` step folders, the oldest go (keep 0: none);
-- `protected` step numbers (the one just written, the one resumed from) stay.
-- Of the histories rewound runs set aside (.abandoned-TIME-PID, named in
-- time order), the newest stays and older ones go too: --keep bounds the
-- folder's disk use.
local function prune(dir, keep, protected)
  if not keep or keep <= 0 then return end
  local steps = step_list(dir)
  for i = 1, #steps - keep do
    if not protected[steps[i]] then
      check(C.lz_ckpt_remove_tree(dir .. "/" .. disk.step_name(steps[i])))
    end
  end
  local aside, newest = {}, ""
  for _, name in ipairs(list_dir(dir)) do
    local t = name:match("^%.abandoned%-(%d+T%d+Z)%-%d+$")
    if t then
      aside[#aside + 1] = { name = name, t = t }
      if t > newest then newest = t end
    end
  end
  -- (those of the newest second all stay: their pids do not order them)
  for _, a in ipairs(aside) do
    if a.t < newest then check(C.lz_ckpt_remove_tree(dir .. "/" .. a.name)) end
  end
end

-- How many ranks write shards (the manifest's writers): one where the
-- optimizer is replicated (stage 0), every rank where it is sharded, or
-- where the experts lived in their groups and each rank saves its slices.
local function writers_of(parts)
  return parts.shard.replicated and 1 or parts.world
end

-- The start of a save of engine's state as dir/step-NNNNNN (NNNNNN:
-- engine.global_steps): rank 0 makes the temporary folder and every rank
-- learns its name; the manifest is drawn now (the engine moves on during an
-- asynchronous save), its shards filled in by M.finish. Collective.
-- Returns the save's context: { dir, name, step, tmp, final, writers, o,
-- pid, manifest, parts (engine:state_parts()) }.
function M.begin(engine, dir, extra, opts)
  opts = opts or {}
  local o = { zstd_level = opts.zstd_level or 3, workers = opts.workers or lz.threads(),
              keep = opts.keep or 0, config = opts.config }
  local parts = engine:state_parts()
  local comm, rank = parts.comm, parts.rank
  local step = parts.steps.global
  local name = disk.step_name(step)

  -- Frozen weights from no --init (drawn from the seed, or set by hand)
  -- are not saved: their hash is, for a resume to check (every rank: a
  -- gather at stage 3).
  local frozen_sum
  if engine.frozen and #(engine.frozen.entries or {}) > 0 and not parts.init.path then
    frozen_sum = engine:frozen_checksum()
  end
  local ok, err, pid = true, nil, 0
  if rank == 0 then
    pid = tonumber(ffi.C.getpid())
    ok, err = pcall(function()
      check(C.lz_ckpt_mkdir(dir))
      M.claim(dir)
      remove_dead_saves(dir)
      check(C.lz_ckpt_mkdir(("%s/.%s.tmp-%d"):format(dir, name, pid)))
    end)
  end
  local all = agree(comm, ok, err, "save of " .. name, { pid })
  pid = all[1][2]
  local m
  if rank == 0 then
    local model = parts.model
    m = {
      format = manifest_io.FORMAT, version = manifest_io.VERSION,
      model = { config = model_config(model), name = (model.cfg or {}).name },
      world_size = parts.world, stage = parts.stage, dtype = parts.dtype,
      writers = writers_of(parts),
      master_dtype = "fp32", states = parts.shard.states, state_dtype = "f32",
      optimizer = parts.optimizer_record,
      block_elems = disk.BLOCK, zstd_level = o.zstd_level,
      numel = parts.numel, params = param_table(parts),
      -- A run with frozen parameters saves what trains: LoRA's settings,
      -- and where the frozen weights came from (--init), for the export.
      lora = model.lora, init = parts.init.path, init_xxh64 = parts.init.xxh64,
      frozen_xxh64 = frozen_sum, frozen_seed = frozen_sum and engine.seed or nil,
      -- where the model's own training generators stand (MoE router jitter)
      generators = model.generator_states and model:generator_states() or nil,
      optimizer_steps = parts.steps.optimizer, global_steps = parts.steps.global,
      skipped_steps = parts.steps.skipped,
      lr_schedule = parts.lr(),
      loss_scaler = parts.loss_scaler,
      extra = extra or {}, config = opts.config or {},
      created = os.date("!%Y-%m-%dT%H:%M:%SZ"),
      -- the launcher job that wrote it (a restart resumes only its own)
      job = require("luazero.checkpoint.restart").job(),
    }
  end
  return { dir = dir, name = name, step = step, final = dir .. "/" .. name,
           tmp = ("%s/.%s.tmp-%d"):format(dir, name, pid), pid = pid,
           writers = writers_of(parts), o = o, manifest = m,
           parts = parts }
end

-- What a rank tells the others of its shard (agree's numbers after the ok
-- flag): raw and compressed bytes, both checksums in halves, elements.
function M.shard_vals(info, elems)
  if not info then return { 0, 0, 0, 0, 0, 0, 0 } end
  local function halves(u)
    return tonumber(bit.rshift(u, 32)), tonumber(bit.band(u, 0xffffffffULL))
  end
  local a, b = halves(info.xxh64_compressed)
  local c, d = halves(info.xxh64_raw)
  return { tonumber(info.raw_bytes), tonumber(info.compressed_bytes), a, b, c, d, elems }
end

-- The end of a save once every rank's shard is in ctx.tmp (all[r + 1]: rank
-- r's ok flag then M.shard_vals): rank 0 writes the manifest, fsyncs, sets
-- aside a rewound history, renames the folder into place, then `latest`,
-- then prunes. Collective; returns the step folder.
function M.finish(engine, ctx, all)
  local parts = ctx.parts
  local comm, rank = parts.comm, parts.rank
  local step, name, tmp, final, writers, o = ctx.step, ctx.name, ctx.tmp, ctx.final,
                                             ctx.writers, ctx.o
  local dir = ctx.dir
  local ok, err = true, nil
  local note
  if rank == 0 then
    ok, err = pcall(function()
      local shards = {}
      for r = 0, writers - 1 do
        local v = all[r + 1]
        local u = function(hi, lo) return hex(ffi.new("uint64_t", hi) * 2 ^ 32 + lo) end
        shards[r + 1] = {
          file = disk.shard_name(r, writers), rank = r, elems = v[8], raw_bytes = v[2],
          compressed_bytes = v[3], xxh64_compressed = u(v[4], v[5]), xxh64_raw = u(v[6], v[7]),
          runs = {},
        }
        for _, run in ipairs(parts.shard.runs_of(r)) do
          local t = shards[r + 1].runs
          t[#t + 1] = { run.offset, run.canonical, run.numel }
        end
      end
      local m = ctx.manifest
      m.shards = shards
      local text = manifest_io.encode(m)
      check(C.lz_ckpt_write_file(tmp .. "/manifest.json", text, #text))
      check(C.lz_ckpt_fsync(tmp))
      local seen = history_checked[engine] or {}
      history_checked[engine] = seen
      local real = real_path(dir)
      -- After the first save, only a folder of this very step is set aside
      -- (engine:save called twice at one step).
      local from = parts.resumed_from
      local since = seen[real] and math.huge or (from and from.step or 0)
      note = set_aside_abandoned(dir, since, step, ctx.pid)
      seen[real] = true
      check(C.lz_ckpt_rename(tmp, final))
      local latest = name .. "\n"
      check(C.lz_ckpt_write_file(dir .. "/latest", latest, #latest))
      local protected = { [step] = true }
      -- (the resumed step folder's own real path: a link to DIR/step-N is
      -- that folder)
      if from and (real_path(from.dir):match("^(.*)/[^/]+$") or ".") == real then
        protected[from.step] = true
      end
      prune(dir, o.keep, protected)
      -- zero_optimization.stage3_gather_16bit_weights_on_model_save: the
      -- weights in 16 bits as a Hugging Face folder inside the step folder
      -- (tools/ckpt export --dtype's, through the same code): fp16 for an
      -- fp16 run, as DeepSpeed saves its model's dtype, else bf16.
      local z = (o.config or {}).zero_optimization
      local d16 = (o.config or {}).dtype == "fp16" and "fp16" or "bf16"
      if z and z.gather_16bit_weights_on_model_save then
        local ckpt = require("luazero.checkpoint.reader").open(final)
        local ex = require("luazero.checkpoint.export")
        local write = m.lora and ex.export_lora or ex.export -- LoRA: PEFT's adapter folder
        -- (the checkpoint is whole and `latest` names it: a failed export
        -- says so, and how to write it again)
        local done, why = pcall(write, ckpt, final .. "/hf16", d16)
        if not done then
          error(("%s is saved (latest names it), but its 16-bit export " ..
                 "(stage3_gather_16bit_weights_on_model_save) failed: %s; `tools/ckpt export " ..
                 "%s OUT --dtype %s` writes it again"):format(final, tostring(why), final, d16), 0)
        end
      end
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

-- Whether every rank's shard is written (all[r + 1] from agree); raises
-- on every rank otherwise, the temporary folder removed.
function M.agree_shards(engine, ctx, ok, err, vals)
  local ok_all, all = pcall(agree, ctx.parts.comm, ok, err, "save of " .. ctx.name, vals)
  if not ok_all then
    if ctx.parts.rank == 0 then C.lz_ckpt_remove_tree(ctx.tmp) end
    error(all, 0)
  end
  return all
end

-- Saves engine's state as dir/step-NNNNNN (NNNNNN: engine.global_steps), then
-- points dir/latest at it. extra: a table stored as is (train.lua's RNG and
-- data position). opts: zstd_level (3), workers (zstd threads, default the
-- compute threads), keep (newest step folders kept, 0: all), config (the
-- normalised DeepSpeed configuration, stored whole). Collective:
-- every rank calls it; all succeed or all raise, and a failed save leaves
-- nothing but the previous checkpoints. Returns the step folder.
-- (checkpoint/async.lua: the same save with the shard written by a thread.)
function M.save(engine, dir, extra, opts)
  local ctx = M.begin(engine, dir, extra, opts)
  -- Shards: every rank at stages 1-3; rank 0 alone at stage 0 (replicated).
  local info, elems
  local ok, err = true, nil
  local rank = ctx.parts.rank
  if rank < ctx.writers then
    ok, err = pcall(function()
      info, elems = write_shard(ctx.parts, ctx.tmp .. "/" .. disk.shard_name(rank, ctx.writers),
                                ctx.o)
    end)
  end
  local all = M.agree_shards(engine, ctx, ok, err, M.shard_vals(ok and info, elems))
  return M.finish(engine, ctx, all)
end

-- Runs {offset, canonical, numel} of rank r's shard in engine's layout.
function M.runs_of(engine, r) return engine:state_parts().shard.runs_of(r) end

return M
