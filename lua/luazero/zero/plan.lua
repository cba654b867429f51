-- zero/plan.lua — what a ZeRO stage keeps where, as data. Built once from
-- the stage, the dtypes, the offload settings and the device; the engine
-- (zero/engine.lua) and the memory estimate (luazero/estimate.lua) both read
-- it, so what the engine allocates and what the estimate predicts cannot
-- drift apart. DeepSpeed's stage_1_and_2.py / stage3.py split, as a table.
--
--   local plan = require("luazero.zero.plan")
--   local p = plan.new{ stage = 2, dtype = "bf16", offload_optimizer = "cpu" }
--   p.params  = { extent = "full", dtype = "bf16", tier = "device" }
--   p.grads   = { extent = "shard", dtype = "f32", tier = "device" }
--   p.master  = { extent = "shard", dtype = "f32", tier = "host" }   -- alias = "params": none of its own
--   p.optimizer = { extent = "shard", dtype = "f32", tier = "host", ranks = "own", states = { "m", "v" } }
--   p.reduce  = { op = "reduce_scatter", buffered = true, into = "shard" }
--   p.after_step = "gather_full"
--   p:bytes{ full = F, shard = S, persistent = P } -> { device = {...}, host = {...}, nvme = {...} }
--   print(p)                                          -- one line per state
--
-- Extents: "full" (every element, padded), "shard" (this rank's slices),
-- "persistent" (stage 3: the small modules kept whole beside the shard;
-- the others are gathered per module), "none". Tiers are store kinds
-- (zero/store/, one table; the plan asks a kind, never a tier's name):
-- "device" (the compute device's memory), "host" (host memory; pinned on an
-- accelerator), "nvme" (swap files). On a "cpu" device the device is the host: a host-tier state
-- is counted under the ledger's offload category, and the optimizer reads
-- the gradients and updates the fp32 parameters where they already are.
local store = require("luazero.zero.store")
local optimizers = require("luazero.optim.registry")
local formats = require("luazero.optim.formats")

local M = {}

local Plan = {}
Plan.__index = Plan

local dtypes = { fp32 = "f32", bf16 = "bf16", fp16 = "f16", f32 = "f32", f16 = "f16" }
-- The kernels' dtype name of a config dtype (fp32 -> f32, ...).
M.dtypes = dtypes
-- Bytes per element of each dtype: the one table every size is computed from.
local esize = { f32 = 4, bf16 = 2, f16 = 2, u8 = 1 }
M.esize = esize

-- Which stages each offload works at (DeepSpeed's rule, as data): the
-- least stage, and how errors name the stages.
M.offload_stages = {
  offload_optimizer = { least = 1, names = "stage 1, 2 or 3", set = "zero_optimization.stage" },
  offload_param = { least = 3, names = "stage 3", set = "zero_optimization.stage to 3" },
}

-- Whether `key` (offload_optimizer or offload_param) may move states off
-- the device at ZeRO stage `stage`.
function M.stage_allows(key, stage) return stage >= M.offload_stages[key].least end

-- Whether offload_optimizer and offload_param (none|cpu|nvme) may go
-- together on `device`: on an accelerator the parameter shard leaves the
-- device only with the optimizer (which updates it where it lives).
function M.placement_allowed(device, offload_optimizer, offload_param)
  return (device or "cpu") == "cpu" or not M.offloaded(offload_param) or
         M.offloaded(offload_optimizer)
end

-- Whether an offload_*.device value (none|cpu|nvme; nil: none) moves states
-- off the compute device's memory.
function M.offloaded(device)
  local kind = store.of_config(device or "none")
  return kind ~= nil and not kind.on_device
end

-- The states a plan places, in the order it prints them.
M.states = { "params", "grads", "opt_grads", "master" }

-- Ledger category of a state on the device tier (host tier: offload).
local categories = { params = "params", grads = "grads", opt_grads = "grads", master = "optimizer",
                     optimizer = "optimizer", frozen = "params" }

-- The tier an offload_*.device value selects (a store kind's name).
local function tier_of(key, device)
  local kind = store.of_config(device or "none")
  if not kind then
    error(("plan: %s must be %s (got %s)"):format(key, store.config_names(), tostring(device)), 0)
  end
  return kind.name
end

-- opts: stage (0..3), dtype (working: fp32|bf16|fp16), grad_dtype (the
-- gradients': fp32 or the working dtype; fp32), offload_optimizer and
-- offload_param (none|cpu|nvme), device (cpu|sim|cuda; cpu), accum
-- (gradient accumulation steps; 1), optimizer_states (the optimizer
-- class's per-element states; the default optimizer's: AdamW's m, v),
-- optimizer_formats (state name -> optim/formats.lua's format; f32),
-- master_format (f32, or bf16: no fp32 master, the bf16 working parameters
-- are the master, updated through stochastic rounding), moe (a model
-- with MoE blocks: { gather = "block" | "expert", routed_only =, blocks =,
-- experts = }; nil without), ep_size (moe.ep_size; 1), expert_placement
-- (moe.placement: "world" keeps the experts under ZeRO over all ranks;
-- else in their group where the clauses below allow).
function M.new(opts)
  local stage = opts.stage or 0
  if type(stage) ~= "number" or stage < 0 or stage > 3 or stage ~= math.floor(stage) then
    error(("plan: stage must be 0..3 (got %s)"):format(tostring(stage)), 0)
  end
  local wdt = dtypes[opts.dtype or "fp32"]
  local gdt = dtypes[opts.grad_dtype or "fp32"]
  if not wdt or not gdt then
    error(("plan: dtype must be fp32, bf16 or fp16 (got %s)")
          :format(tostring(wdt and opts.grad_dtype or opts.dtype)), 0)
  end
  local device = opts.device or "cpu"
  local opt_tier = tier_of("offload_optimizer", opts.offload_optimizer)
  local par_tier = tier_of("offload_param", opts.offload_param)
  for _, kt in ipairs({ { "offload_optimizer", opt_tier }, { "offload_param", par_tier } }) do
    local key, tier = kt[1], kt[2]
    if not store.get(tier).on_device and not M.stage_allows(key, stage) then
      error(("plan: %s needs %s"):format(key, M.offload_stages[key].names), 0)
    end
  end
  if not M.placement_allowed(device, opts.offload_optimizer, opts.offload_param) then
    error(("plan: offload_param (device: %s) on a %s device needs the optimizer off the device " ..
           "too: it updates the working shard where that lives; add offload_optimizer " ..
           "(device: cpu or nvme)"):format(opts.offload_param, device), 0)
  end
  -- Where the optimizer computes: on the device, or on the host (its states
  -- in host memory or staged there from NVMe). It updates in place what is
  -- in that memory; on a cpu device, host and device are one memory.
  local opt_kind = store.get(opt_tier)
  local opt_at = opt_kind.on_device and "device" or "host"
  local function reachable(tier)
    local kind = store.get(tier)
    return kind.resident and (kind.on_device == opt_kind.on_device or device == "cpu")
  end

  local p = setmetatable({ stage = stage, device = device, dtype = wdt, grad_dtype = gdt,
                           accum = opts.accum or 1 }, Plan)
  -- Working parameters: whole below stage 3; at stage 3 a shard (where
  -- offload_param puts it), gathered module by module before use, and the
  -- small modules kept whole on the device.
  if stage < 3 then
    p.params = { extent = "full", dtype = wdt, tier = "device" }
  else
    p.params = { extent = "shard", dtype = wdt, tier = par_tier, gather = "per_module",
                 persistent = { extent = "persistent", dtype = wdt, tier = "device" } }
  end
  -- Frozen parameters (no gradients, no optimizer states): whole on the
  -- device below stage 3; at stage 3 partitioned and placed like the
  -- working shard (zero/frozen.lua), small modules kept whole.
  if stage < 3 then
    p.frozen = { extent = "full", dtype = wdt, tier = "device" }
  else
    p.frozen = { extent = "shard", dtype = wdt, tier = par_tier, gather = "per_module",
                 persistent = { extent = "persistent", dtype = wdt, tier = "device" } }
  end
  -- Gradients: whole below stage 2, this rank's shard from stage 2.
  p.grads = { extent = stage < 2 and "full" or "shard", dtype = gdt, tier = "device" }
  -- Optimizer states: replicated at stage 0, sharded from stage 1.
  local opt_extent = stage == 0 and "full" or "shard"
  -- The optimizer's own per-element states (its class's `states`: AdamW m,
  -- v; Lion m), each in its format (f32 unless declared), beside the master.
  local names = opts.optimizer_states or optimizers.default.states
  local fmts = {}
  for _, name in ipairs(names) do
    fmts[name] = formats.get((opts.optimizer_formats or {})[name] or formats.default).name
  end
  p.optimizer = { extent = opt_extent, dtype = "f32", tier = opt_tier,
                  ranks = stage == 0 and "all" or "own", states = names, formats = fmts }
  -- fp32 master: the working parameters themselves when they are fp32 and
  -- in memory the optimizer can update; else its own copy beside m and v.
  if formats.master(opts.master_format).name == "bf16" then
    if wdt ~= "bf16" then
      error("plan: bf16 master weights (optimizer.params.bf16_stochastic_round) are the bf16 " ..
            "working parameters themselves: they need a bf16 run (bf16.enabled, and no --dtype " ..
            "but bf16)", 0)
    end
    -- The working parameters themselves where the optimizer updates them
    -- in place; else a bf16 copy beside its states (host memory beside an
    -- accelerator, the state file on NVMe) whose values the working copy
    -- takes after each update: the same numbers either way.
    if reachable(p.params.tier) then
      p.master = { extent = p.params.extent, dtype = "bf16", tier = p.params.tier, alias = "params" }
    else
      p.master = { extent = opt_extent, dtype = "bf16", tier = opt_tier }
    end
  elseif wdt == "f32" and reachable(p.params.tier) then
    p.master = { extent = p.params.extent, dtype = "f32", tier = p.params.tier, alias = "params" }
  else
    p.master = { extent = opt_extent, dtype = "f32", tier = opt_tier }
  end
  -- The gradients the optimizer reads: the reduced ones where they are, or
  -- an fp32 copy of this rank's shard in the optimizer's memory.
  if reachable(p.grads.tier) then
    p.opt_grads = { alias = "grads", extent = p.grads.extent, dtype = gdt, tier = p.grads.tier }
  else
    p.opt_grads = { extent = "shard", dtype = "f32", tier = opt_at }
    -- Stages 2-3 reduce straight into it: no gradient shard on the device.
    if stage >= 2 then p.grads = { extent = "none", dtype = gdt, tier = "device" } end
  end
  -- Optimizer states on NVMe (a kind that is not resident) from stage 2:
  -- the reduced gradients go to a swap file sub-group by sub-group
  -- (zero/spill.lua) and the optimizer reads them back with its states; no
  -- gradient shard stays in memory.
  if not opt_kind.resident and stage >= 2 then
    p.opt_grads = { extent = "shard", dtype = "f32", tier = opt_tier }
    p.grads = { extent = "none", dtype = gdt, tier = "device" }
  end
  -- How gradients are reduced. Buffered: each module's gradients go to a
  -- pooled staging buffer reduced as soon as they are complete and added
  -- into the gradients every micro-step (stages 2-3 always; stages 0-1 with
  -- accumulation or half gradients, so every stage adds the same reduced
  -- micro-step gradients in the same order). Otherwise once per step, at
  -- the accumulation boundary, over the full gradient buffer.
  local buffered = stage >= 2 or p.accum > 1 or gdt ~= "f32"
  p.reduce = { op = stage == 0 and "all_reduce" or "reduce_scatter", buffered = buffered,
               into = stage >= 2 and "shard" or "full",
               bucketed = stage == 0 and not buffered }
  -- The buffer reductions add into: the gradients, or (none on the device)
  -- the optimizer's; on an accelerator with that in host memory, each
  -- reduced slice is copied off the device first.
  p.reduce.dst = p.grads.extent == "none" and "opt_grads" or "grads"
  p.reduce.to_host = device ~= "cpu" and not store.get(p[p.reduce.dst].tier).on_device
  -- A sharded working copy outside device memory on an accelerator: each
  -- slice a gather reads is copied to the device first.
  p.params.upload = p.params.extent == "shard" and not store.get(p.params.tier).on_device and
                    device ~= "cpu"
  -- A host optimizer beside device-resident working parameters: the
  -- updated working shard goes from host staging to the device after each
  -- optimizer sub-group (overlapping the next group's update).
  p.push_params = device ~= "cpu" and not opt_kind.on_device and store.get(p.params.tier).on_device
  -- What the step's end gathers: the updated slices into every rank's full
  -- working copy (stages 1-2), the persistent parameters (stage 3).
  p.after_step = (stage == 1 or stage == 2) and "gather_full"
                 or stage == 3 and "gather_persistent" or "none"
  p.moe = M.moe(opts.moe)
  -- Where expert parallelism's experts live (ep_size > 1). "edp": a rank
  -- keeps only the experts it computes, under ZeRO within its
  -- expert-data-parallel group (zero/layout.lua's place, zero/experts.lua),
  -- unless the config asks for the world's (moe.placement "world"):
  -- under ZeRO over all ranks like every other parameter.
  p.ep_size = opts.ep_size or 1
  -- (At every stage: at stage 0 each expert's states are replicated over
  -- its group alone, an all-reduce within it, and a checkpoint has one
  -- writer per rank, each writing its slices, zero/experts.lua's
  -- save_view. On every device: the group's division runs inside its
  -- collective; on cuda nccl's pre-multiplied sum, on the device,
  -- untested there. With gradients in any dtype: the group's sum is
  -- divided by the world size before its one rounding, zero/reduce.lua,
  -- as the world's average divides. Wherever the optimizer's states, the
  -- master and the parameter shard live (in memory, on the cpu, on NVMe:
  -- start-up, the checksum and checkpoints read and write the rank's own
  -- slices of each tier, zero/states.lua), whatever the optimizer
  -- (zero/matrices.lua owns an expert's whole matrices within its group).)
  p.experts = p.ep_size > 1 and opts.expert_placement ~= "world" and "edp" or "world"
  return p
end

-- The experts' gather units (nn/moe_experts.lua): "block", a block's
-- experts gathered and reduced as one; "expert", one by one, every one
-- each pass. routed_only: the ranks agree by one all-reduce of a bitmask
-- per block and micro-batch on the experts any rank routed to, and only
-- those are gathered and reduced (zero/gather.lua); it needs "expert".
function M.moe(m)
  if not m then return nil end
  local gather = m.gather or "block"
  if gather ~= "block" and gather ~= "expert" then
    error(("plan: moe.gather must be \"block\" or \"expert\" (got %s)"):format(tostring(gather)), 0)
  end
  if m.routed_only and gather ~= "expert" then
    error("plan: moe.routed_only needs the experts gathered one by one; add \"gather\": " ..
          "\"expert\" to the config's moe block", 0)
  end
  return { gather = gather, routed_only = m.routed_only == true, blocks = m.blocks,
           experts = m.experts }
end

-- Bytes per rank of each state by tier and ledger category. counts: full,
-- shard (padded elements of the full layout and of one rank's shard),
-- persistent (elements kept whole at stage 3); frozen (optional: the
-- frozen parameters' {full, shard, persistent} element counts, their own
-- layout's). Returns { device = {params,
-- grads, optimizer}, host = {...}, nvme = {...}, states = {name = bytes} };
-- each tier also has total.
function Plan:bytes(counts)
  local n = { full = counts.full, shard = counts.shard, persistent = counts.persistent or 0,
              none = 0 }
  local out = { states = {} }
  for _, t in ipairs({ "device", "host", "nvme" }) do
    out[t] = { params = 0, grads = 0, optimizer = 0, total = 0 }
  end
  local function add(name, s, format)
    if not s or s.alias then return end
    local b = format and formats.bytes(format, n[s.extent]) or n[s.extent] * esize[s.dtype]
    local cat = categories[name]
    local mem = out[store.get(s.tier).memory]
    mem[cat] = mem[cat] + b
    mem.total = mem.total + b
    out.states[name] = (out.states[name] or 0) + b
  end
  for _, name in ipairs(M.states) do add(name, self[name]) end
  for _, st in ipairs(self.optimizer.states) do
    add("optimizer", self.optimizer, self.optimizer.formats[st])
  end
  if self.params.persistent then add("params", self.params.persistent) end
  local fc = counts.frozen
  if fc then
    local saved = n
    n = { full = fc.full, shard = fc.shard, persistent = fc.persistent or 0 }
    add("frozen", self.frozen)
    if self.frozen.persistent then add("frozen", self.frozen.persistent) end
    n = saved
  end
  return out
end

-- One line per state: "params  full  bf16  device".
function Plan:lines()
  local lines = { ("ZeRO stage %d on %s: working %s, gradients %s"):format(self.stage, self.device,
                  self.dtype, self.grad_dtype) }
  local function row(name, s, note)
    if not s then return end
    local where = s.alias and ("= " .. s.alias) or s.tier
    lines[#lines + 1] = ("  %-10s %-11s %-5s %s%s"):format(name, s.extent, s.dtype, where, note or "")
  end
  row("params", self.params, self.params.gather and ", gathered per module" or "")
  if self.params.persistent then row("persistent", self.params.persistent, " (small modules)") end
  row("grads", self.grads)
  if not self.opt_grads.alias then row("opt_grads", self.opt_grads, " (what the optimizer reads)") end
  row("master", self.master)
  for _, name in ipairs(self.optimizer.states) do
    local f = self.optimizer.formats[name]
    row(name, f == "f32" and self.optimizer
              or setmetatable({ dtype = f }, { __index = self.optimizer }))
  end
  local r = self.reduce
  lines[#lines + 1] = ("  reduce     %s%s into the %s gradients, %s"):format(
    r.bucketed and "bucketed " or "", r.op:gsub("_", "-"), r.into,
    r.buffered and "every micro-step through staging buffers" or "at the accumulation boundary")
  if self.push_params then
    lines[#lines + 1] = "  push       the updated working shard from the host to the device"
  end
  lines[#lines + 1] = "  after step " .. self.after_step:gsub("_", " ")
  if self.moe then lines[#lines + 1] = "  moe        " .. M.describe_moe(self.moe) end
  if self.ep_size > 1 then
    lines[#lines + 1] = ("  experts    ep_size %d, parameters under ZeRO over %s"):format(
      self.ep_size, self.experts == "edp" and "the expert-data-parallel group" or "all ranks")
  end
  return lines
end

-- The moe field for a model's MoE blocks (routers; nil or none: nil): the
-- granularity its experts were built with, which the config's moe.gather,
-- where given, must match (the units are modules, made with the model),
-- and the config's routed_only.
function M.moe_of(routers, gather, routed_only)
  if not routers or #routers == 0 then return nil end
  local built = routers[1].gather
  if gather and gather ~= built then
    error(("plan: the config's moe.gather is %q but the model's experts were built " ..
           "gathered %q; build it with models.config(name, { moe_gather = %q }) " ..
           "(scripts/train.lua does)"):format(gather, built, gather), 0)
  end
  return { gather = built, routed_only = routed_only, blocks = #routers,
           experts = routers[1].n_experts }
end

-- "whole block (2 blocks of 8 experts)", "per expert, routed only (...)".
function M.describe_moe(m)
  return ("%s%s (%d blocks of %d experts)"):format(
    m.gather == "expert" and "per expert" or "whole block",
    m.routed_only and ", routed only" or "", m.blocks or 0, m.experts or 0)
end

function Plan:__tostring() return table.concat(self:lines(), "\n") end

-- Whether a state (params, grads, opt_grads, master, optimizer) lives in
-- device memory apart from the host's (an accelerator's device tier): the
-- host reads it through a copy.
function Plan:on_device(name)
  return store.get(self[name].tier).on_device and self.device ~= "cpu"
end

-- The store kind (zero/store/) a state (params, grads, opt_grads, master,
-- optimizer, frozen) lives in.
function Plan:store(name) return store.get(self[name].tier) end

-- Whether a state lives in a kind the engine stages through (a swap file)
-- rather than memory it addresses.
function Plan:swapped(name) return not store.get(self[name].tier).resident end

-- Offset of a run (layout.shard_runs: full_offset, shard_offset) in a
-- buffer of this extent.
function M.offset(extent, run)
  return extent == "full" and run.full_offset or run.shard_offset
end

M.Plan = Plan
return M
