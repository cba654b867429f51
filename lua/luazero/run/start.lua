-- run/start.lua — the weights a training run starts from: drawn from
-- --seed, Hugging Face weights (--init), or a checkpoint (--resume), whose
-- manifest is checked before anything is built and whose states, batch
-- position and step are restored after. ex: a luazero.run.exits.
local clock = require("luazero.clock")
local hf = require("luazero.hf")
local inputs = require("luazero.run.inputs")
local M = {}

-- --resume: the checkpoint's manifest, read before anything is built; a
-- --steps below its step would run nothing; a LoRA run's flags and base
-- must be the saved ones (without --init: the recorded --init). Returns the
-- manifest (nil without --resume).
function M.check_resume(ex, flags)
  if not flags.resume then return end
  local m = inputs.manifest(ex, flags.resume)
  if flags.steps < m.global_steps then
    ex.user_error(("--steps %d is below the checkpoint's step %d (%s): there is nothing to run; " ..
                   "give --steps %d or more (the run's total, as when it was saved)")
                  :format(flags.steps, m.global_steps, flags.resume, m.global_steps))
  end
  local init = ex.checked(require("luazero.checkpoint.resume").check, flags, m, flags.resume)
  if init then
    flags.init = init
    ex.say(("resume: the base weights from the checkpoint's --init %s%s"):format(init,
           m.init_xxh64 and (" (xxh64 " .. m.init_xxh64 .. ", as saved)") or ""))
  end
  return m
end

-- A schedule's kind: its name without the step counts (warmup 6 + cosine
-- is warmup + cosine).
local function schedule_kind(name) return (name:gsub("%d+ ", "")) end

-- A --steps other than the saved run's stretches (or shrinks) a schedule
-- laid over --steps, a schedule of another kind or peak (a --config
-- without a scheduler block: a constant lr) replaces the saved run's from
-- the next step, and so does another gradient_clipping: each said at start. m: check_resume's manifest; sched and
-- peak: this run's schedule name and peak lr.
function M.note_resumed_schedule(ex, flags, cfg, m, sched, peak)
  if not m then return end
  local was = type(m.extra) == "table" and m.extra.schedule
  if type(was) == "string" and schedule_kind(was) ~= schedule_kind(sched) then
    ex.say(("resume: the saved run's lr schedule was %s, this run's is %s%s; from step %d the " ..
            "lr follows this run's (the saved run's --config and flags keep its own)")
           :format(was, sched, sched == "constant" and " (the --config has no scheduler block)" or "",
                   m.global_steps + 1))
  elseif type(was) == "string" and tonumber(m.extra.lr) and
         math.abs(m.extra.lr - peak) > 1e-9 * math.abs(peak) then
    ex.say(("resume: peak lr %g, the saved run's %g; from step %d the lr follows this run's")
           :format(peak, m.extra.lr, m.global_steps + 1))
  end
  local clip = type(m.config) == "table" and tonumber(m.config.gradient_clipping)
  if clip and clip ~= cfg.gradient_clipping then
    ex.say(("resume: gradient_clipping %g, the saved run's %g (0: none)"):format(
      cfg.gradient_clipping, clip))
  end
  local seed = type(m.extra) == "table" and tonumber(m.extra.seed)
  if seed and flags.seed and seed ~= flags.seed then
    ex.say(("resume: --seed %d, the saved run's %d: the weights, the data's order and position " ..
            "and every generator come from the checkpoint, so the seed changes nothing; start a " ..
            "new run (no --resume) for another draw"):format(flags.seed, seed))
  end
  local saved = type(m.extra) == "table" and tonumber(m.extra.steps)
  local sch = cfg.scheduler
  local total = sch and sch.type ~= "WarmupLR" and (sch.params or {}).total_num_steps
  local over_steps = not flags.config and "the warmup + cosine schedule" or
                     total == flags.steps and ("scheduler %s"):format(sch.type)
  if saved and saved ~= flags.steps and over_steps then
    ex.say(("resume: --steps %d, the saved run had --steps %d: %s now spans %d steps, not %d " ..
            "(--steps %d keeps the saved run's)%s")
           :format(flags.steps, saved, over_steps, flags.steps, saved, saved,
                   flags.warmup_kept and
                   ("; its warmup stays the saved run's %d step%s (--warmup sets another)")
                   :format(flags.warmup, flags.warmup == 1 and "" or "s") or ""))
  end
end

-- A resume with another --steps, no --warmup and no --config keeps the
-- saved run's warmup steps (m: check_resume's manifest): the cosine
-- stretches over the new --steps, the warmup, done already, is not started
-- again over 10% of them.
function M.keep_warmup(flags, m)
  local w = m and type(m.extra) == "table" and tonumber(m.extra.warmup)
  if not w or flags.warmup ~= nil or flags.config then return end
  -- (flags.warmup unset: the default warmup of the new --steps)
  if require("luazero.run.config").warmup(flags) ~= w then
    flags.warmup, flags.warmup_kept = w, true
  end
end

-- --init: Hugging Face weights into the engine, each rank reading its part.
function M.init_from_hf(ex, run)
  local t0 = clock.now()
  local r = ex.checked(hf.load_into, run.engine, run.flags.init)
  -- A LoRA run records its base's checksum: a resume must adapt the same.
  run.engine:set_init_path(run.flags.init,
                           run.model.lora and ex.checked(hf.checksum, run.flags.init) or nil)
  ex.say(("initialized from %s: %d tensors from %d file%s in %.2f s"):format(run.flags.init,
         r.tensors, r.files, r.files == 1 and "" or "s", clock.now() - t0))
end

-- --resume: the engine's states, the batch generator, the next step.
function M.resume(ex, run)
  -- another model or optimizer is the input's fault (exit 2); reading the shards is the rank's
  ex.checked(require("luazero.checkpoint.load").check, run.engine, run.flags.resume)
  local m = ex.checked_rank(run.engine.load, run.engine, run.flags.resume)
  local pos = m.extra and m.extra.data
  -- The position counts batches of the data it was saved with: other data
  -- (even with as many examples) would be read from the wrong place.
  if pos and pos.fingerprint and run.data_fingerprint and pos.fingerprint ~= run.data_fingerprint then
    ex.user_error(("--resume %s: the checkpoint trained on %s (size:xxh64 %s), --data %s is " ..
                   "other data (%s); its data position would pick other examples: resume with " ..
                   "the same --data, or start a new run (--init, or no --resume)")
                  :format(run.flags.resume, tostring(pos.file), pos.fingerprint, run.flags.data,
                          run.data_fingerprint))
  end
  if pos then ex.checked(run.loader.set_position, run.loader, pos) end
  run.first = m.global_steps + 1
  -- the tokens trained so far (the log's count goes on from them), and a
  -- global batch other than the saved run's, said
  local per_step = run.B * run.T * run.accum * run.world
  local saved = type(m.extra) == "table" and tonumber(m.extra.tokens)
  run.tokens0 = saved or m.global_steps * per_step
  run.samples0 = type(m.extra) == "table" and tonumber(m.extra.samples) or
                 m.global_steps * run.B * run.accum * run.world
  if saved and m.global_steps > 0 and saved ~= m.global_steps * per_step then
    ex.say(("resume: %d tokens a step (batch %d x %d, micro-batches %d, ranks %d); the saved " ..
            "run trained %d tokens in %d steps (%.0f a step); the log's tokens count on from %d")
           :format(per_step, run.B, run.T, run.accum, run.world, saved, m.global_steps,
                   saved / m.global_steps, saved))
  end
  ex.say(("resumed from %s: step %d (%d optimizer steps), saved at world %d stage %d")
         :format(m.dir, m.global_steps, m.optimizer_steps, m.world_size, m.stage))
end

-- Where the weights a run starts from came from, for messages.
function M.describe(flags)
  if flags.resume then return "the weights resumed from " .. flags.resume end
  if flags.init then return "the weights loaded from --init " .. flags.init end
  return "the weights drawn from --seed"
end

return M
