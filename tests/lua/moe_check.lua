-- moe_check.lua — run by test_moe.lua (one rank or several, under the
-- launcher): a tiny Mixtral trained 3 steps at ZeRO stages 0-3 with
-- adversarial routing, rank r's tokens all sent to expert r alone (top-1),
-- so the ranks route differently and the experts past the world size get no
-- token anywhere. Prints, on rank 0, "stage S <params checksum>
-- <expert rows of step 1, block 1>" per stage, then "done". A stage whose
-- collectives depended on the routing would hang here, not finish.
-- GATHER: the experts' gather granularity, block (default) or expert, or
-- routed (per expert, only the experts some rank routed to: the config's
-- moe.routed_only). ACCUM "accum": 2 micro-steps a step with activation
-- checkpointing, rank r's tokens sent to expert r + 2m on micro-step m, so
-- an expert routed in one micro-step is unrouted in the next.
--   luazero [-n N] tests/lua/moe_check.lua CORPUS [GATHER [ACCUM]]
local ffi = require("ffi")
local lz = require("luazero")
local data = require("luazero.data")
local MoE = require("luazero.nn.moe")
local mixtral = require("models.mixtral")

local support = dofile(lz.root .. "/tests/lua/support.lua")

local comm = require("luazero.comm").init()
local rank = comm.rank()
local corpus = data.load(arg[1])

-- The router's choice, then every token of this rank sent to expert `rank`
-- (top-1, renormalised: weight 1).
local accum = arg[3] == "accum" and 2 or 1
local choose = MoE.choose
function MoE:choose(logits, N)
  local c = choose(self, logits, N)
  -- (a replay of activation checkpointing routes as its forward did)
  if not self.ctx.recomputing then self.micro_seen = (self.micro_seen or -1) + 1 end
  local e = (rank + 2 * (self.micro_seen % accum)) % self.n_experts
  local idx, w = ffi.cast("int32_t *", c.idx.data), ffi.cast("float *", c.weights.data)
  for i = 0, N * self.top_k - 1 do idx[i], w[i] = e, 1 end
  return c
end

local mode = arg[2] or "block"
local gather = mode == "routed" and "expert" or mode
for stage = 0, 3 do
  local mcfg = mixtral.config("mixtral-tiny", { top_k = 1, moe_gather = gather })
  local engine, loader = support.moe_engine(comm, corpus, mcfg, stage, {
    accum = accum, moe = { gather = gather, routed_only = mode == "routed" },
    checkpoint_activations = accum > 1 })
  local rows, read, full
  for step = 1, 3 do
    engine:train_batch(loader)
    local m = engine.model:router_metrics()
    if step == 1 then
      rows = table.concat(m.expert_tokens[1], ",")
      read, full = engine:expert_bytes()
    end
  end
  local sum = engine:params_checksum()
  if rank == 0 then print(("stage %d %s %s bytes %d %d"):format(stage, sum, rows, read, full)) end
  if stage == 0 and rank == 0 then print("describe " .. engine:describe()) end
  engine:free()
  loader:free()
end
corpus.tokens:free()
if rank == 0 then print("done") end
