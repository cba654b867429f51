-- tests/ref/hf_grads.lua — a Hugging Face folder's loss and gradients in
-- luazero (not a test: the luazero side of the family reference tests).
-- One-rank fp32 engine, --init's weights (luazero/hf.lua), one forward and
-- backward on the batch in TOKENS (i32, inputs [B, T] then targets [B, T]);
-- writes OUT/grads.f32 (the gradients in canonical order, padded token rows
-- included) and prints JSON: the loss and the parameter table.
--   luazero tests/ref/hf_grads.lua FOLDER TOKENS B T OUT
local cjson = require("cjson")
local ffi = require("ffi")
local lz = require("luazero")
local models = require("models.registry")

local folder, tokens_path, B, T, out = arg[1], arg[2], tonumber(arg[3]), tonumber(arg[4]), arg[5]
assert(out, "usage: luazero tests/ref/hf_grads.lua FOLDER TOKENS B T OUT")
local cfg = models.from_hf_config(folder .. "/config.json")
local engine = require("luazero.zero").initialize({ model = models.new(cfg), batch = { B, T },
                               comm = require("luazero.comm").init("local"),
                               config = { train_micro_batch_size_per_gpu = B } })
require("luazero.hf").load_into(engine, folder)

local f = assert(io.open(tokens_path, "rb"))
local bytes = f:read("*a")
f:close()
assert(#bytes == 2 * B * T * 4, "hf_grads: TOKENS must hold 2 x B x T int32")
local x, y = lz.tensor({ B, T }, "i32"), lz.tensor({ B, T }, "i32")
ffi.copy(x.data, bytes, B * T * 4)
ffi.copy(y.data, bytes:sub(B * T * 4 + 1), B * T * 4)

local loss = engine:forward(x, y)
engine:backward(loss)
local e = engine
local g = lz.tensor({ e.L.numel }, "f32", "workspace")
for _, seg in ipairs(e.L.segments) do
  g:view(seg.entries[1].offset, { seg.numel }):copy(e.grads:view(seg.full_offset, { seg.numel }))
end
local o = assert(io.open(out .. "/grads.f32", "wb"))
o:write(ffi.string(g.data, g:bytes()))
o:close()
local params = {}
for i, p in ipairs(engine.model.param_table) do
  params[i] = { name = p.name, shape = p.shape, offset = p.offset, numel = p.numel }
end
print(cjson.encode({ loss = ("%.17g"):format(loss), params = params }))
