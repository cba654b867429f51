-- test_binding.lua — the FFI binding: tensors, dtypes, ledger, arena, and C
-- errors surfacing as Lua errors that name the op and the shapes.
local lz = require("luazero")
local T = {}

local support = dofile(lz.root .. "/tests/lua/support.lua")
local expect_error = support.expect_error

function T.tensor_shape_dtype_and_printing()
  local t = lz.tensor({2, 3}, "f32")
  assert(t.ndim == 2 and t:dim(1) == 2 and t:dim(2) == 3)
  assert(t:numel() == 6 and t:bytes() == 24 and t:dtype_name() == "f32")
  t:set(4, 1.5)
  assert(t:get(4) == 1.5 and t:get(0) == 0)
  assert(tostring(t) == "tensor f32[2,3] [0, 0, 0, 0, 1.5, 0]", tostring(t))
  local h = lz.tensor({4}, "bf16")
  h:set(0, 1.00390625) -- a tie between two bf16 values: rounds to even (1.0)
  assert(h:get(0) == 1.0, h:get(0))
  t:free()
end

function T.views_share_storage()
  local t = lz.from_table({1, 2, 3, 4, 5, 6}, {2, 3})
  local v = t:view(3, {3})
  assert(v:get(0) == 4)
  v:set(2, 60)
  assert(t:get(5) == 60)
  expect_error(function() t:view(4, {3}) end, "outside the base")
end

function T.copy_converts_dtypes()
  local a = lz.from_table({0.1, -2, 3.5, 65504})
  local h = lz.tensor({4}, "f16"):copy(a)
  local b = lz.tensor({4}, "f32"):copy(h)
  assert(b:get(3) == 65504 and b:get(1) == -2 and math.abs(b:get(0) - 0.1) < 1e-4)
  expect_error(function() lz.tensor({5}):copy(a) end, "tensor_copy")
end

function T.ledger_counts_categories()
  support.settle()
  lz.mem_reset_peak()
  local before = lz.mem()
  local g = lz.tensor({1000}, "f32", "grads")
  local o = lz.tensor({3, 1024, 1024}, "f32", "optimizer") -- 12 MiB: huge pages
  local now = lz.mem()
  assert(now.grads - before.grads == 4000)
  assert(now.optimizer - before.optimizer == 12 * 2 ^ 20)
  o:free()
  assert(lz.mem().optimizer == before.optimizer)
  assert(lz.mem_peak().optimizer - before.optimizer == 12 * 2 ^ 20)
  g:free()
  expect_error(function() lz.tensor({2}, "f32", "nonsense") end, "unknown memory category")
end

function T.arena_tensors_and_reset()
  local a = lz.arena(4096)
  local x = a:tensor({4, 4})
  assert(x:numel() == 16 and a:used() == 64)
  a:tensor({100})
  assert(a:used() == 64 + 448)
  expect_error(function() a:tensor({2000}) end, "make the arena larger")
  a:reset()
  assert(a:used() == 0 and a:peak() == 512)
  a:free()
end

function T.op_errors_name_op_and_shapes()
  local x, w, y = lz.tensor({4, 8}), lz.tensor({5, 7}), lz.tensor({4, 5})
  expect_error(function() lz.ops.linear_forward(y, x, w, nil) end,
               "linear_forward: x is f32[4,8] but w is f32[5,7]")
  local xi = lz.tensor({4, 8}, "i32")
  expect_error(function() lz.ops.matmul(y, xi, lz.tensor({8, 5}), 0, 0, 1, 0) end,
               "matmul: a is i32[4,8]")
  expect_error(function() lz.tensor({1, 2, 3, 4, 5}) end, "up to 4 sizes")
  expect_error(function() lz.tensor({2}, "f64") end, "unknown dtype 'f64'")
end

function T.matmul_from_lua()
  local a = lz.from_table({1, 2, 3, 4, 5, 6}, {2, 3})
  local b = lz.from_table({1, 0, 0, 1, 1, 1}, {3, 2})
  local c = lz.tensor({2, 2})
  lz.ops.matmul(c, a, b, 0, 0, 1, 0)
  local r = c:totable()
  assert(r[1] == 4 and r[2] == 5 and r[3] == 10 and r[4] == 11, table.concat(r, ","))
end

return T
