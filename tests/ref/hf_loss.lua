-- tests/ref/hf_loss.lua — the luazero side of tests/ref/test_hf.py and test_export.py: a
-- one-rank fp32 engine with a checkpoint's weights (engine:load) or with a
-- Hugging Face folder's (--init: luazero/hf.lua), and its loss on a fixed
-- batch, printed as JSON with the batch's tokens.
--   luazero tests/ref/hf_loss.lua CKPT
--   luazero tests/ref/hf_loss.lua --init FOLDER
--   luazero tests/ref/hf_loss.lua --init FOLDER --grads DIR
-- --grads: then a backward, and DIR/grads.f32 (the gradients in the
-- parameter table's order, fp32) and DIR/params.json (that table).
local cjson = require("cjson")
local lz = require("luazero")
local rng = require("luazero.rng")
local models = require("models.registry")

local init = arg[1] == "--init"
local path = assert(init and arg[2] or arg[1], "usage: luazero tests/ref/hf_loss.lua [--init] PATH")
local grads_dir = arg[init and 3 or 2] == "--grads" and arg[init and 4 or 3]
local cfg
if init then
  cfg = models.from_hf_config(path .. "/config.json")
else
  local saved = require("luazero.checkpoint").open(path).manifest.model.config
  cfg = {}
  for k, v in pairs(saved) do cfg[k] = v end
  cfg = models.families[cfg.family].finish(cfg)
end
local B, T = 2, 16
local engine = require("luazero.zero").initialize({ model = models.new(cfg), batch = { B, T },
                               comm = require("luazero.comm").init("local"),
                               config = { train_micro_batch_size_per_gpu = B } })
if init then require("luazero.hf").load_into(engine, path) else engine:load(path) end
local x = lz.tensor({ B, T }, "i32")
local y = lz.tensor({ B, T }, "i32")
local r, tokens = rng.new(5), {}
for i = 0, B * T - 1 do x:set(i, r:int(cfg.vocab)) end
for i = 0, B * T - 1 do y:set(i, r:int(cfg.vocab)) end
for i = 0, B * T - 1 do tokens[#tokens + 1] = x:get(i) end
for i = 0, B * T - 1 do tokens[#tokens + 1] = y:get(i) end
local loss = engine:forward(x, y)
if grads_dir then
  engine:backward(loss)
  local g = lz.tensor({ engine.L.numel }, "f32", "workspace")
  for _, seg in ipairs(engine.L.segments) do
    g:view(seg.entries[1].offset, { seg.numel }):copy(engine.grads:view(seg.full_offset,
                                                                         { seg.numel }))
  end
  local f = assert(io.open(grads_dir .. "/grads.f32", "wb"))
  f:write(require("ffi").string(g.data, g:bytes()))
  f:close()
  local params = {}
  for i, e in ipairs(engine.model.param_table) do
    params[i] = { name = e.name, shape = e.shape, offset = e.offset, numel = e.numel }
  end
  f = assert(io.open(grads_dir .. "/params.json", "w"))
  f:write(cjson.encode(params))
  f:close()
end
print(cjson.encode({ loss = ("%.17g"):format(loss), tokens = tokens }))
