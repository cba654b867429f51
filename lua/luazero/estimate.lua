-- estimate.lua — model-state memory per rank for each ZeRO stage, with and
-- without optimizer offload: the bytes luazero's engine allocates (its
-- gradients are fp32 whatever the working dtype), or, with grads =
-- "working", the ZeRO paper's accounting (Rajbhandari et al. 2020: 16Ψ,
-- 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N); and the stage "auto" picks from a memory
-- budget. Formulas: docs/zero.md, "Estimating memory". tools/estimate prints
-- these as a table. estimate/rank.lua adds the rest of a rank's story
-- (staging, swap files, NVMe traffic, every placement), re-exported here.
--
--   local estimate = require("luazero.estimate")
--   local r = estimate.model_states(1.5e9, 8, 3, { dtype = "bf16" })  -- r.device, r.cpu
--   local stage, why = estimate.pick_stage(124e6, 2, 1.5 * 2^30, "bf16")
local M = {}

local Placement = require("luazero.zero.plan")
local store = require("luazero.zero.store")
local formats = require("luazero.optim.formats")

local esize = Placement.esize

-- Bytes per parameter of the working copy (params and grads) and of the
-- fp32 master copy (none in fp32 training: the params are the master).
local dtype_bytes = {}
for _, name in ipairs({ "fp32", "bf16", "fp16" }) do
  local working = esize[Placement.dtypes[name]]
  dtype_bytes[name] = { working = working, master = name == "fp32" and 0 or esize.f32 }
end
M.dtype_bytes = dtype_bytes

-- Every placement the engine has: where offload_optimizer (opt) and
-- offload_param (param) put their states, one pair of the store table's
-- config names (zero/store/), named from them: "cpu", "nvme" (the
-- optimizer's states off the device), "cpu+param", "nvme+param" (the
-- parameter shard with them), "cpu+nvme-param", "nvme+cpu-param" (the two
-- apart), "cpu-param", "nvme-param" (the parameter shard alone off the
-- device); "none" keeps everything on the device.
local function placements()
  local none, off = nil, {}
  for _, kind in ipairs(store.kinds()) do
    if kind.on_device then none = none or kind.config else off[#off + 1] = kind.config end
  end
  local list = { { name = none, opt = none, param = none } }
  local function add(name, opt, param) list[#list + 1] = { name = name, opt = opt, param = param } end
  for _, c in ipairs(off) do
    add(c, c, none)
    add(c .. "+param", c, c)
  end
  for _, a in ipairs(off) do
    for _, b in ipairs(off) do
      if a ~= b then add(a .. "+" .. b .. "-param", a, b) end
    end
  end
  for _, c in ipairs(off) do add(c .. "-param", none, c) end
  return list
end
M.placements = placements()

-- The model-state table's rows (the ZeRO paper's placements): the states
-- in memory the engine addresses, the parameter shard only beside the
-- optimizer's states: "none", "cpu", "cpu+param".
M.offloads = {}
for _, pl in ipairs(M.placements) do
  local opt, param = store.of_config(pl.opt), store.of_config(pl.param)
  if opt.resident and param.resident and (param.on_device or pl.param == pl.opt) then
    M.offloads[#M.offloads + 1] = pl.name
  end
end

local placement_of = {}
for _, pl in ipairs(M.placements) do placement_of[pl.name] = pl end
M.placement_of = placement_of

-- The placement's name for offload_optimizer and offload_param devices
-- (nil where none is named: nvme optimizer beside cpu parameters).
function M.placement_name(opt, param)
  for _, pl in ipairs(M.placements) do
    if pl.opt == opt and pl.param == param then return pl.name end
  end
end

local function check_count(what, v, min)
  if type(v) ~= "number" or v ~= v or v < min or v ~= math.floor(v) or v == math.huge then
    error(("estimate: %s must be a whole number >= %d (got %s)"):format(what, min, tostring(v)), 0)
  end
end

function M.check_dtype(dtype)
  local b = dtype_bytes[dtype or "bf16"]
  if not b then
    error(("estimate: dtype must be fp32, bf16 or fp16 (got %s)"):format(tostring(dtype)), 0)
  end
  return b
end

-- Bytes per gradient element: luazero's kernels accumulate in fp32; the
-- ZeRO paper and DeepSpeed keep gradients in the working dtype.
local function grad_bytes(grads, b)
  if grads == nil or grads == "fp32" then return esize.f32 end
  if grads == "working" then return b.working end
  error(("estimate: grads must be fp32 or working (got %s)"):format(tostring(grads)), 0)
end

-- The engine's placement plan (zero/plan.lua) for a row: offload "none",
-- "cpu" (offload_optimizer) or "cpu+param" (and offload_param); device
-- "cuda" (an accelerator: host and device memory apart; the default) or
-- "cpu" (one memory: what a CPU run's ledger shows).
function M.plan(stage, dtype, offload, grads, device, extra)
  local pl = placement_of[offload or "none"]
  if not pl then
    error(("estimate: offload must be %s (got %s)"):format(M.placement_list(), tostring(offload)), 0)
  end
  extra = extra or {}
  return Placement.new{
    stage = stage, dtype = dtype, grad_dtype = grads == "working" and dtype or "fp32",
    offload_optimizer = pl.opt, offload_param = pl.param, device = device or "cuda",
    accum = extra.accum, optimizer_states = extra.states, optimizer_formats = extra.formats,
    master_format = extra.master_format,
  }
end

function M.placement_list()
  local names = {}
  for _, pl in ipairs(M.placements) do names[#names + 1] = pl.name end
  return table.concat(names, ", ")
end

-- Per-rank model-state bytes for `params` parameters at world size `world`
-- and ZeRO `stage` (0..3), from the engine's placement plan. opts: dtype
-- ("bf16"), grads ("fp32": luazero; "working": the ZeRO paper's 2-byte
-- gradients in bf16/fp16), offload ("none", "cpu": offload_optimizer on the
-- CPU, "cpu+param": also offload_param, stage 3 only), device ("cuda":
-- device and host memory apart; "cpu": a CPU run, whose host-tier states
-- the ledger counts under offload), persistent (stage 3: elements kept
-- whole on every rank beside the shards, those in modules of at most
-- stage3_param_persistence_threshold elements; 0), layout ({full, shard}:
-- the engine's padded element counts, from model_params; default full =
-- params, shard = ceil(params / world)), states and formats (the
-- optimizer's states and their formats, optim/formats.lua; AdamW's f32 m, v),
-- master_format (f32, or bf16: bf16_stochastic_round's master).
-- Returns nil for combinations DeepSpeed does not have (offload at stage 0,
-- offload_param below stage 3); else a table: device and cpu bytes, and
-- each split by ledger category (device_parts, cpu_parts: params, grads,
-- optimizer), and the plan.
function M.model_states(params, world, stage, opts)
  opts = opts or {}
  check_count("the parameter count", params, 1)
  check_count("the world size", world, 1)
  check_count("the stage", stage, 0)
  if stage > 3 then error("estimate: stage must be 0..3 (got " .. stage .. ")", 0) end
  local b = M.check_dtype(opts.dtype)
  grad_bytes(opts.grads, b)
  local offload = opts.offload or "none"
  local persistent = opts.persistent or 0
  check_count("the persistent parameter count", persistent, 0)
  local pl = placement_of[offload]
  if not pl then
    error(("estimate: offload must be %s (got %s)"):format(M.placement_list(), tostring(offload)), 0)
  end
  if (Placement.offloaded(pl.opt) and not Placement.stage_allows("offload_optimizer", stage)) or
     (Placement.offloaded(pl.param) and not Placement.stage_allows("offload_param", stage)) then
    return nil
  end
  local full, shard = params, math.ceil(params / world)
  if opts.layout then full, shard = opts.layout.full, opts.layout.shard end
  local plan = M.plan(stage, opts.dtype or "bf16", offload, opts.grads, opts.device,
                      { states = opts.states, formats = opts.formats,
                        master_format = opts.master_format })
  local by = plan:bytes{ full = full, shard = shard, persistent = persistent }
  local dev, cpu = by.device, by.host
  local r = { stage = stage, offload = offload, dtype = opts.dtype or "bf16", params = params,
              world = world, shard = shard, persistent = persistent, plan = plan,
              device_parts = { params = dev.params, grads = dev.grads, optimizer = dev.optimizer },
              cpu_parts = { params = cpu.params, grads = cpu.grads, optimizer = cpu.optimizer },
              nvme_parts = { params = by.nvme.params, grads = by.nvme.grads,
                             optimizer = by.nvme.optimizer },
              device = dev.total, cpu = cpu.total, nvme = by.nvme.total }
  return r
end

-- The formula of a row, in bytes per parameter: Ψ parameters, N ranks, P
-- persistent parameters; "device | cpu" with offload. The plan's bytes at
-- a count of whole scale blocks give each term's coefficient (an 8-bit
-- state's 1 + 4/256). extra: states, formats, master_format (M.plan's).
function M.formula(stage, dtype, offload, grads, device, extra)
  M.check_dtype(dtype)
  offload = offload or "none"
  local plan = M.plan(stage, dtype, offload, grads, device, extra)
  local K = 2 ^ 20
  local function coeffs(counts)
    local by = plan:bytes(counts)
    return by.device.total / K, by.host.total / K
  end
  local fd, fh = coeffs{ full = K, shard = 0, persistent = 0 }
  local sd, sh = coeffs{ full = 0, shard = K, persistent = 0 }
  local pd, ph = coeffs{ full = 0, shard = 0, persistent = K }
  local function join(f, sh_, p)
    local out = {}
    if f > 0 then out[#out + 1] = f .. "Ψ" end
    if sh_ > 0 then out[#out + 1] = sh_ .. "Ψ/N" end
    if p > 0 then out[#out + 1] = p .. "P" end
    return #out > 0 and table.concat(out, " + ") or "0"
  end
  local dev = join(fd, sd, pd)
  if offload == "none" then return dev end
  return dev .. " | " .. join(fh, sh, ph)
end

-- Every row of the table: stages 0..3 without offload, 1..3 with the
-- optimizer on the CPU, 3 with parameters on the CPU too.
-- opts: grads, persistent, layout, device, states, formats, master_format
-- (as in model_states).
function M.table_rows(params, world, dtype, opts)
  opts = opts or {}
  local rows = {}
  local extra = { states = opts.states, formats = opts.formats, master_format = opts.master_format }
  for _, offload in ipairs(M.offloads) do
    for stage = 0, 3 do
      local r = M.model_states(params, world, stage,
                               { dtype = dtype, offload = offload, grads = opts.grads,
                                 persistent = opts.persistent, layout = opts.layout,
                                 device = opts.device, states = opts.states,
                                 formats = opts.formats, master_format = opts.master_format })
      if r then
        r.formula = M.formula(stage, dtype, offload, opts.grads, opts.device, extra)
        rows[#rows + 1] = r
      end
    end
  end
  return rows
end

------------------------------------------------------------------ formatting

-- What an optimizer keeps, in words, and its bytes a parameter (its states
-- in their formats and the master): "AdamW: m, v in f32, fp32 master
-- weights (12 bytes a parameter)". opts: name (the optimizer), states,
-- formats (name -> format), master_format, dtype (the working one: in fp32
-- training the parameters are the master).
function M.describe_optimizer(opts)
  local by_format, order = {}, {}
  local per = 0
  for _, st in ipairs(opts.states) do
    local f = opts.formats[st] or formats.default
    if not by_format[f] then by_format[f] = {}; order[#order + 1] = f end
    table.insert(by_format[f], st)
    per = per + formats.per_element(f)
  end
  local parts = {}
  for _, f in ipairs(order) do parts[#parts + 1] = table.concat(by_format[f], ", ") .. " in " .. f end
  local master
  if opts.master_format == "bf16" then
    master = "bf16 master weights (stochastic rounding)"
    per = per + esize.bf16
  elseif (opts.dtype or "bf16") == "fp32" then
    master = "no master copy (the fp32 parameters are the master)"
  else
    master = "fp32 master weights"
    per = per + esize.f32
  end
  return ("%s: %s, %s (%g bytes a parameter)"):format(opts.name, table.concat(parts, "; "),
                                                     master, per)
end

function M.format_bytes(n)
  if n >= 2 ^ 30 then return ("%.1f GiB"):format(n / 2 ^ 30) end
  if n >= 2 ^ 20 then return ("%.1f MiB"):format(n / 2 ^ 20) end
  if n >= 2 ^ 10 then return ("%.1f KiB"):format(n / 2 ^ 10) end
  return ("%d B"):format(n)
end

-- 1234567 -> "1,234,567"
function M.thousands(n)
  local s = ("%d"):format(n)
  local sign, digits = s:match("^(-?)(%d+)$")
  digits = digits:reverse():gsub("(%d%d%d)", "%1,"):reverse():gsub("^,", "")
  return sign .. digits
end

------------------------------------------------------------------ stage "auto"

-- The lowest stage whose per-rank model states (no offload) fit in
-- budget_bytes; with the reason, as one line, and whether it fits. When no
-- stage fits, stage 3 (the least memory) and fits = false.
-- opts: grads, persistent, layout (as in model_states); with counts, all:
-- count the comm buffers and the optimizer's scratch too (need_at's);
-- budget_note: words after the budget's bytes (what came off it).
-- Returns stage, why, fits, placement (an NVMe pick's), and detail:
-- { reason = why without its "picked ..." end, nvme_short = true when NVMe
-- was offered and its least placement needs more than the budget }.
function M.pick_stage(params, world, budget_bytes, dtype, opts)
  if type(budget_bytes) ~= "number" or not (budget_bytes > 0) then
    error(("estimate: the memory budget must be a positive number of bytes (got %s)")
          :format(tostring(budget_bytes)), 0)
  end
  opts = opts or {}
  local too_big, least = {}, nil
  -- (opts.min_stage: the least stage the config allows, its offloads'; the
  -- stages below are not offered, and opts.min_why says why)
  local from = opts.min_stage or 0
  local budget = M.format_bytes(budget_bytes) .. (opts.budget_note or "")
  local first = from > 0 and ("%s, so stage %d at least; "):format(opts.min_why, from) or ""
  -- A stage's need: with the engine's counts (opts.counts: a LoRA run's
  -- frozen base, experts over ep_size) and settings (the optimizer's states
  -- and formats, the master), what M.rank keeps on the device and the host
  -- with nothing offloaded, as pick_nvme measures its placements; else
  -- AdamW's fp32 states over `params`.
  local function stage_need(stage)
    local bytes = opts.counts and M.need_at(opts.counts, opts.settings, stage, "none", dtype,
                                            opts.grads, opts.device or "cuda", opts.all)
    if bytes then return { device = bytes } end
    return M.model_states(params, world, stage, { dtype = dtype, grads = opts.grads,
                          persistent = opts.persistent, layout = opts.layout })
  end
  for stage = from, 3 do
    local r = stage_need(stage)
    if not least or r.device < least.device then least = { stage = stage, device = r.device } end
    if r.device <= budget_bytes then
      local reason
      if #too_big == 0 then
        reason = ("%sstage %d needs %s per rank; budget %s")
                 :format(first, stage, M.format_bytes(r.device), budget)
      else
        reason = ("%s%s per rank; budget %s; stage %d needs %s")
                 :format(first, table.concat(too_big, ", "), budget, stage,
                         M.format_bytes(r.device))
      end
      return stage, ("%s: picked stage %d"):format(reason, stage), true, nil,
             { reason = reason, nvme_short = false }
    end
    too_big[#too_big + 1] = ("stage %d needs %s"):format(stage, M.format_bytes(r.device))
  end
  local head = ("%s%s per rank; budget %s"):format(first, table.concat(too_big, ", "), budget)
  local nvme_note, nvme_short = "", false
  if opts.nvme then
    local pick, why, need = M.pick_nvme(params, world, budget_bytes, dtype, opts)
    if pick then
      if not opts.nvme_path then
        error(("stage auto: %s: no stage fits in memory; stage 3 with %s needs %s and fits: " ..
               "give --nvme-path DIR (a directory on a fast disk for the swap files) or set " ..
               "zero_optimization.offload_optimizer.nvme_path"):format(head, why,
               M.format_bytes(need)), 0)
      end
      local reason = ("%s: no stage fits in memory; stage 3 with %s needs %s")
                     :format(head, why, M.format_bytes(need))
      return 3, ("%s: picked stage 3, %s (nvme_path %s)"):format(reason, why, opts.nvme_path),
             true, pick, { reason = reason, nvme_short = false }
    end
    nvme_short = need ~= nil
    nvme_note = need and ("; NVMe does not fit either (stage 3 with %s needs %s)"):format(why,
                                                                               M.format_bytes(need))
                or ("; NVMe is not offered (%s)"):format(why)
  end
  local reason = ("%s: no stage fits (stage %d needs the least, %s)%s")
                 :format(head, least.stage, M.format_bytes(least.device), nvme_note)
  return 3, reason .. "; picked stage 3, which more ranks shrink: offload, more ranks or a " ..
            "larger budget would help", false, nil, { reason = reason, nvme_short = nvme_short }
end

------------------------------------------------------------------ models

-- Parameter counts of a model from its parameter table (a model declared,
-- e.g. by gpt2.new, nothing allocated): params (the
-- table's elements, the vocabulary padding rows included), real (without
-- them), largest_layer (the most one module owns, DeepSpeed's
-- largest_layer_params), and for world size `world` the engine's layout
-- (zero/layout.lua): layout = {full, shard} padded element counts, and
-- persistent = padded elements of the modules of at most `threshold`
-- elements (stage3_param_persistence_threshold, 1e5), kept whole at stage 3.
function M.param_table_counts(param_table, world, threshold)
  threshold = threshold or 100000
  world = world or 1
  local per_module, order, numel = {}, {}, 0
  for _, e in ipairs(param_table) do
    if not per_module[e.module] then order[#order + 1] = e.module end
    per_module[e.module] = (per_module[e.module] or 0) + e.numel
    numel = numel + e.numel
  end
  local largest = 0
  for _, n in pairs(per_module) do largest = math.max(largest, n) end
  local r = { params = numel, largest_layer = largest, threshold = threshold, world = world }
  local ok, layout = pcall(require, "luazero.zero.layout")
  if ok then
    local L = layout.new(param_table, world)
    r.layout = { full = L.full_numel, shard = L.shard_numel }
    r.persistent = 0
    for _, seg in ipairs(L.segments) do
      if seg.numel <= threshold then r.persistent = r.persistent + seg.padded end
    end
  else
    r.persistent = 0
    for _, m in ipairs(order) do
      if per_module[m] <= threshold then r.persistent = r.persistent + per_module[m] end
    end
  end
  return r
end

function M.model_params(model, threshold, world)
  local r = M.param_table_counts(model.param_table, world, threshold)
  r.name, r.real, r.config = model.cfg.name, model:count_params(), model.cfg
  return r
end

------------------------------------------------------------------ activations

-- Activation memory per rank for micro-batches of B x T in `dtype` (fp32,
-- bf16, fp16), as the model (an nn.Model, declared) sizes its arenas from
-- its modules' memory reports, with the activation checkpointing it is set
-- to: device (the activations category), offload (kept inputs under
-- cpu_checkpointing), plan (nn.Model:arena_plan, arena by arena).
-- ep_size (moe.ep_size): an MoE model's arenas on a rank of an
-- expert-parallel group of that many ranks, whose experts may receive
-- every rank's rows (nn/moe_experts.lua); default the model's own group.
function M.activations(model, B, T, dtype, ep_size)
  local ctx = model.ctx or {}
  local was = ctx.ep_size
  if ep_size and model.ctx then ctx.ep_size = ep_size end
  local ok, plan = pcall(model.arena_plan, model, B, T, Placement.dtypes[dtype or "fp32"] or dtype)
  ctx.ep_size = was
  if not ok then error(plan, 0) end
  return { device = plan.activations, offload = plan.offload, plan = plan }
end

------------------------------------------------------------------ DeepSpeed's own

-- DeepSpeed's estimate_zero2_model_states_mem_needs (stage_1_and_2.py) and
-- estimate_zero3_model_states_mem_needs (stage3.py), for comparison: they
-- count an fp32 gradient copy and buffers, and CPU memory per node with a
-- 1.5 buffer factor. Return cpu bytes (per node), gpu bytes (per GPU).
function M.deepspeed_zero2(total, gpus_per_node, nodes, cpu_offload, factor)
  factor = factor or 1.5
  local gpus = gpus_per_node * nodes
  local gpu, cpu
  if cpu_offload then
    gpu = 2 * total
    cpu = total * math.max(4 * gpus, 16) * factor
  else
    gpu = 4 * total + math.floor(16 * total / gpus)
    cpu = total * 4 * gpus_per_node * factor
  end
  return math.floor(cpu), math.floor(gpu)
end

function M.deepspeed_zero3(total, largest_layer, gpus_per_node, nodes, cpu_offload,
                           cpu_offload_params, zero_init, factor)
  factor = factor or 1.5
  if zero_init == nil then zero_init = true end
  local gpus, per_node = gpus_per_node * nodes, 1 / nodes
  local largest_mem = 4 * largest_layer
  local gpu, cpu
  if cpu_offload then
    if cpu_offload_params then
      gpu = largest_mem
      cpu = zero_init and total * 18 * per_node * factor
            or total * math.max(4 * gpus_per_node, 18 * per_node) * factor
    else
      gpu = largest_mem + math.floor(2 * total / gpus)
      cpu = zero_init and total * 16 * per_node * factor
            or total * math.max(4 * gpus_per_node, 16 * per_node) * factor
    end
  else
    gpu = largest_mem + math.floor(18 * total / gpus)
    cpu = zero_init and largest_layer * 4 * gpus_per_node * factor
          or total * 4 * gpus_per_node * factor
  end
  return math.floor(cpu), math.floor(gpu)
end

-- The per-rank half (estimate/rank.lua): rank, counts, rank_table, pick_nvme,
-- ...; and the disk's speed (estimate/disk.lua): disk, measure_disk.
local rank_half = require("luazero.estimate.rank")
rank_half.bind(M)
for _, part in ipairs({ rank_half, require("luazero.estimate.disk") }) do
  for k, v in pairs(part) do
    if k ~= "bind" then
      assert(M[k] == nil, "estimate: two parts define " .. k)
      M[k] = v
    end
  end
end

return M
