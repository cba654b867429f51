-- test_cdef.lua — the FFI declarations (lua/luazero/cdef.lua) must be what
-- tools/gen-cdef.lua makes of core/luazero.h today, and the layers must hold
-- (tools/check-layers).
local root = rawget(_G, "LUAZERO_ROOT") or "."
package.path = root .. "/tools/?.lua;" .. package.path
local gen = dofile(root .. "/tools/gen-cdef.lua")
local want = gen.generate(gen.read(root .. "/core/luazero.h"))
local have = gen.read(root .. "/lua/luazero/cdef.lua")
local passed, failed = 0, 0
if want == have then
  print("ok   cdef.lua matches core/luazero.h")
  passed = passed + 1
else
  print("FAIL lua/luazero/cdef.lua has drifted from core/luazero.h: run luajit tools/gen-cdef.lua")
  failed = failed + 1
end
-- Every function the header declares resolves in the library, the CUDA ones
-- too (they reach libluazero_cuda.so through the core: a lent GPU's first
-- call of lz_cuda_device_name must not be an undefined symbol).
local lz = require("luazero")
local missing = {}
for name in want:gmatch("([%w_]+)%s*%(") do
  if name:match("^lz_") then
    if not pcall(function() return lz.C[name] end) then missing[#missing + 1] = name end
  end
end
if #missing == 0 then
  print("ok   every declared function is in libluazero")
  passed = passed + 1
else
  print("FAIL declared but not in libluazero: " .. table.concat(missing, ", "))
  failed = failed + 1
end
-- The core's rooms depend downward only and the Lua modules have no require
-- cycle (tools/check-layers says which arrow is wrong).
local p = io.popen("cd '" .. root .. "' && tools/check-layers 2>&1; echo \"exit $?\"")
local out = p:read("*a")
p:close()
if out:match("exit 0%s*$") then
  print("ok   tools/check-layers: rooms and requires point one way")
  passed = passed + 1
else
  print("FAIL tools/check-layers:\n" .. out)
  failed = failed + 1
end
-- The same check finds a cycle made of lazy requires (inside functions, or
-- through pcall), and refuses a require whose name is computed.
local function layers(files)
  local q = io.popen("cd '" .. root .. "' && tools/check-layers --lua " .. files .. " 2>&1; echo \"exit $?\"")
  local text = q:read("*a")
  q:close()
  return text
end
local fx = "tests/fixtures/layers/"
local lazy = layers(fx .. "lazy_a.lua " .. fx .. "lazy_b.lua")
local computed = layers(fx .. "computed.lua")
local want = "tests.fixtures.layers.lazy_a -> tests.fixtures.layers.lazy_b -> tests.fixtures.layers.lazy_a"
if lazy:find(want, 1, true) and lazy:match("exit 1%s*$")
   and computed:find("computed.lua:4: a computed require", 1, true) and computed:match("exit 1%s*$") then
  print("ok   tools/check-layers finds a cycle of lazy requires and refuses a computed one")
  passed = passed + 1
else
  print("FAIL tools/check-layers on tests/fixtures/layers:\n" .. lazy .. computed)
  failed = failed + 1
end
print(("%d passed, %d failed"):format(passed, failed))
os.exit(failed == 0 and 0 or 1)
