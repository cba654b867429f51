-- moe_ep_check.lua — run by test_moe_ep.lua under the launcher: a tiny
-- Mixtral trained 3 steps at ZeRO stages 0-3 under expert parallelism
-- (moe.ep_size EP: the experts placed on the expert-parallel group's ranks,
-- rows exchanged by all-to-all-v). Prints, on rank 0, "stage S <params
-- checksum> <expert rows of step 1, block 1> <first step's loss> <where the
-- experts' parameters live: world|edp> <elements of the full layout>
-- <expert elements other ranks hold>" per stage, then "done". An exchange that depended on the routing would hang
-- here, not finish.
-- GATHER: the experts' gather granularity, block or expert; ROUTE:
-- adversarial (below), pile (below) or router (the router's own top-2).
--   luazero -n N tests/lua/moe_ep_check.lua CORPUS GATHER EP ROUTE
local ffi = require("ffi")
local lz = require("luazero")
local data = require("luazero.data")
local MoE = require("luazero.nn.moe")
local mixtral = require("models.mixtral")

local support = dofile(lz.root .. "/tests/lua/support.lua")

local comm = require("luazero.comm").init()
local rank = comm.rank()
local corpus = data.load(arg[1])

-- Adversarial routing: the router's choice, then every token of this rank
-- sent to expert `rank` (top-1, renormalised: weight 1); "pile": every
-- token of every rank to expert 0 (the most rows one rank's experts get
-- under expert parallelism).
local route = arg[4] or "adversarial"
local adversarial = route ~= "router"
local choose = MoE.choose
if adversarial then
  local to = route == "pile" and 0 or rank
  function MoE:choose(logits, N)
    local c = choose(self, logits, N)
    local idx, w = ffi.cast("int32_t *", c.idx.data), ffi.cast("float *", c.weights.data)
    for i = 0, N * self.top_k - 1 do idx[i], w[i] = to, 1 end
    return c
  end
end

local gather = arg[2] or "block"
local ep_size = tonumber(arg[3] or "1")
for stage = 0, 3 do
  local mcfg = mixtral.config("mixtral-tiny", { top_k = adversarial and 1 or 2,
                                                moe_gather = gather })
  local engine, loader = support.moe_engine(comm, corpus, mcfg, stage,
                                             { moe = { ep_size = ep_size } })
  local rows, loss
  for step = 1, 3 do
    local rec = engine:train_batch(loader)
    loss = loss or rec.loss
    local m = engine.model:router_metrics()
    if step == 1 then rows = table.concat(m.expert_tokens[1], ",") end
  end
  local sum = engine:params_checksum()
  if rank == 0 then
    print(("stage %d %s %s %.9g %s %d %d"):format(stage, sum, rows, loss, engine:plan().experts,
                                               engine.L.full_numel, engine.L.elsewhere))
  end
  if stage == 0 and rank == 0 then print("describe " .. engine:describe()) end
  engine:free()
  loader:free()
end
corpus.tokens:free()
if rank == 0 then print("done") end
