-- moe_world_check.lua — run by test_moe.lua under the launcher at several
-- world sizes: the first optimizer step of each tiny MoE family (the
-- load-balancing loss on, its coefficient raised to 0.5 so it weighs in) on
-- a global batch of 4 rows, each rank taking 4 / world of them, at ZeRO
-- stages 0 and 3. Each rank prints "FAMILY STAGE rank R aux A" (its own
-- load-balancing loss: per rank, as DeepSpeed computes it) and rank 0
-- "FAMILY STAGE loss L coef C" (the loss averaged over ranks), then "done";
-- the language-model loss is L - C x the mean of the ranks' A.
--   luazero [-n N] tests/lua/moe_world_check.lua CORPUS
local zero = require("luazero.zero")
local data = require("luazero.data")
local models = require("models.registry")

local comm = require("luazero.comm").init()
local rank, world = comm.rank(), comm.size()
local corpus = data.load(arg[1])
local ROWS, T = 4, 16
assert(ROWS % world == 0, "moe_world_check: the world size must divide 4")
local B = ROWS / world

for _, name in ipairs({ "mixtral-tiny", "qwen2-moe-tiny", "qwen3-moe-tiny", "olmoe-tiny" }) do
  for _, stage in ipairs({ 0, 3 }) do
    local mcfg = models.config(name, { aux_coef = 0.5 })
    local cfg = { train_micro_batch_size_per_gpu = B, gradient_accumulation_steps = 1,
                  zero_optimization = { stage = stage, stage3_param_persistence_threshold = 0 },
                  optimizer = { type = "AdamW", params = { lr = 1e-3 } } }
    local engine = zero.initialize({ model = models.new(mcfg), config = cfg, seed = 1,
                                     batch = { B, T }, comm = comm })
    local loader = data.loader(corpus, { B = B, T = T, seed = 1, vocab = mcfg.vocab,
                                         rank = rank, world = world })
    local rec = engine:train_batch(loader)
    local aux = engine.model:router_metrics().aux_loss
    io.stdout:write(("%s %d rank %d aux %.17g\n"):format(name, stage, rank, aux))
    io.stdout:flush()
    comm.barrier()
    if rank == 0 then
      io.stdout:write(("%s %d loss %.17g coef %.17g\n"):format(name, stage, rec.loss,
                                                               mcfg.aux_coef))
      io.stdout:flush()
    end
    comm.barrier()
    engine:free()
    loader:free()
  end
end
corpus.tokens:free()
if rank == 0 then print("done") end
