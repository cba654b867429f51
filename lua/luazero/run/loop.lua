-- run/loop.lua — a training run's steps: each optimizer step and, when due,
-- the validation loss; its metrics record (docs/formats.md) logged and its
-- line printed; a loss that is not finite, or a step past the memory
-- budget, stops the run; checkpoints when due. run: the table
-- scripts/train.lua's set-up builds (engine, loaders, flags, ex, ...).
local lz = require("luazero")
local clock = require("luazero.clock")
local monitor = require("luazero.monitor")
local restart = require("luazero.checkpoint.restart")
local saves = require("luazero.run.saves")
local start = require("luazero.run.start")
local M = {}

local function mib(b) return b / 2 ^ 20 end

local function mem_record()
  local m = lz.mem()
  m.peak_rss = lz.peak_rss()
  m.peak_ledger = lz.mem_total_peak()
  return m
end

-- The device side of the ledger (bytes per category now, and the peak of
-- all of them together); nil on the cpu.
local function dev_mem_record(device)
  if device == "cpu" then return nil end
  local m = lz.mem_device()
  m.peak = lz.mem_device_total_peak()
  return m
end

-- A loss that is not finite: the run stops, naming the step.
local function not_finite(v) return not (math.abs(v) < math.huge) end

-- Where the peak learning rate came from, for a diverged run's message:
-- --lr where given (it sets a scheduler's warmup_max_lr too), else a
-- config's scheduler warmup_max_lr where it sets one, else its lr.
local function lr_knob(flags, cfg)
  if flags.lr or not flags.config then return "--lr" end
  local raw = cfg and type(cfg.raw) == "table" and type(cfg.raw.scheduler) == "table" and
              type(cfg.raw.scheduler.params) == "table" and cfg.raw.scheduler.params
  if raw and type(raw.warmup_max_lr) == "number" then
    return ("--lr, or --config %s's scheduler.params.warmup_max_lr"):format(flags.config)
  end
  return ("the learning rate (--lr, or --config %s's optimizer.params.lr or the " ..
          "scheduler's warmup_max_lr)"):format(flags.config)
end

-- One optimizer step and, when due, the validation loss; returns the
-- metrics record (docs/formats.md), the step's result and the
-- checkpointing profile.
local function train_step(run, step)
  local engine, flags, ex = run.engine, run.flags, run.ex
  local tokens_per_step = run.B * run.T * run.accum * run.world
  run.comm.bytes_reset()
  lz.copy_bytes_reset()
  local wait0 = engine:copy_wait_s()
  local copy0 = flags.device == "sim" and lz.sim_copy_ns()
  local t0 = clock.now()
  local read0, written0 = engine:nvme_bytes()
  engine:expert_bytes() -- (the step's count starts here)
  local r = ex.checked_rank(engine.train_batch, engine, run.loader)
  local dt = clock.now() - t0
  local read1, written1 = engine:nvme_bytes()
  local rec = {
    -- JSON has no inf: an overflowed step logs grad_norm -1 (skipped true).
    step = step, loss = r.loss, lr = r.lr,
    grad_norm = r.grad_norm < math.huge and r.grad_norm or -1,
    loss_scale = r.loss_scale, skipped = r.skipped, tokens = saves.tokens(run, step),
    samples = saves.samples(run, step),
    tokens_per_s = tokens_per_step / dt, step_ms = dt * 1000, wall_time = clock.unix(),
    mem = mem_record(),
    dev_mem = dev_mem_record(flags.device), comm = run.comm.bytes(),
  }
  -- Bytes copied between host and device memory in the step.
  if flags.device ~= "cpu" then
    local c = lz.copy_bytes()
    rec.h2d, rec.d2h = c.h2d, c.d2h
    -- How long the host waited for copies meant to overlap, and (sim) how
    -- long the copies took.
    rec.copy_wait_ms = (engine:copy_wait_s() - wait0) * 1000
    if copy0 then rec.copy_ms = (lz.sim_copy_ns() - copy0) / 1e6 end
  end
  -- This rank's swap-file traffic in the step (offload to NVMe).
  if read1 then rec.nvme_read, rec.nvme_written = read1 - read0, written1 - written0 end
  local prof = run.model:checkpoint_profile(true)
  if prof then rec.checkpoint_ms = prof end
  -- An MoE model's load-balancing loss and tokens per expert.
  local routed = run.model.router_metrics and run.model:router_metrics()
  if routed then rec.aux_loss, rec.expert_tokens = routed.aux_loss, routed.expert_tokens end
  -- Stage 3: the experts' bytes this rank's gathers read in the step (from
  -- NVMe under offload_param nvme), and what gathering every expert reads.
  local xread, xfull = engine:expert_bytes()
  if xfull > 0 then rec.expert_bytes_read, rec.expert_bytes = xread, xfull end
  if run.n_val > 0 and ((flags.eval_every > 0 and step % flags.eval_every == 0) or
                        step == flags.steps) then
    rec.val_loss = ex.checked_rank(engine.evaluate, engine, run.val_loader, run.n_val)
    run.model:checkpoint_profile(true) -- the next step's profile counts training only
  end
  -- A skipped step's overflow is in its gradients: under fp16's dynamic
  -- loss scaling the scale falls and a later step goes through. A loss
  -- that is not finite means the weights diverged, and so does a gradient
  -- that is not finite where no scale can fall (fp32, bf16): every step
  -- from there would be skipped. The run stops, the step's record logged.
  -- The first step's loss is the starting weights' own, before any update.
  if step == run.first and not_finite(r.loss) then
    ex.user_error(("step %d: the loss is %s before any update: %s give a non-finite loss; " ..
                   "check those weights"):format(step, tostring(r.loss), start.describe(flags)))
  end
  for _, l in ipairs({ { "loss", r.loss }, { "validation loss", rec.val_loss or 0 },
                       { "gradient norm", engine.dtype ~= "fp16" and r.grad_norm or 0 } }) do
    if not_finite(l[2]) then
      rec.diverged = true
      if run.log then run.log.write(rec, ("step %d's record"):format(step)) end
      -- (a fresh run's first gradients come before any update: the weights
      -- or the data, not the lr)
      if step == 1 and l[1] == "gradient norm" then
        ex.user_error(("step 1: the gradient norm is %s before any update: %s and this data " ..
                       "give non-finite gradients; check those weights and the data")
                      :format(tostring(l[2]), start.describe(flags)))
      end
      ex.user_error(("step %d: the %s is %s: training diverged; lower %s (it was %g)")
                    :format(step, l[1], tostring(l[2]), lr_knob(flags, run.cfg), run.lr))
    end
  end
  return rec, r, prof
end

-- The time left: the steps to go at this run's pace so far (its evaluations
-- and saves included), "" at the last step.
local function eta(run, step)
  if step >= run.flags.steps then return "" end
  local per = (clock.now() - run.started) / (step - run.first + 1)
  return " | eta " .. clock.span(per * (run.flags.steps - step))
end

-- After a skipped step: what the dynamic scaler did with the overflow
-- (DeepSpeed's OVERFLOW line says the same).
local function next_scale(scaler, tried)
  if not scaler.dynamic then return " (static)" end
  if scaler.scale < tried then return (", next %g"):format(scaler.scale) end
  return (", kept: hysteresis %d left"):format(scaler.hysteresis)
end

local function say_step(run, step, rec, r, prof)
  run.ex.say(("step %5d/%d | loss %.4f%s | lr %.2e | norm %.3f | %.0f tok/s | %.0f ms | " ..
              "mem %.1f MiB, rss %.0f MiB%s%s%s%s%s")
    :format(step, run.flags.steps, r.loss,
            rec.val_loss and (" | val %.4f"):format(rec.val_loss) or "", r.lr, r.grad_norm,
            rec.tokens_per_s, rec.step_ms, mib(lz.mem_total()),
            mib(rec.mem.peak_rss), rec.time and monitor.breakdown.line(rec.time) or "",
            r.skipped and (" | skipped (overflow), loss scale %g%s"):format(r.loss_scale,
              next_scale(run.engine.scaler, r.loss_scale)) or "",
            prof and (" | checkpointed blocks: forward %.0f ms, recompute %.0f ms, " ..
                      "backward %.0f ms"):format(prof.forward, prof.recompute, prof.backward)
            or "",
            rec.expert_bytes and (" | expert bytes read %.1f of %.1f MiB")
                                 :format(mib(rec.expert_bytes_read), mib(rec.expert_bytes)) or "",
            eta(run, step)))
end

-- run.budget (run/config.lua's held_budget): a step whose peak RSS or
-- ledger peak passes it stops the run.
local function check_budget(run, step, rec)
  if not run.budget then return end
  local ledger = lz.mem_total_peak()
  local over = math.max(rec.mem.peak_rss, ledger)
  if over > run.budget then
    -- (on the cpu only NVMe takes states out of memory; a higher stage
    -- shards them only over more ranks)
    local cpu = run.flags.device == "cpu"
    run.ex.user_error(("step %d: rank %d's peak memory %.0f MiB (RSS %.0f MiB, ledger %.0f MiB) " ..
                       "is over the memory budget %.0f MiB (%s); offload the optimizer states " ..
                       "or parameters%s (zero_optimization.offload_optimizer / offload_param%s), " ..
                       "%s, or raise the budget")
                      :format(step, run.rank, mib(over), mib(rec.mem.peak_rss), mib(ledger),
                              mib(run.budget), run.budget_source, cpu and " to NVMe" or "",
                              cpu and ": device nvme, nvme_path" or "",
                              run.world > 1 and "raise the ZeRO stage" or
                              "run more ranks at a higher ZeRO stage"))
  end
end

-- Steps run.first .. --steps, then the save in flight finished.
function M.run(run)
  local flags, ex = run.flags, run.ex
  saves.plan(run)
  run.started, run.skipped0 = clock.now(), run.engine.skipped_steps
  for step = run.first, flags.steps do
    run.mon:before_step(step)
    local rec, r, prof = train_step(run, step)
    ex.checked_rank(run.mon.after_step, run.mon, rec) -- a full disk: exit 1, as --log
    say_step(run, step, rec, r, prof)
    if run.log then run.log.write(rec, ("step %d's record"):format(step)) end
    check_budget(run, step, rec)
    restart.fault_hook(run.rank, step) -- test hook: LZ_FAULT_KILL
    saves.if_due(run, step)
  end
  saves.steps_done(run)
  -- No step ran (--steps 0 with --init, or a resume at its last step): the
  -- validation loss of the weights as loaded, to the last bit.
  if run.first > flags.steps and run.n_val > 0 then
    local v = ex.checked_rank(run.engine.evaluate, run.engine, run.val_loader, run.n_val)
    if not_finite(v) then
      ex.user_error(("the validation loss is %s: %s give a non-finite loss; check those weights")
                    :format(tostring(v), start.describe(flags)))
    end
    ex.say(("val_loss %.17g"):format(v))
  end
  saves.finish(run)
end

return M
