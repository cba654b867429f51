-- run/saves.lua — a training run's checkpoints (--save): when they are due
-- (every --save-every steps, every --save-every-minutes, at the last step:
-- luazero/checkpoint/due.lua), and whether they are written in the
-- background (--async-save: luazero/checkpoint/async.lua; states on NVMe
-- save synchronously). run: the table scripts/train.lua's steps share.
local lz = require("luazero")
local clock = require("luazero.clock")
local due_saves = require("luazero.checkpoint.due")
local async_saves = require("luazero.checkpoint.async")
local M = {}

function M.plan(run)
  local flags, ex = run.flags, run.ex
  if not flags.save then return end
  -- SIGINT or SIGTERM (lua/main.c's LUAZERO_SIGNALS) stops the run after
  -- its step, saved (a second one, a second later, at once)
  local signals = rawget(_G, "LUAZERO_SIGNALS")
  if signals then signals.graceful() end
  run.due = due_saves.new(run.comm, flags.save_every, flags.save_every_minutes, flags.steps,
                          signals and signals.pending)
  -- ds_config's checkpoint.writer.decoupled asks for the same.
  run.async = flags.async_save or run.cfg.checkpoint.async
  local why = run.async and async_saves.refusal(run.engine)
  if why then
    ex.say((flags.async_save and "--async-save" or "checkpoint.writer.decoupled") ..
           ": saving synchronously: " .. why)
    run.async = false
  elseif run.async and flags.device == "cpu" then
    local ranks = tonumber(os.getenv("LOCAL_WORLD_SIZE") or "") or 1
    ex.say(("%s: the background writer compresses on the cores the steps use (%d rank%s here " ..
            "x %d thread%s); on a CPU run a save then slows the steps beside it, and leaving a " ..
            "core free (fewer OMP_NUM_THREADS per rank) gives it one (docs/checkpoints.md)")
           :format(flags.async_save and "--async-save" or "checkpoint.writer.decoupled", ranks,
                   ranks == 1 and "" or "s", lz.threads(), lz.threads() == 1 and "" or "s"))
  end
end

local function say_async_saved(ex, dir, t)
  if dir then ex.say(("saved %s in the background (%.2f s from its step)"):format(dir, t.total_s)) end
end

-- The tokens trained up to step `step` (the metrics log's tokens): the
-- resumed checkpoint's count (run.tokens0, at step run.first - 1) and this
-- run's steps since, each of this run's global batch; a checkpoint keeps
-- it, so a resume at another batch size or world counts on from it.
function M.tokens(run, step)
  return (run.tokens0 or 0) + (step - run.first + 1) * run.B * run.T * run.accum * run.world
end
-- The samples (sequences) likewise: the monitors' x axis.
function M.samples(run, step)
  return (run.samples0 or 0) + (step - run.first + 1) * run.B * run.accum * run.world
end

-- After step `step`: a background save that finished is said, and a due
-- checkpoint written (or started).
function M.if_due(run, step)
  local flags, ex = run.flags, run.ex
  if not flags.save then return end
  if run.async then say_async_saved(ex, ex.checked_rank(async_saves.poll, run.engine)) end
  if not run.due:check(step) then return end
  local extra = {
    data = run.loader:position(),
    seed = flags.seed, steps = flags.steps, warmup = run.warmup, lr = run.lr,
    schedule = run.sched, tokens = M.tokens(run, step), samples = M.samples(run, step),
  }
  extra.data.batches = step * run.accum
  extra.data.fingerprint, extra.data.file = run.data_fingerprint, flags.data
  -- (the tokenizer the data was read with, for generate.lua to decode with)
  if flags.tokenizer then
    extra.data.tokenizer = require("luazero.io.fs").absolute(flags.tokenizer)
  end
  local opts = { zstd_level = flags.save_zstd_level, keep = flags.keep, config = run.cfg }
  local t1 = clock.now()
  if run.async then
    say_async_saved(ex, ex.checked_rank(async_saves.wait, run.engine)) -- one save at a time
    local dir, copy_s = ex.checked_rank(async_saves.start, run.engine, flags.save, extra, opts)
    ex.say(("saving %s in the background (snapshot %.2f s)"):format(dir, copy_s))
  else
    local dir = ex.checked_rank(run.engine.save, run.engine, flags.save, extra, opts)
    ex.say(("saved %s in %.2f s"):format(dir, clock.now() - t1))
  end
  run.due:saved()
  local sig = run.due.stop
  if not sig and run.due.stop_signal then
    -- a signal that came while this step saved: this save is the stop's
    -- (every rank saved at this step, so every rank asks)
    local _, now = run.due:agreed()
    sig = now > 0 and now or nil
  end
  if sig and step < flags.steps then -- the save in flight finished, then the process ends by the signal
    M.finish(run)
    ex.say(("stopped by %s after step %d, saved: --resume %s goes on from it")
           :format(sig == 2 and "SIGINT" or sig == 15 and "SIGTERM" or ("signal " .. sig), step,
                   flags.save))
    if run.log then run.log.close() end
    rawget(_G, "LUAZERO_SIGNALS").die(sig)
  end
end

-- After the last step: SIGINT and SIGTERM stop the run at once again (a
-- stop asked at the last step was that step's save).
function M.steps_done(run)
  local signals = rawget(_G, "LUAZERO_SIGNALS")
  if run.flags.save and signals then signals.restore() end
end

-- The end of the run: the save in flight finished, its buffer freed.
function M.finish(run)
  if not run.async then return end
  say_async_saved(run.ex, run.ex.checked_rank(async_saves.wait, run.engine))
  async_saves.release(run.engine)
end

return M
