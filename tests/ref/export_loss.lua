-- tests/ref/export_loss.lua — the luazero side of tests/ref/test_export.py:
-- loads a checkpoint into a one-rank fp32 engine and prints, as JSON, the
-- loss on a fixed batch and that batch's tokens.
--   luazero tests/ref/export_loss.lua CKPT
local cjson = require("cjson")
local lz = require("luazero")
local rng = require("luazero.rng")
local checkpoint = require("luazero.checkpoint")
local gpt2 = require("models.gpt2")

local path = assert(arg[1], "usage: luazero tests/ref/export_loss.lua CKPT")
local ck = checkpoint.open(path)
local c = ck.manifest.model.config
local cfg = gpt2.config("gpt2-nano", { n_layer = c.n_layer, n_head = c.n_head, n_embd = c.n_embd,
                                       context = c.context, vocab = c.vocab })
local B, T = 2, 16
local engine = require("luazero.zero").initialize({ model = gpt2.new(cfg), batch = { B, T },
                               comm = require("luazero.comm").init("local"),
                               config = { train_micro_batch_size_per_gpu = B } })
engine:load(path)
local x = lz.tensor({ B, T }, "i32")
local y = lz.tensor({ B, T }, "i32")
local r, tokens = rng.new(5), {}
for i = 0, B * T - 1 do x:set(i, r:int(cfg.vocab)) end
for i = 0, B * T - 1 do y:set(i, r:int(cfg.vocab)) end
for i = 0, B * T - 1 do tokens[#tokens + 1] = x:get(i) end
for i = 0, B * T - 1 do tokens[#tokens + 1] = y:get(i) end
local loss = engine:forward(x, y)
print(cjson.encode({ loss = loss, tokens = tokens }))
