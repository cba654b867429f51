-- tests/ref/muon_run.lua DIR — runs luazero's Muon (optim/muon.lua) over
-- the case tests/ref/test5_muon.py wrote into DIR: case.json ({ params,
-- shape, steps, grad_scale, pieces }), p0.f32 and g1.f32 .. gN.f32 (raw
-- little-endian fp32); writes p.f32 (the parameters after the steps) and
-- m.f32 (the momentum). The step runs as the engine runs it
-- (zero/matrices.lua): prepare and step over `pieces` slices of the flat
-- matrix, orthogonalize over it whole; a 1-D shape is AdamW's piece.
local ffi = require("ffi")
local cjson = require("cjson")
local lz = require("luazero")
local optim = require("luazero.optim")

local dir = assert(arg[1], "usage: muon_run.lua DIR")

local function read(name, t)
  local f = assert(io.open(dir .. "/" .. name, "rb"))
  local s = f:read("*a")
  f:close()
  assert(#s == t:bytes(), name .. ": wrong size")
  ffi.copy(t.data, s, #s)
  return t
end

local function write(name, t)
  local f = assert(io.open(dir .. "/" .. name, "wb"))
  f:write(ffi.string(t.data, t:bytes()))
  f:close()
end

local f = assert(io.open(dir .. "/case.json"))
local case = cjson.decode(f:read("*a"))
f:close()

local opt = optim.new({ type = "Muon", params = case.params })
local shape = case.shape
local n = 1
for _, d in ipairs(shape) do n = n * d end
local matrix = #shape == 2 and { shape[1], shape[2] } or nil
local p = read("p0.f32", lz.tensor({ n }, "f32"))
local g = lz.tensor({ n }, "f32")
local m, v = lz.tensor({ n }, "f32"), lz.tensor({ n }, "f32")

-- The pieces a rank's slices would cut the matrix into.
local pieces = {}
local k = case.pieces or 1
for i = 0, k - 1 do
  local lo, hi = math.floor(n * i / k), math.floor(n * (i + 1) / k)
  pieces[#pieces + 1] = {
    p = p:view(lo, { hi - lo }), g = g:view(lo, { hi - lo }),
    s = { m:view(lo, { hi - lo }), v:view(lo, { hi - lo }) }, decay = true, matrix = matrix,
  }
end

local lr, scale = case.params.lr, case.grad_scale or 1
for t = 1, case.steps do
  read(("g%d.f32"):format(t), g)
  if matrix then
    for _, c in ipairs(pieces) do opt:prepare(c, t, scale) end
    local u = v:view(0, { shape[1], shape[2] })
    opt:orthogonalize(u, shape[1], shape[2])
    u:free()
  end
  for _, c in ipairs(pieces) do opt:update(c, t, lr, scale) end
end
write("p.f32", p)
write("m.f32", m)
print("ok")
