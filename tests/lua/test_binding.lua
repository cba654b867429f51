-- test_binding.lua — the FFI binding: tensors, dtypes, ledger, arena, and C
-- errors surfacing as Lua errors that name the op and the shapes.
local lz = require("luazero")
local T = {}

local ffi = require("ffi")
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

-- Indices, offsets and dimensions are whole numbers in range: an error
-- naming the method and the range, never a read or write past the buffer.
function T.get_set_and_views_check_index_type_and_range()
  local t = lz.tensor({2, 3})
  for _, i in ipairs({ 6, -1, 1e9, 2 ^ 53 }) do
    local range = ("index %.0f is outside f32[2,3] (0 to 5)"):format(i)
    expect_error(function() return t:get(i) end, "get: " .. range)
    expect_error(function() t:set(i, 7) end, "set: " .. range)
  end
  expect_error(function() return t:get(2.5) end, "get: index 2.5 is not a whole number")
  expect_error(function() return t:get("1") end, "get: index 1 is not a whole number")
  expect_error(function() return t:get(0 / 0) end, "get: index nan is not a whole number")
  expect_error(function() t:set(2.5, 1) end, "set: index 2.5 is not a whole number")
  expect_error(function() t:set(0, "x") end, "set: value x does not fit f32[2,3]; give a number")
  expect_error(function() return lz.tensor({0}):get(0) end, "outside f32[0] (it has no elements)")
  t:set(5, 7)
  assert(t:get(5) == 7 and t:get(ffi.new("int64_t", 5)) == 7)
  local u = lz.tensor({2}, "u16")
  expect_error(function() u:set(0, 65536) end,
               "value 65536 does not fit u16[2]; give a whole number in 0..65535")
  expect_error(function() lz.tensor({1}, "i32"):set(0, 0.5) end,
               "a whole number in -2147483648..2147483647")
  expect_error(function() return t:dim(3) end, "dim: dimension 3 is outside f32[2,3] (1 to 2)")
  expect_error(function() t:view(7, { 1 }) end, "view: offset 7 is outside f32[2,3] (0 to 6)")
  expect_error(function() t:view(-1, { 1 }) end, "view: offset -1 is outside")
  expect_error(function() t:view(1e30, { 1 }) end,
               "view: offset 1000000000000000019884624838656 is outside")
  expect_error(function() t:view(0.5, { 1 }) end, "view: offset 0.5 is not a whole number")
  expect_error(function() t:view(6, { 1 }) end, "tensor_view: elements [6, 7) are outside the base")
  assert(t:view(6, { 0 }):numel() == 0, "an empty view at the end")
  expect_error(function() t:fill("a") end, "fill: value a is not a number")
  expect_error(function() t:copy(3) end, "copy: src is a number, not a tensor")
  expect_error(function() lz.from_table({ 1, "x" }) end, "from_table: value x does not fit f32[2]")
  expect_error(function() lz.from_table(3) end, "from_table: values is a number")
  expect_error(function() lz.arena_over(t, -64, 64) end, "arena_over: byte offset -64 is outside")
  expect_error(function() lz.arena_over(t, 0, 25) end, "arena_over: bytes 25 is outside")
  t:free(); u:free()
end

-- Shapes whose bytes (elements x element size) pass 2^63 are refused in Lua
-- before C, and by C itself when it is called directly.
function T.shape_bytes_overflow_is_an_error_in_lua_and_in_c()
  expect_error(function() lz.tensor({ 1e12, 1e12 }) end,
               "shape {1000000000000, 1000000000000} of f32 is 4e+24 bytes, past the 2^63")
  expect_error(function() lz.tensor({ 2 ^ 40, 2 ^ 22 }, "bf16") end, "past the 2^63")
  expect_error(function() lz.tensor({ 1e30, 0 }) end, "shape entry 1 is 1e+30")
  local a = lz.arena(4096)
  expect_error(function() a:tensor({ 2 ^ 31, 2 ^ 31, 2 ^ 2 }, "u16") end, "past the 2^63")
  a:free()
  local e = lz.tensor({ 2 ^ 40, 2 ^ 40, 0 })
  assert(e:numel() == 0 and e:bytes() == 0, "an empty shape overflows nothing")
  e:free()
  local out, dims = ffi.new("lz_tensor *[1]"), ffi.new("int64_t[4]", { 2 ^ 40, 2 ^ 22 })
  assert(lz.C.lz_tensor_new(out, lz.dtypes.f32, 2, dims, lz.categories.workspace) ~= 0)
  assert(lz.last_error() == "tensor_new: the shape's f32 elements are over 2^63 bytes; " ..
         "check the sizes", lz.last_error())
  local base = lz.tensor({ 4 })
  dims[0] = 4 -- an offset whose end wraps past int64_t
  assert(lz.C.lz_tensor_view(out, base, 0x7ffffffffffffffeLL, 1, dims) ~= 0)
  assert(lz.last_error():find("tensor_view: elements", 1, true), lz.last_error())
  base:free()
end

-- A freed tensor (t:free(), or its arena freed) is refused by every
-- method and op with one line; a second free does nothing.
function T.a_freed_tensor_is_refused_not_read()
  local t = lz.from_table({ 1, 2, 3 })
  local v = t:view(1, { 2 })
  t:free()
  t:free()
  for name, fn in pairs({
    get = function() return t:get(0) end, set = function() t:set(0, 1) end,
    numel = function() return t:numel() end, view = function() return t:view(0, { 1 }) end,
    fill = function() t:fill(1) end, copy = function() t:copy(v) end,
    totable = function() return t:totable() end, sizes = function() return t:sizes() end,
    to = function() return t:to("cpu") end, sq_norm = function() return t:sq_norm() end,
  }) do
    expect_error(fn, name .. " of a freed tensor: it was freed (t:free()); use a live tensor")
  end
  expect_error(function() lz.tensor({ 3 }):copy(t) end, "copy of a freed tensor")
  expect_error(function() lz.ops.scale(t, 2) end,
               "ops.scale: argument 1 (t) is a freed tensor: it was freed (t:free())")
  assert(tostring(t) == "tensor (freed)")
  assert(v:get(1) == 3, "a view keeps the storage")
  v:free()
  local a = lz.arena(4096)
  local x = a:tensor({ 4 })
  a:free()
  expect_error(function() return x:get(0) end, "get of a freed tensor: its arena was freed")
  expect_error(function() a:tensor({ 4 }) end, "this arena was freed")
  expect_error(function() a:reset() end, "this arena was freed")
  x:free()
end

-- lz.ops check each argument against the op's C parameters: the op and the
-- argument by number and name.
function T.op_arguments_are_checked_by_name()
  local x = lz.tensor({ 4 })
  expect_error(function() lz.ops.scale(x, "a") end,
               'ops.scale: argument 2 (s) is a string ("a"); it takes a number')
  expect_error(function() lz.ops.scale(x) end, "ops.scale: argument 2 (s) is missing (nil)")
  expect_error(function() lz.ops.scale(x, 1, 2) end, "ops.scale takes 2 arguments (t, s); got 3")
  expect_error(function() lz.ops.add(x, x, 3) end,
               "ops.add: argument 3 (b) is a number (3); it takes a tensor")
  -- Transpose flags: true or false, or 1 or 0 (nothing that C would round).
  expect_error(function() lz.ops.matmul(x, x, x, 0.5, 0, 1, 0) end,
               "ops.matmul: argument 4 (trans_a) is a number (0.5); it takes true or false (or 1 or 0)")
  expect_error(function() lz.ops.matmul(x, x, x, 0, 2, 1, 0) end,
               "ops.matmul: argument 5 (trans_b) is a number (2); it takes true or false")
  local a, c = lz.from_table({ 1, 2, 3, 4 }, { 2, 2 }), lz.tensor({ 2, 2 })
  lz.ops.matmul(c, a, a, true, false, 1, 0) -- a^T a: [[10, 14], [14, 20]]
  assert(c:get(0) == 10 and c:get(1) == 14 and c:get(3) == 20, tostring(c))
  lz.ops.matmul(c, a, a, 0, 1, 1, 0) -- a a^T: [[5, 11], [11, 25]]
  assert(c:get(0) == 5 and c:get(1) == 11 and c:get(3) == 25, tostring(c))
  expect_error(function() lz.ops.conv2d(x) end,
               "lz.ops.conv2d: there is no such op; the ops are matmul, ")
  expect_error(function() lz.ops.adamw_step(x, x, x, x, nil, {}) end,
               "ops.adamw_step: argument 6 (args) is a table")
  expect_error(function() lz.ops.add(x, x, nil) end, "add: b is missing (NULL)")
  lz.ops.scale(x:fill(2), ffi.new("int64_t", 3))
  assert(x:get(3) == 6)
  x:free()
end

-- Arena sizes are checked as shapes are: whole numbers from 0 to below 2^63.
function T.arena_sizes_are_whole_numbers_below_2_63()
  expect_error(function() lz.arena("1k") end, 'arena: bytes is "1k"; give a whole number')
  expect_error(function() lz.arena(-5) end, "arena: bytes is -5; give a whole number")
  expect_error(function() lz.arena(10.5) end, "arena: bytes is 10.5; give a whole number")
  expect_error(function() lz.arena(2 ^ 63) end, "arena: bytes is 9223372036854775808")
  expect_error(function() lz.arena_bytes(-1, "f32") end, "arena_bytes: numel is -1")
  expect_error(function() lz.arena_bytes(2 ^ 62, "f32") end, "arena_bytes: the bytes is")
  assert(lz.arena_bytes(3) == lz.ARENA_ALIGN and lz.arena_bytes(0) == 0)
  local a = lz.arena(1024)
  assert(a:capacity() == 1024)
  a:free()
end

-- An arena over a tensor's memory is refused once that tensor is freed,
-- and so are the tensors it gave out, before or after the free.
function T.arena_over_a_freed_tensor_is_refused()
  local t = lz.tensor({ 1024 })
  local a = lz.arena_over(t, 0, 1024)
  local before = a:tensor({ 4 })
  t:free()
  expect_error(function() a:tensor({ 4 }) end, "the tensor this arena lies over (lz.arena_over) was freed")
  expect_error(function() before:fill(1) end,
               "fill of a freed tensor: the tensor its arena lies over (lz.arena_over) was freed")
  expect_error(function() return before:get(0) end, "of a freed tensor")
  expect_error(function() lz.ops.add(before, before, before) end, "freed")
  assert(tostring(before) == "tensor (freed)")
end

return T
