-- run/stage_auto.lua — --stage auto: the lowest ZeRO stage whose model
-- states fit the per-rank budget; when none does, stage 3 with the
-- optimizer states (and the parameter shard) on NVMe where that fits, in
-- the config's nvme_path or --nvme-path; the activations of one
-- micro-batch come off the budget first. ex: a luazero.run.exits.
local config = require("luazero.config")
local estimate = require("luazero.estimate")
local store = require("luazero.zero.store")
local Placement = require("luazero.zero.plan")
local M = {}

-- Sets cfg's stage (and NVMe placement) for model on `world` ranks
-- training micro-batches of batch = { B, T } (nil: activations not
-- counted); a stage given outright is kept, and --nvme-path refused beside it.
-- What a held budget keeps free beside the estimate, as a share of it:
-- memory the ledger does not see, which grows during the steps.
local HEADROOM = 0.05

-- A stage the config names, on the CPU: its estimate (model states, comm
-- buffers, one micro-batch's activations) against a budget the run holds is
-- refused now, not at the first step; against what the machine has (a
-- cgroup's or ulimit -v's room, MemAvailable) it is said, since the kernel
-- may kill the run there. (The estimate is within a few percent of the
-- ledger, over it at stage 3.)
-- What the estimate reads of this run: its settings (the engine's, on
-- device) and the model's counts at world ranks.
local function estimate_inputs(cfg, model, world, device)
  local settings = estimate.settings_of(cfg, device)
  local counts = estimate.counts(model, world,
                                 cfg.zero_optimization.stage3_param_persistence_threshold,
                                 require("luazero.optim.formats").block_of(settings.formats),
                                 settings.ep_size)
  return settings, counts
end

local function check_named_stage(ex, cfg, model, world, flags, batch)
  local z = cfg.zero_optimization
  local device = flags.device or "cpu"
  if device ~= "cpu" or not batch then return end
  local placement = estimate.placement_name(z.offload_optimizer.device or "none",
                                            z.offload_param.device or "none")
  if not placement then return end
  local settings, counts = estimate_inputs(cfg, model, world, device)
  local states = estimate.need_at(counts, settings, z.stage, placement, cfg.dtype,
                                  cfg.grad_accum_dtype ~= "fp32" and "working" or nil, device, true)
  if not states then return end
  local act = estimate.activations(model, batch[1], batch[2], cfg.dtype, settings.ep_size).device
  local need = states + act
  local held = require("luazero.run.config").held_budget(cfg)
  local budget, source = config.memory_budget(cfg, tonumber(os.getenv("LOCAL_WORLD_SIZE") or ""))
  -- A held budget is checked against the process's whole memory, as the
  -- steps check it: what it holds already and the headroom --stage auto
  -- keeps come on top of the estimate.
  local also = ""
  if held then
    local rss, room = require("luazero").peak_rss(), math.floor(HEADROOM * budget)
    need = need + rss + room
    also = (", the %s this process holds and %s of headroom"):format(
      estimate.format_bytes(rss), estimate.format_bytes(room))
  end
  if budget >= need then return end
  local what = ("stage %d needs about %s per rank (%s of model states and buffers, %s of " ..
                "activations for a %d x %d micro-batch%s), more than %s (%s)")
               :format(z.stage, estimate.format_bytes(need), estimate.format_bytes(states),
                       estimate.format_bytes(act), batch[1], batch[2], also,
                       estimate.format_bytes(budget), source)
  -- (on the cpu, an optimizer "offloaded" to the cpu stays in the same memory)
  local fix = "--stage auto picks a stage or an NVMe offload that fits; or offload the " ..
              "optimizer states to NVMe (zero_optimization.offload_optimizer: device nvme, " ..
              "nvme_path), add ranks, lower --micro-batch, add --checkpoint-activations"
  if held then
    ex.user_error(("%s: the run would stop at its first step over the budget it holds; %s")
                  :format(what, fix))
  end
  ex.say(("memory: %s: the run may be killed when it gets there; %s"):format(what, fix))
end

function M.resolve(ex, cfg, model, world, flags, batch)
  local z = cfg.zero_optimization
  if z.stage ~= "auto" then
    if flags.nvme_path then
      ex.user_error("--nvme-path is where --stage auto puts swap files when it picks NVMe; " ..
                    "without --stage auto set zero_optimization.offload_optimizer.nvme_path")
    end
    check_named_stage(ex, cfg, model, world, flags, batch)
    return
  end
  local budget, source = config.memory_budget(cfg, tonumber(os.getenv("LOCAL_WORLD_SIZE") or ""))
  -- (a budget the run holds, which each step checks: nil for MemAvailable's)
  local held = require("luazero.run.config").held_budget(cfg)
  local act_note = ""
  -- (the estimate reads any device but cpu as an accelerator's memory apart)
  local device = flags.device
  local settings, counts = estimate_inputs(cfg, model, world, device)
  -- (an MoE model's experts over moe.ep_size ranks: their arenas take every
  -- rank's rows, their parameters are a share)
  local ep_size = settings.ep_size
  if batch then
    -- (what the model's arenas hold for one micro-batch, with the
    -- activation checkpointing it is set to)
    local act = estimate.activations(model, batch[1], batch[2], cfg.dtype, ep_size).device
    local what = ("the activations of a %d x %d micro-batch need %s"):format(batch[1], batch[2],
                                                                         estimate.format_bytes(act))
    if act >= budget then
      ex.user_error(("stage auto: %s per rank, more than the whole budget %s (%s)%s: lower " ..
                     "--micro-batch or --seq-len, add --checkpoint-activations, or raise %s")
                    :format(what, estimate.format_bytes(budget), source,
                            held and "; the run would stop at its first step" or "", source))
    end
    budget = budget - act
    act_note = (" (what is left after %s of activations for a %d x %d micro-batch)")
               :format(estimate.format_bytes(act), batch[1], batch[2])
  end
  -- A held budget is checked against the process's whole memory: what it
  -- holds already (libraries, the model's description) comes off it too.
  if held then
    local rss = require("luazero").peak_rss()
    if rss >= budget then
      ex.user_error(("stage auto: this process holds %s already, before any model state, " ..
                     "more than the budget %s%s: the run would stop at its first step over " ..
                     "it; raise %s"):format(estimate.format_bytes(rss),
                                            estimate.format_bytes(budget), act_note, source))
    end
    -- (and room for what grows outside the ledger while the steps run:
    -- thread stacks, the libraries' scratch, Lua's heap; about 50 MiB at
    -- gpt2's size, 4% of its 1.3 GiB)
    local room = math.floor(HEADROOM * budget)
    budget = budget - rss - room
    local off = ("the %s this process holds and %s of headroom"):format(
      estimate.format_bytes(rss), estimate.format_bytes(room))
    act_note = act_note == "" and (" (what is left after %s)"):format(off)
               or act_note:gsub("%)$", (", and %s)"):format(off))
  end
  local persistent = 0
  for _, e in ipairs(model.param_table) do
    if e.numel <= z.stage3_param_persistence_threshold then persistent = persistent + e.numel end
  end
  settings.overlap = nil -- stage 3's default unless the config says
  if z.overlap_comm_given then settings.overlap = z.overlap_comm end
  local nvme_path = z.offload_optimizer.nvme_path or z.offload_param.nvme_path or flags.nvme_path
  -- An offload the config asks for allows only the stages it works at
  -- (offload_optimizer from 1, offload_param 3).
  local min_stage, min_why = 0, nil
  for _, key in ipairs({ "offload_optimizer", "offload_param" }) do
    local rule = Placement.offload_stages[key]
    if Placement.offloaded(z[key].device) and rule.least > min_stage then
      min_stage, min_why = rule.least, ("zero_optimization.%s needs %s"):format(key, rule.names)
    end
  end
  -- (the comm buffers and the optimizer's scratch are counted too: the
  -- first step allocates them, whatever the budget's source)
  local stage, why, fits, placement, detail = estimate.pick_stage(model.n_params, world, budget,
    cfg.dtype, { persistent = persistent, grads = cfg.grad_accum_dtype ~= "fp32" and "working" or nil,
      nvme = true, nvme_path = nvme_path, device = device, settings = settings, counts = counts,
      min_stage = min_stage, min_why = min_why, all = true, budget_note = act_note })
  -- A budget the run holds (--memory-budget, luazero.memory_budget,
  -- LZ_MEMORY_BUDGET; run/loop.lua checks each step) that no placement
  -- meets, or that this process's own memory fills before any model state,
  -- would stop the run after its first step: refused now. So is a memory
  -- cgroup's or ulimit -v's room that none meets: past it the kernel kills
  -- the run (or an allocation fails), where MemAvailable only estimates.
  local hard = source:find("^the memory cgroup") or source:find("^ulimit %-v")
  if held or (hard and not fits) then
    local fix = ("raise %s, add ranks, or offload (zero_optimization.offload_optimizer / " ..
                 "offload_param with nvme_path)"):format(source)
    if detail.nvme_short then
      -- (what NVMe's placement keeps beside the swap files)
      fix = ("raise %s, add ranks, or lower zero_optimization.sub_group_size, " ..
             "stage3_prefetch_bucket_size and reduce_bucket_size (the staging and comm " ..
             "buffers beside the swap files)"):format(source)
    end
    if not fits then
      ex.user_error(("stage auto: %s; %s: %s"):format(detail.reason, held and
                     "the run would stop at its first step over the budget it holds" or
                     "past that limit the run would be killed", fix))
    end
  end
  if placement then
    if not (z.offload_optimizer.nvme_path or z.offload_param.nvme_path) then
      config.check_writable_dir("--nvme-path", nvme_path)
    end
    local pl = estimate.placement_of[placement]
    -- (the placements pick_stage tries put states in swap files: a store
    -- kind that is not resident)
    for key, dev in pairs({ offload_optimizer = pl.opt, offload_param = pl.param }) do
      if not store.of_config(dev).resident then
        z[key].device = dev
        z[key].nvme_path = z[key].nvme_path or nvme_path
      end
    end
    -- offload_param.buffer_size must hold the largest slice a gather reads.
    if not store.of_config(pl.param).resident then
      local slice = 0
      for _, seg in ipairs(counts.segments) do slice = math.max(slice, seg.slice) end
      z.offload_param.buffer_size = math.max(z.offload_param.buffer_size or 0, slice)
    end
  end
  config.set_stage(cfg, stage)
  ex.say(("stage auto: %s (budget from %s)"):format(why, source))
end

return M
