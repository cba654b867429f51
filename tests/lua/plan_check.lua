-- plan_check.lua — run by test_plan.lua (one rank or several, under the
-- launcher): for every stage x dtype x offload combination, builds the
-- engine on a tiny GPT-2 with AdamW and with Lion, takes one optimizer
-- step and compares the bytes
-- its placement plan gives (zero/plan.lua) with the ledger's growth and
-- with luazero.estimate. Prints "ok <case>" or "BAD <case>: <why>" per
-- case (rank 0), then "done". (Not a test file: run_lua.lua loads only
-- test_*.lua.) On DEVICE sim, the device tier is the device's ledger and
-- the host tier the host's offload category, as on a GPU.
--   luazero [-n 2] tests/lua/plan_check.lua CORPUS SWAP_DIR [DEVICE]
local lz = require("luazero")
local zero = require("luazero.zero")
local Placement = require("luazero.zero.plan")
local estimate = require("luazero.estimate")
local data = require("luazero.data")
local gpt2 = require("models.gpt2")

local corpus_path, swap_dir, device = arg[1], arg[2], arg[3] or "cpu"
local comm = require("luazero.comm").init()
local rank, world = comm.rank(), comm.size()
local corpus = data.load(corpus_path)

local offloads = {
  { name = "none" },
  { name = "cpu", opt = { device = "cpu" }, estimate = "cpu" },
  { name = "nvme", opt = { device = "nvme", nvme_path = swap_dir } },
  { name = "cpu+param", opt = { device = "cpu" }, param = { device = "cpu" }, estimate = "cpu+param" },
  { name = "nvme+param-nvme", opt = { device = "nvme", nvme_path = swap_dir },
    param = { device = "nvme", nvme_path = swap_dir, buffer_size = 1e6 } },
}

local function delta(after, before)
  local d = {}
  for k, v in pairs(after) do d[k] = v - (before[k] or 0) end
  return d
end

local bad = 0
local function check(case, what, got, want)
  if got ~= want then
    bad = bad + 1
    if rank == 0 then print(("BAD %s: %s is %s, the plan says %s"):format(case, what, got, want)) end
    return false
  end
  return true
end

for _, opt in ipairs({ "AdamW", "Lion" }) do
for _, dtype in ipairs({ "fp32", "bf16" }) do
  for stage = 0, 3 do
    for _, o in ipairs(offloads) do
      local ok_combo = (o.opt == nil or Placement.stage_allows("offload_optimizer", stage)) and
                       (o.param == nil or Placement.stage_allows("offload_param", stage))
      if ok_combo then
        local case = ("world %d stage %d %s %s offload %s"):format(world, stage, dtype, opt, o.name)
        local z = { stage = stage, stage3_param_persistence_threshold = 600,
                    sub_group_size = 4096, offload_optimizer = o.opt, offload_param = o.param }
        local cfg = { train_micro_batch_size_per_gpu = 2, gradient_accumulation_steps = 1,
                      bf16 = { enabled = dtype == "bf16" }, zero_optimization = z,
                      optimizer = { type = opt, params = { lr = 1e-3 } } }
        local mcfg = gpt2.config("gpt2-nano", { n_layer = 1, n_embd = 32, n_head = 2, context = 16 })
        collectgarbage(); collectgarbage()
        local before, before_dev = lz.mem(), lz.mem_device()
        local engine = zero.initialize({ model = gpt2.new(mcfg), config = cfg, seed = 1,
                                         batch = { 2, 16 }, comm = comm, device = device })
        local loader = data.loader(corpus, { B = 2, T = 16, seed = 1, vocab = mcfg.vocab,
                                             rank = rank, world = world })
        engine:train_batch(loader)
        local d = delta(lz.mem(), before)
        local dd = device == "cpu" and d or delta(lz.mem_device(), before_dev)
        local L, P = engine.L, engine:plan()
        local persistent = 0
        for _, seg in ipairs(L.segments) do
          if seg.persistent then persistent = persistent + seg.padded end
        end
        local counts = { full = L.full_numel, shard = L.shard_numel, persistent = persistent }
        local by = P:bytes(counts)
        -- On a cpu device the host tier is the ledger's offload category;
        -- NVMe staging buffers are offload too, beside it.
        local staging = engine.states:staging_bytes()
        if P.params.tier == "nvme" then
          for _, t in ipairs(engine.pshard.all_stages) do staging = staging + t:bytes() end
        end
        -- Beside an accelerator: the updated working shard's staging and
        -- the reduced gradients' (pinned, offload).
        if device ~= "cpu" then
          if P.push_params then staging = staging + engine.wstage:bytes() end
          for _, t in ipairs(engine.hpool.all) do staging = staging + t:bytes() end
        end
        local fine = check(case, "ledger params", dd.params, by.device.params) and
                     check(case, "ledger grads", dd.grads, by.device.grads) and
                     check(case, "ledger optimizer", dd.optimizer, by.device.optimizer) and
                     check(case, "ledger offload", d.offload - staging, by.host.total)
        if fine and device ~= "cpu" then
          -- Nothing of the model's states in host memory but the host tier.
          fine = check(case, "host params", d.params, 0) and check(case, "host grads", d.grads, 0)
                 and check(case, "host optimizer", d.optimizer, 0)
        end
        if fine and opt == "AdamW" and o.name ~= "nvme" and o.name ~= "nvme+param-nvme" then
          local r = estimate.model_states(L.numel, world, stage, {
            dtype = dtype, offload = o.estimate or "none",
            device = device == "cpu" and "cpu" or "cuda",
            layout = { full = L.full_numel, shard = L.shard_numel }, persistent = persistent })
          fine = check(case, "estimate device bytes", r.device, by.device.total) and
                 check(case, "estimate cpu bytes", r.cpu, by.host.total)
        end
        if fine and rank == 0 then print("ok   " .. case) end
        engine:free()
        loader:free()
      end
    end
  end
end
end
corpus.tokens:free()
if rank == 0 then print(("done: %d bad"):format(bad)) end
