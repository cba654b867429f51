-- checkpoint/async.lua — saves that do not stop training. At the save's
-- step every rank copies its states into one host buffer of its own (the
-- snapshot: the shard's raw bytes, on the ledger as offload, allocated once
-- and reused) and hands it to a writer thread (core/io/shard_job.c), which
-- compresses, writes and fsyncs the shard while training goes on. At each
-- step boundary the ranks poll their writers and agree with one small
-- collective; at the first boundary where every rank's shard is written,
-- every rank finishes that save as a synchronous one does (manifest,
-- rename, `latest`, pruning: checkpoint/save.lua), so all ranks finish the
-- same save at the same step. One save at a time: a new one, and the end
-- of the run, wait for the one in flight. The files are byte for byte a
-- synchronous save's. docs/checkpoints.md.
--
--   async.start(engine, dir, extra, opts)  -- returns at once (after the copy)
--   local final, info = async.poll(engine) -- each step: the step folder once done
--   async.wait(engine)                     -- before the end (or a new save)
local ffi = require("ffi")
local lz = require("luazero")
local clock = require("luazero.clock")
local disk = require("luazero.checkpoint.disk")
local save = require("luazero.checkpoint.save")

local C = lz.C
local check = disk.check

local M = {}

local buffers = setmetatable({}, { __mode = "k" }) -- engine -> its snapshot buffer
local pending = setmetatable({}, { __mode = "k" }) -- engine -> the save in flight

-- Why engine saves synchronously instead, or nil: states on NVMe would be
-- held whole in host memory by a snapshot, which is what their tier avoids.
function M.refusal(engine)
  if engine:state_parts().shard.swapped then
    return "the optimizer states are on NVMe (a snapshot would hold them in host memory)"
  end
end

-- The engine's snapshot buffer, at least `bytes` long.
local function buffer(engine, bytes)
  local b = buffers[engine]
  if b and b:bytes() >= bytes then return b end
  if b then b:free() end
  b = lz.tensor({ math.ceil(bytes / 4) }, "f32", "offload")
  buffers[engine] = b
  return b
end

-- Whether a save is in flight.
function M.pending(engine) return pending[engine] ~= nil end

-- Starts a save of engine's state as dir/step-NNNNNN (save.save's
-- arguments), after the one in flight is finished. Collective. Returns the
-- step folder it will finish as and the seconds the snapshot took.
function M.start(engine, dir, extra, opts)
  M.wait(engine)
  local ctx = save.begin(engine, dir, extra, opts)
  local p = { ctx = ctx, t0 = clock.now() }
  local parts = ctx.parts
  if parts.rank < ctx.writers then
    local ok, err = pcall(function()
      local n = parts.shard.numel
      local bytes = n * #parts.shard.states * disk.SB
      local buf = buffer(engine, bytes)
      local got = save.snapshot(parts, ffi.cast("char *", buf.data))
      assert(got == bytes, "checkpoint: the snapshot did not cover the engine's states")
      local out = ffi.new("lz_shard_job *[1]")
      local path = ctx.tmp .. "/" .. disk.shard_name(parts.rank, ctx.writers)
      check(C.lz_shard_job_start(out, path, buf.data, bytes, disk.BLOCK * disk.SB,
                                 ctx.o.zstd_level, ctx.o.workers))
      p.job, p.elems = out[0], n
    end)
    -- A failure here is every rank's at the next poll.
    if not ok then p.err = err end
  end
  p.copy_s = clock.now() - p.t0
  pending[engine] = p
  return ctx.final, p.copy_s
end

-- This rank's writer: 1 written (or no shard here), 0 writing, -1 failed.
local function writer_state(p, block)
  if p.err then return -1 end
  if p.job == nil then return 1 end
  if not block and C.lz_shard_job_done(p.job) == 0 then return 0 end
  local info = ffi.new("lz_shard_info")
  local st = C.lz_shard_job_join(p.job, info)
  p.job = nil
  if st ~= 0 then
    p.err = lz.last_error()
    return -1
  end
  p.info = info
  return 1
end

-- At a step boundary (every rank): whether the save in flight is written
-- on every rank, and if so finishes it. block: wait for this rank's writer
-- first. Returns the step folder and { copy_s, total_s } once finished,
-- nil while in flight (or none is). A failure on any rank raises on all.
function M.poll(engine, block)
  local p = pending[engine]
  if not p then return nil end
  local state = writer_state(p, block)
  local vals = save.shard_vals(p.info, p.elems)
  vals[#vals + 1] = state
  local ok, all = pcall(save.agree_shards, engine, p.ctx, state ~= -1, p.err, vals)
  if not ok then
    pending[engine] = nil
    if p.job ~= nil then C.lz_shard_job_join(p.job, nil) end -- its file goes with the folder
    error(all, 0)
  end
  for _, v in ipairs(all) do
    if v[#v] ~= 1 then return nil end
  end
  pending[engine] = nil
  local final = save.finish(engine, p.ctx, all)
  return final, { copy_s = p.copy_s, total_s = clock.now() - p.t0 }
end

-- Finishes the save in flight, if any (collective): M.poll's results.
function M.wait(engine) return M.poll(engine, true) end

-- On the way out after an error: the writer threads are joined. With one
-- rank the save in flight is finished (its snapshot is whole); with
-- several it is left unfinished (finishing needs every rank, which may be
-- gone), its temporary folder removed by a later save. Returns a line to
-- say, or nil.
function M.at_exit()
  local lines = {}
  for engine, p in pairs(pending) do
    if p.ctx.parts.world == 1 then
      local ok, final = pcall(M.wait, engine)
      lines[#lines + 1] = ok and ("saved %s (the save in flight, finished before exiting)")
                             :format(final)
                          or ("the save in flight failed: " .. tostring(final))
    else
      pending[engine] = nil
      if p.job ~= nil then C.lz_shard_job_join(p.job, nil) end
      lines[#lines + 1] = ("the save of %s in flight is left unfinished: it needs every rank")
                          :format(p.ctx.final)
    end
  end
  return #lines > 0 and table.concat(lines, "; ") or nil
end

-- Frees engine's snapshot buffer (after M.wait).
function M.release(engine)
  assert(not pending[engine], "checkpoint: release with a save in flight; wait for it first")
  if buffers[engine] then
    buffers[engine]:free()
    buffers[engine] = nil
  end
end

return M
