-- tests/ref/masking_loss.lua — the luazero side of tests/ref/test_masking.py:
-- a Hugging Face folder's weights (--init: luazero/hf.lua) in a one-rank fp32
-- engine, one forward and backward on a batch read from a JSON file, the loss
-- and the gradients written out.
--   luazero tests/ref/masking_loss.lua FOLDER BATCH.json OUT
-- BATCH.json: { B, T, tokens, targets[, pos, seg] } (flat lists of B * T
-- ints; targets already shifted: targets[t] is the token after t, or < 0).
-- OUT/: meta.json { loss, params = [{name, shape, offset, numel}] } and
-- grads.f32 (the gradients in canonical order, raw little-endian).
local ffi = require("ffi")
local cjson = require("cjson")
local lz = require("luazero")
local models = require("models.registry")

local folder, batch_path, out = arg[1], arg[2], arg[3]
assert(folder and batch_path and out, "usage: luazero tests/ref/masking_loss.lua FOLDER BATCH OUT")
local f = assert(io.open(batch_path))
local batch = cjson.decode(f:read("*a"))
f:close()
local B, T = batch.B, batch.T

local cfg = models.from_hf_config(folder .. "/config.json")
local engine = require("luazero.zero").initialize({
  model = models.new(cfg), batch = { B, T }, comm = require("luazero.comm").init("local"),
  config = { train_micro_batch_size_per_gpu = B } })
require("luazero.hf").load_into(engine, folder)

local function ids(list)
  if not list then return nil end
  local t = lz.tensor({ B, T }, "i32")
  for i = 1, B * T do t:set(i - 1, list[i]) end
  return t
end
local x, y = ids(batch.tokens), ids(batch.targets)
local extra = batch.pos and { pos = ids(batch.pos), seg = ids(batch.seg) } or nil
local loss = engine:forward(x, y, extra)
engine:backward(loss)

-- The engine's gradients (padded segments) in canonical order.
local g = lz.tensor({ engine.L.numel }, "f32", "workspace")
for _, seg in ipairs(engine.L.segments) do
  g:view(seg.entries[1].offset, { seg.numel }):copy(engine.grads:view(seg.full_offset,
                                                                      { seg.numel }))
end
local fg = assert(io.open(out .. "/grads.f32", "wb"))
fg:write(ffi.string(g.data, g:bytes()))
fg:close()

local params = {}
for i, e in ipairs(engine.model.param_table) do
  params[i] = { name = e.name, shape = e.shape, offset = e.offset, numel = e.numel }
end
local fm = assert(io.open(out .. "/meta.json", "w"))
fm:write(cjson.encode({ loss = ("%.17g"):format(loss), params = params }))
fm:close()
