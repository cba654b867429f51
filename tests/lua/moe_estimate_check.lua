-- moe_estimate_check.lua — run by test_estimate_moe.lua under the launcher:
-- a tiny Mixtral (experts gathered per expert or per block) trained one
-- step under moe.ep_size EP at each ZeRO stage, beside the estimate of the
-- same configuration. Prints, on rank 0, one line a case:
--   case <stage> <optimizer> <experts: world|edp, the engine's> <the
--   estimate's> host <the ledger's params + grads + optimizer + offload>
--   <the estimate's kept host bytes> params <ledger> <estimate> acts
--   <the ledger's activations> <the estimate's> device <the device
--   ledger's params + grads + optimizer> <the estimate's kept device bytes>
-- then "done". DEVICE: cpu (default: one memory, all of it host) or sim
-- (the device's memory apart).
--   luazero -n N tests/lua/moe_estimate_check.lua CORPUS EP GATHER [DEVICE [NVME_DIR]]
local lz = require("luazero")
local zero = require("luazero.zero")
local data = require("luazero.data")
local estimate = require("luazero.estimate")
local formats = require("luazero.optim.formats")
local mixtral = require("models.mixtral")
local support = dofile(lz.root .. "/tests/lua/support.lua")

local comm = require("luazero.comm").init()
local rank, world = comm.rank(), comm.size()
local corpus = data.load(arg[1])
local ep_size, gather, device = tonumber(arg[2]), arg[3] or "expert", arg[4] or "cpu"
local B, S = 2, 16

local optimizers = {
  adamw = { type = "AdamW", params = { lr = 1e-3 } },
  -- (block-scaled states, their blocks the world layout's under either placement)
  adamw8bit = { type = "AdamW8bit", params = { lr = 1e-3, min_8bit_size = 1000 } },
  -- (whole matrices: an expert's owned by a rank of its group)
  muon = { type = "Muon", params = { lr = 0.01 } },
}
-- (nvme: the optimizer's states in a swap file under NVME, the fifth
-- argument's folder; in bf16 the fp32 master there too;
-- nvme+param: the parameter shard there too)
local cases = { { 0, "adamw" }, { 1, "adamw" }, { 2, "adamw" }, { 3, "adamw" },
                { 1, "adamw8bit" }, { 3, "adamw8bit" }, { 2, "muon" } }
local nvme_dir = arg[5]
if nvme_dir then
  cases[#cases + 1] = { 2, "adamw", "nvme" }
  cases[#cases + 1] = { 2, "adamw", "nvme", "bf16" }
  cases[#cases + 1] = { 3, "adamw", "nvme+param" }
end

for _, c in ipairs(cases) do
  local stage, oname = c[1], c[2]
  local off = c[3] and { device = "nvme", nvme_path = nvme_dir } or nil
  local off_param = c[3] == "nvme+param" and off or nil
  local mcfg = mixtral.config("mixtral-tiny", { moe_gather = gather })
  local dtype = c[4] or "fp32"
  local cfg = { train_micro_batch_size_per_gpu = B, bf16 = { enabled = dtype == "bf16" },
                zero_optimization = { stage = stage, stage3_param_persistence_threshold = 600,
                                      offload_optimizer = off, offload_param = off_param },
                optimizer = optimizers[oname], moe = { ep_size = ep_size } }
  -- The estimate, of a model declared beside the engine's (never placed).
  local settings = estimate.settings_of(cfg, device)
  local counts = estimate.counts(mixtral.new(mcfg), world, 600, formats.block_of(settings.formats),
                                 ep_size)
  local r = estimate.rank(counts, settings)
  local acts = estimate.activations(mixtral.new(mcfg), B, S, dtype, ep_size).device
  local states = support.ledger_mark()
  local engine = zero.initialize({ model = mixtral.new(mcfg), config = cfg, seed = 1,
                                   batch = { B, S }, comm = comm, device = device })
  local loader = data.loader(corpus, { B = B, T = S, seed = 1, vocab = mcfg.vocab, rank = rank,
                                       world = world })
  engine:train_batch(loader)
  local host, dev, added = states(device)
  if rank == 0 then
    local tier = device == "cpu" and r.host or r.device
    print(("case %d %s %s %s host %d %d params %d %d acts %d %d device %d %d"):format(stage,
          oname .. (c[3] and "-" .. c[3] or "") .. (c[4] and "-" .. c[4] or ""),
          engine:plan().experts, r.experts or "world", host, estimate.kept(r, "host"),
          added.params, tier.params or 0, added.activations, acts,
          dev, estimate.kept(r, "device")))
  end
  engine:free()
  loader:free()
end
if rank == 0 then print("done") end
corpus.tokens:free()
