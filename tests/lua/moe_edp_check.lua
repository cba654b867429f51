-- moe_edp_check.lua — run by test_moe_ep.lua under the launcher: a tiny
-- Mixtral trained under expert parallelism at one ZeRO stage, with
-- gradient clipping that takes effect (so the gradient norm's bits reach
-- the weights). Prints, on rank 0, "master_params <xxh64 of
-- engine:master_params()> <its elements>", "describe <engine:describe()>"
-- and "sum <params checksum> <where the experts' parameters live:
-- world|edp> <each step's gradient norm, %a> params <the ledger's
-- parameter bytes> grads <its gradient bytes, after initialisation>
-- gathered <bytes its parameter gathers sent>". With SAVE a folder, it
-- saves after step 2; with LOAD one, it loads it and trains steps 3-4
-- only. ACCUM: gradient accumulation steps (1); DTYPE: fp32 (default),
-- bf16 or fp16, with "-grads" (bf16-grads, fp16-grads) the gradients in it
-- too (data_types.grad_accum_dtype); GATHER: the experts' gather, expert (default) or block;
-- OPTIMIZER: AdamW (default), AdamW8bit (block-scaled states) or Muon;
-- DEVICE: cpu (default) or sim; OFFLOAD: none (default), cpu
-- (offload_optimizer at stages 1-3, offload_param too at stage 3),
-- nvme:DIR (offload_optimizer on NVMe in DIR at stages 1-3),
-- nvme+param:DIR (offload_param on NVMe too at stage 3) or
-- cpu+param-nvme:DIR (offload_optimizer on the cpu, offload_param on NVMe
-- in DIR at stage 3); PLACEMENT: moe.placement, group (default) or world.
--   luazero -n N tests/lua/moe_edp_check.lua CORPUS EP STAGE SAVE|- LOAD|- [ACCUM] [DTYPE] [GATHER]
--       [OPTIMIZER] [DEVICE] [OFFLOAD] [PLACEMENT]
local lz = require("luazero")
local zero = require("luazero.zero")
local data = require("luazero.data")
local mixtral = require("models.mixtral")

local comm = require("luazero.comm").init()
local rank, world = comm.rank(), comm.size()
local corpus = data.load(arg[1])
local ep_size, stage = tonumber(arg[2]), tonumber(arg[3])
local save, load = arg[4] ~= "-" and arg[4], arg[5] ~= "-" and arg[5]
local accum, dtype = tonumber(arg[6] or "1"), (arg[7] or "fp32"):gsub("%-grads$", "")
local half_grads = (arg[7] or ""):find("%-grads$") ~= nil
local gather = arg[8] or "expert"
local optimizer = arg[9] or "AdamW"
local device, offload = arg[10] or "cpu", arg[11] == "cpu" and { device = "cpu" } or nil
local how = arg[11] or "none"
local nvme_param = how:match("^nvme%+param:(.+)$")
local nvme = nvme_param or how:match("^nvme:(.+)$")
local param_nvme = how:match("^cpu%+param%-nvme:(.+)$")
if how ~= "none" and how ~= "cpu" and not nvme and not param_nvme then
  error(("moe_edp_check: OFFLOAD %q: expected none, cpu, nvme:DIR, nvme+param:DIR or " ..
         "cpu+param-nvme:DIR"):format(how), 0)
end
local offload_opt = nvme and { device = "nvme", nvme_path = nvme } or offload
if nvme_param then offload = offload_opt end
if param_nvme then
  offload_opt, offload = { device = "cpu" }, { device = "nvme", nvme_path = param_nvme }
end

local mcfg = mixtral.config("mixtral-tiny", { moe_gather = gather })
local cfg = { train_micro_batch_size_per_gpu = 2, gradient_accumulation_steps = accum,
              gradient_clipping = 0.05, bf16 = { enabled = dtype == "bf16" },
              fp16 = { enabled = dtype == "fp16" },
              data_types = half_grads and { grad_accum_dtype = dtype } or nil,
              zero_optimization = { stage = stage, stage3_param_persistence_threshold = 0,
                                    reduce_bucket_size = 5000,
                                    stage3_prefetch_bucket_size = 5000,
                                    offload_optimizer = stage > 0 and offload_opt or nil,
                                    offload_param = stage == 3 and offload or nil },
              optimizer = { type = optimizer, params = { lr = 1e-2, min_8bit_size = optimizer ==
                                                         "AdamW8bit" and 1000 or nil } },
              moe = { ep_size = ep_size, placement = arg[12] } }
local engine = zero.initialize({ model = mixtral.new(mcfg), config = cfg, seed = 1,
                                 batch = { 2, 16 }, comm = comm, device = device })
local held = lz.mem()
local loader = data.loader(corpus, { B = 2, T = 16, seed = 1, vocab = mcfg.vocab,
                                     rank = rank, world = world })
local norms = {}
local first = 1
if load then
  engine:load(load)
  for _ = 1, 2 * accum do loader:next_batch() end
  first = 3
end
for step = first, 4 do
  local rec = engine:train_batch(loader)
  norms[#norms + 1] = ("%a"):format(rec.grad_norm)
  if step == 2 and save then engine:save(save) end
end
-- the parameter gathers' bytes, the world's and the experts' groups'
local gathered = require("luazero.comm").bytes().all_gather +
                 (engine.edp_group and engine.edp_group:bytes().all_gather or 0)
local sum = engine:params_checksum()
-- the full master in canonical order (every rank's, the other groups'
-- experts included): the checksum's bytes
local master = engine:master_params()
local hasher = lz.hasher(0)
hasher:update(master.data, master:numel() * 4)
local master_sum = require("bit").tohex(hasher:digest(), 16)
hasher:free()
master:free()
-- a sharded master's slices are lent for one call of master_slices' fn
-- each: every one is freed when the walk ends
local plan = engine:plan()
if plan:swapped("master") or plan.master.extent ~= "full" then
  local lent = {}
  engine.model_states:master_slices(function(_, slice) lent[#lent + 1] = slice end)
  for i, slice in ipairs(lent) do
    if pcall(slice.numel, slice) then
      error(("moe_edp_check: master slice %d of %d outlived master_slices"):format(i, #lent), 0)
    end
  end
end
if rank == 0 then
  print(("master_params %s %d"):format(master_sum, engine.L.numel + engine.L.elsewhere))
  print("describe " .. engine:describe())
  print(("sum %s %s %s params %d grads %d gathered %d"):format(
    sum, engine:plan().experts, table.concat(norms, " "), held.params, held.grads, gathered))
end
engine:free()
loader:free()
corpus.tokens:free()
