-- tests/repl/engine.lua — a tiny GPT-2 under the ZeRO engine for the REPL
-- tests: `luazero [-n N] -i tests/repl/engine.lua [stage] [fail]` leaves
-- `engine` and `model` in globals (two optimizer steps taken); with "fail"
-- it raises after that, so -i must still offer them.
local lz = require("luazero")
local gpt2 = require("models.gpt2")

local stage = tonumber(arg[1] or "3")
local cfg = gpt2.config("gpt2-nano", { n_layer = 2, n_embd = 64, n_head = 4, context = 16 })
model = gpt2.new(cfg)
engine = require("luazero.zero").initialize({
  model = model, seed = 7, batch = { 2, 16 },
  config = { zero_optimization = { stage = stage, stage3_param_persistence_threshold = 128 },
             gradient_clipping = 1.0, optimizer = { params = { lr = 1e-3 } } },
})
local batches = {
  next_batch = function()
    local x, y = lz.tensor({ 2, 16 }, "i32"), lz.tensor({ 2, 16 }, "i32")
    for i = 0, 31 do x:set(i, (i * 7) % cfg.vocab); y:set(i, (i * 7 + 1) % cfg.vocab) end
    return x, y
  end,
}
for _ = 1, 2 do engine:train_batch(batches) end
steps_done = engine.optimizer_steps
if arg[2] == "fail" then error("the script failed on purpose") end
