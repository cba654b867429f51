-- test_sim.lua — the Lua face of the sim device: device tensors that the
-- host cannot read (an error from :get, a fault from a raw FFI read), round
-- trips, arenas, copies with their byte counters, streams and events, and
-- the device side of the ledger. Sim stays initialized in this process.
local lz = require("luazero")
local ffi = require("ffi")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local q = support.quote

local T = {}

local function up()
  if lz.cuda.ready() then return false end -- one accelerator per process
  lz.device_init("sim")
  assert(lz.sim.ready())
  return true
end

function T.device_init_names_the_device()
  support.expect_error(function() lz.device_init("tpu") end,
                       'device_init: device "tpu" is not "cpu", "sim" or "cuda"')
  lz.device_init("cpu") -- nothing to do
  if not up() then return end
  lz.device_init("sim") -- again: no-op
  support.expect_error(function() lz.device_init("cuda") end,
                       "this process already uses sim; one accelerator per process")
end

function T.get_of_a_sim_tensor_raises()
  if not up() then return end
  local t = lz.tensor({ 4 }, "f32", "activations", "sim")
  assert(t:device_name() == "sim")
  support.expect_error(function() return t:get(0) end,
    'luazero: get of a sim tensor f32[4]: device memory is not readable from the host; ' ..
    'copy it first (t:to("cpu"))')
  support.expect_error(function() t:set(0, 1) end, "set of a sim tensor f32[4]: device memory " ..
                       "is not writable from the host")
  support.expect_error(function() return t:totable() end, "totable of a sim tensor f32[4]")
  assert(tostring(t) == "tensor f32[4] on sim", tostring(t))
  t:free()
end

-- A raw read of device memory through the FFI kills the process: a child
-- luazero that reads t.data must die of a signal (SIGSEGV: status 139),
-- and one that reads host memory the same way must not.
function T.ffi_read_of_device_memory_faults_in_a_child()
  local function child(device)
    local code = ([[local lz = require("luazero"); lz.device_init(%q)
local t = lz.tensor({4}, "f32", "params", %q)
print(require("ffi").cast("float *", t.data)[0])]]):format(device, device)
    return support.sh(q(lz.executable()) .. " -e " .. q(code))
  end
  local out, status = child("cpu")
  assert(status == 0, "a host read must work:\n" .. out)
  out, status = child("sim")
  assert(status == 128 + 11, "exit status " .. tostring(status) .. ", expected 139 (SIGSEGV):\n" .. out)
end

function T.round_trip_is_bitwise_for_every_dtype()
  if not up() then return end
  for _, dt in ipairs({ "f32", "bf16", "f16", "i32" }) do
    local h = lz.tensor({ 3, 5 }, dt)
    for i = 0, 14 do h:set(i, dt == "i32" and (i * 7919 - 50000) or (i - 7) * 0.37) end
    local d = h:to("sim")
    assert(d:device_name() == "sim" and d:dtype_name() == dt)
    local back = d:to("cpu")
    assert(back:device_name() == "cpu")
    assert(ffi.string(h.data, h:bytes()) == ffi.string(back.data, back:bytes()),
           dt .. ": the bytes changed on the way")
    assert(back:get(14) == h:get(14) and h:get(14) ~= 0)
    local z = lz.tensor({ 3, 5 }, dt, "workspace", "sim") -- zero-filled on the device
    z:copy(d)
    z:zero()
    assert(z:to("cpu"):get(7) == 0)
    h:free(); d:free(); back:free(); z:free()
  end
end

function T.kernels_run_on_sim_tensors()
  if not up() then return end
  local h = lz.from_table({ 1, -2, 3, -4 })
  local d = h:to("sim")
  d:fill(2.5)
  lz.ops.scale(d, 2)
  assert(d:sq_norm() == 4 * 25)
  local back = d:to("cpu")
  assert(back:get(3) == 5)
end

function T.arena_on_sim()
  if not up() then return end
  support.settle()
  local before = lz.mem_device().activations
  local a = lz.arena(4096, "activations", "sim")
  assert(lz.mem_device().activations == before + 4096)
  local t = a:tensor({ 8 }, "f32")
  assert(t:device_name() == "sim")
  t:fill(1)
  assert(t:to("cpu"):get(7) == 1)
  -- arena_over a device tensor: its tensors live there too
  local buf = lz.tensor({ 256 }, "f32", "workspace", "sim")
  local over = lz.arena_over(buf, 64, 512)
  local v = over:tensor({ 4 }, "f32")
  assert(v:device_name() == "sim")
  over:free(); buf:free()
  a:free()
  assert(lz.mem_device().activations == before)
end

function T.copy_bytes_count_both_directions()
  if not up() then return end
  local h = lz.tensor({ 100 }, "f32")
  lz.copy_bytes_reset()
  local d = h:to("sim")
  local c = lz.copy_bytes()
  assert(c.h2d == 400 and c.d2h == 0, ("h2d %d d2h %d"):format(c.h2d, c.d2h))
  d:to("cpu")
  c = lz.copy_bytes()
  assert(c.h2d == 400 and c.d2h == 400, ("h2d %d d2h %d"):format(c.h2d, c.d2h))
  lz.copy_bytes_reset()
  c = lz.copy_bytes()
  assert(c.h2d == 0 and c.d2h == 0)
end

function T.mem_device_shows_the_bytes()
  if not up() then return end
  support.settle()
  local before = lz.mem_device().params
  local t = lz.tensor({ 1000 }, "bf16", "params", "sim")
  assert(lz.mem_device().params == before + 2000)
  assert(lz.mem_device_peak().params >= before + 2000)
  assert(lz.mem().params >= 0)
  t:free()
  assert(lz.mem_device().params == before)
end

function T.async_copies_streams_and_events()
  if not up() then return end
  local n = 4096
  local src = lz.pinned({ n }, "f32")
  for i = 0, n - 1 do src:set(i, i) end
  local d = lz.tensor({ n }, "f32", "workspace", "sim")
  local out = lz.pinned({ n }, "f32")
  local e = lz.event()
  lz.copy_async(d, src, "copy")
  e:record("copy")
  e:wait_on("compute")
  lz.ops.scale(d, 3)
  lz.copy_async(out, d, "compute")
  e:synchronize()
  assert(e:query())
  lz.stream_synchronize("compute")
  for i = 0, n - 1, 511 do assert(out:get(i) == 3 * i, i) end
  lz.device_synchronize()
  support.expect_error(function() lz.copy_async(d, src, "dma") end,
                       'stream "dma" is not "compute", "comm" or "copy"')
  e:free()
  support.expect_error(function() e:record("copy") end, "this event was freed")
end

function T.pinned_is_host_memory_on_the_ledger()
  if not up() then return end
  support.settle()
  local before = lz.mem().offload
  local p = lz.pinned({ 1024 }, "f32")
  assert(p:device_name() == "cpu")
  p:set(5, 2)
  assert(p:get(5) == 2 and p:get(6) == 0)
  assert(lz.mem().offload == before + 4096)
  p:free()
  assert(lz.mem().offload == before)
end

return T
