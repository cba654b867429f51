-- monitor — what a training run reports about itself as DeepSpeed's config
-- asks: the monitors ("tensorboard", "csv_monitor": each step's scalars
-- under DeepSpeed's tags, on rank 0), "wall_clock_breakdown" (each step's
-- milliseconds per engine phase, in the metrics record's "time") and
-- "flops_profiler" (a per-module profile at profile_step). docs/training.md.
--
--   local mon = monitor.start({ engine = engine, model = model, cfg = cfg, rank = rank,
--                               B = B, T = T })
--   mon:before_step(step)  local rec = ... engine:train_batch(loader) ...
--   mon:after_step(rec)    -- adds rec.time, writes the scalars, the profile when due
--   mon:close()
local lz = require("luazero")
local atomic = require("luazero.io.atomic")
local fs = require("luazero.io.fs")

local M = {
  tensorboard = require("luazero.monitor.tensorboard"),
  csv = require("luazero.monitor.csv"),
  breakdown = require("luazero.monitor.breakdown"),
  flops = require("luazero.monitor.flops"),
}

-- A metrics record's scalars under DeepSpeed's tags (Train/Samples/...:
-- the x axis counts samples, step x train_batch_size), with luazero's own
-- beside them; val_loss and the phases only where the record has them.
M.tags = {
  { "Train/Samples/train_loss", function(r) return r.loss end },
  { "Train/Samples/lr", function(r) return r.lr end },
  { "Train/Samples/loss_scale", function(r) return r.loss_scale end },
  { "Train/Samples/grad_norm", function(r) return r.grad_norm end },
  { "Train/Samples/tokens_per_s", function(r) return r.tokens_per_s end },
  { "Train/Samples/step_ms", function(r) return r.step_ms end },
  { "Train/Samples/peak_rss", function(r) return r.mem and r.mem.peak_rss end },
  { "Train/Samples/peak_ledger", function(r) return r.mem and r.mem.peak_ledger end },
  { "Train/Samples/val_loss", function(r) return r.val_loss end },
}
for _, phase in ipairs(M.breakdown.phases) do
  M.tags[#M.tags + 1] = { "Train/Samples/elapsed_time_ms_" .. phase,
                          function(r) return r.time and r.time[phase] end }
end

function M.scalars(rec)
  local out = {}
  for _, t in ipairs(M.tags) do
    local v = t[2](rec)
    if type(v) == "number" then out[#out + 1] = { t[1], v } end
  end
  return out
end

-- A monitor's folder: output_path/job_name (output_path "": job_name here).
function M.folder(block)
  if block.output_path == "" then return block.job_name end
  return (block.output_path:gsub("/+$", "")) .. "/" .. block.job_name
end

-- The files the monitors of cfg write, for io/paths.lua: { what, path,
-- names (a folder: the names made in it) }.
function M.files(cfg)
  local out = {}
  local tb, csv_block = cfg.monitor.tensorboard, cfg.monitor.csv_monitor
  if tb.enabled then
    out[#out + 1] = { what = "tensorboard", path = M.folder(tb),
                      names = { "^events%.out%.tfevents%." } }
  end
  if csv_block.enabled then
    local names = {}
    for _, t in ipairs(M.tags) do
      names[#names + 1] = "^" .. M.csv.file_name(t[1]):gsub("%p", "%%%0") .. "$"
    end
    out[#out + 1] = { what = "csv_monitor", path = M.folder(csv_block), names = names }
  end
  if cfg.flops_profiler.enabled and cfg.flops_profiler.output_file then
    out[#out + 1] = { what = "flops_profiler.output_file", path = cfg.flops_profiler.output_file }
  end
  return out
end

local Monitor = {}
Monitor.__index = Monitor

local function open_writers(self, cfg)
  for _, kind in ipairs({ "tensorboard", "csv_monitor" }) do
    local block = cfg.monitor[kind]
    if block.enabled then
      local dir = M.folder(block)
      local made, why = lz.mkdir(dir)
      if not made then
        error(("%s: cannot make the folder %s (%s); point %s.output_path at a writable folder")
              :format(kind, dir, tostring(why):gsub("^checkpoint: ", ""), kind), 0)
      end
      local w, err
      if kind == "tensorboard" then
        w, err = M.tensorboard.open(dir)
      else
        w = M.csv.open(dir)
        -- a resumed run continues its files; a new one says whose rows it joins
        local there = {}
        for _, t in ipairs(M.tags) do
          local name = M.csv.file_name(t[1])
          if not self.resumed and fs.exists(dir .. "/" .. name) then there[#there + 1] = name end
        end
        if #there > 0 then
          print(("csv_monitor: %s holds an earlier run's files (%s%s); this run appends its rows " ..
                 "to them: give csv_monitor another job_name to keep the runs apart")
                :format(dir, there[1], #there > 1 and (" and " .. (#there - 1) .. " more") or ""))
        end
      end
      if not w then error(("%s: %s; point %s.output_path at a writable folder")
                          :format(kind, err, kind), 0) end
      self.writers[#self.writers + 1] = { kind = kind, w = w }
    end
  end
end

-- o: engine, model, cfg (the normalised config), rank, B, T (the
-- micro-batch), resumed (a run that continues its monitors' files). Only
-- rank 0 writes files and prints the profile.
function M.start(o)
  local cfg = o.cfg
  local self = setmetatable({ rank = o.rank or 0, samples = cfg.train_batch_size, writers = {},
                              fp = cfg.flops_profiler, resumed = o.resumed }, Monitor)
  if cfg.wall_clock_breakdown then self.breakdown = M.breakdown.attach(o.engine) end
  if self.fp.enabled then
    self.flops = M.flops.attach(o.model, self.fp, { B = o.B, T = o.T,
                                                    accum = cfg.gradient_accumulation_steps })
    -- The profile covers the step's micro-batches, not an evaluation after them.
    local engine, flops, train_batch = o.engine, self.flops, o.engine.train_batch
    engine.train_batch = function(...)
      local out = { pcall(train_batch, ...) }
      flops:disarm()
      if not out[1] then error(out[2], 0) end
      return unpack(out, 2, table.maxn(out))
    end
  end
  if self.rank == 0 then open_writers(self, cfg) end
  return self
end

function Monitor:before_step(step)
  if self.flops and self.flops:due(step) then self.flops:arm() end
end

-- After step rec.step: rec.time (wall_clock_breakdown), the profile at
-- profile_step, the scalars to each monitor. Errors are one line.
function Monitor:after_step(rec)
  if self.breakdown then rec.time = self.breakdown:last() end
  if self.flops and self.flops:due(rec.step) then
    self.profile = self.flops:finish(rec.step, rec.step_ms)
    if self.rank == 0 then
      local text = M.flops.report(self.profile, self.fp)
      if self.fp.output_file then
        atomic.write(self.fp.output_file, text)
        print(("flops profile of step %d written to %s"):format(rec.step, self.fp.output_file))
      else
        io.stdout:write(text)
      end
      io.stdout:flush()
    end
  end
  if #self.writers == 0 then return end
  local scalars = M.scalars(rec)
  for _, w in ipairs(self.writers) do
    local ok, err = w.w:scalars(rec.samples or rec.step * self.samples, scalars)
    if not ok then
      error(("%s: writing step %d failed (%s); free space there or turn %s off")
            :format(w.kind, rec.step, err, w.kind), 0)
    end
  end
end

-- A run that continues from step `first` (a resume, a restart) after
-- samples0 samples (default: steps of this run's batch): the monitors'
-- files drop what they hold past it (the steps trained again), so no step is
-- shown twice, whatever batch the steps before had. Rank 0; errors are one
-- line.
function Monitor:continue_from(first, samples0)
  local tags = {}
  for i, t in ipairs(M.tags) do tags[i] = t[1] end
  for _, w in ipairs(self.writers) do
    local ok, err = w.w:purge_from((samples0 or (first - 1) * self.samples) + 1, tags)
    if not ok then
      error(("%s: dropping the rows of steps %d and later failed (%s)"):format(w.kind, first,
                                                                              tostring(err)), 0)
    end
  end
end

function Monitor:close()
  for _, w in ipairs(self.writers) do w.w:close() end
  self.writers = {}
end

return M
