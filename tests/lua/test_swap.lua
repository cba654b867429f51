-- test_swap.lua — the swap-file binding (lz.swap): round trips of tensors
-- and raw pointers, requests in flight, stats, and errors naming the key,
-- the file or the directory.
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local T = {}

local expect_error = support.expect_error

local function random_fill(t, seed)
  local p = lz.ffi.cast("uint32_t *", t.data)
  local x = seed
  for i = 0, t:bytes() / 4 - 1 do
    x = (x * 1103515245 + 12345) % 2147483648
    p[i] = x
  end
end

local function same(a, b)
  return a:bytes() == b:bytes() and lz.xxh64(a.data, a:bytes()) == lz.xxh64(b.data, b:bytes())
end

function T.round_trip_tensors_async_and_blocking()
  local _, dir = support.scratch()
  local s = lz.swap(dir, 3 * 2 ^ 20, "optimizer",
                    { block_size = 65536, queue_depth = 4, thread_count = 2,
                      single_submit = true, overlap_events = false })
  assert(s.path:find(dir .. "/luazero-swap-", 1, true) == 1, s.path)
  assert(s.path:sub(-10) == "-optimizer", s.path)
  -- 1 MiB + 12 KiB and 4 KiB: not multiples of the 64 KiB block, small ones
  -- page-aligned because they are offload tensors.
  local a = lz.tensor({ 262144 + 3072 }, "f32", "offload")
  local b = lz.tensor({ 1024 }, "f32", "offload")
  random_fill(a, 7)
  random_fill(b, 11)
  local ra = s:write(0, a, nil, true)
  local rb = s:write(2 * 2 ^ 20, b, nil, true)
  rb:wait()
  ra:wait()
  local a2 = lz.tensor({ 262144 + 3072 }, "f32", "offload")
  local b2 = lz.tensor({ 1024 }, "f32", "offload")
  local r = s:read(2 * 2 ^ 20, b2, nil, true)
  s:read(0, a2)
  r:wait()
  assert(same(a, a2) and same(b, b2))
  local st = s:stats()
  assert(st.size == 3 * 2 ^ 20 and st.bytes_written == a:bytes() + b:bytes(), st.bytes_written)
  assert(st.bytes_read == st.bytes_written and type(st.direct) == "boolean")
  expect_error(function() r:wait() end, "already waited on")
  s:close()
  s:close() -- twice is fine
  expect_error(function() s:read(0, a) end, "is closed")
  a:free(); b:free(); a2:free(); b2:free()
  os.remove(dir)
end

function T.raw_pointers_and_default_options()
  local _, dir = support.scratch()
  local s = lz.swap(dir, 8192)
  assert(not s.path:find("-optimizer", 1, true))
  local buf = lz.tensor({ 4096 }, "u16", "offload")
  buf:zero()
  lz.ffi.cast("uint16_t *", buf.data)[100] = 4242
  s:write(4096, buf.data, 4096)
  local back = lz.tensor({ 2048 }, "u16", "offload")
  s:read(4096, back.data, 4096, false)
  assert(back:get(100) == 4242)
  expect_error(function() s:read(0, back.data) end, "give the byte count")
  -- Close with a request nobody waited on: it completes, its handle ends.
  local r = s:write(0, buf.data, 8192, true)
  s:close()
  assert(r:done())
  expect_error(function() r:wait() end, "its swap file closed")
  buf:free(); back:free()
  os.remove(dir)
end

function T.errors_name_key_file_and_directory()
  local _, dir = support.scratch()
  expect_error(function() lz.swap(dir, 4096, nil, { block_size = 1000 }) end,
               "swap: aio.block_size 1000 is not a multiple of 4096")
  expect_error(function() lz.swap(dir, 4096, nil, { queue_depth = 0 }) end,
               "aio.queue_depth 0 must be 1..1024")
  expect_error(function() lz.swap(dir, 4096, nil, { overlap_events = "yes" }) end,
               "aio.overlap_events is yes; it must be true or false")
  expect_error(function() lz.swap(dir, 4096, nil, { thread_count = 1.5 }) end,
               "aio.thread_count is 1.5; it must be a whole number")
  expect_error(function() lz.swap(dir, 4096, nil, { blocksize = 4096 }) end,
               "unknown aio key 'blocksize'")
  expect_error(function() lz.swap(dir .. "/missing", 4096) end,
               "directory " .. dir .. "/missing does not exist (create it")
  local s = lz.swap(dir, 65536, "params")
  local t = lz.tensor({ 1024 }, "f32", "offload")
  expect_error(function() s:write(100, t) end, s.path .. ": offset 100 is not a multiple of 4096")
  expect_error(function() s:read(61440, t, 8192) end, "go past the end of the 65536-byte swap file")
  s:close()
  t:free()
  os.remove(dir)
end

return T
