-- test_optim.lua — the optimizer interface: optim.new picks the class a
-- config names, and update() runs its kernel over a call's views with the
-- call's decay setting.
local lz = require("luazero")
local optim = require("luazero.optim")
local T = {}

local expect_error = dofile(lz.root .. "/tests/lua/support.lua").expect_error

function T.new_picks_the_class_by_type()
  assert(getmetatable(optim.new({ type = "Adam" })) == optim.AdamW)
  assert(getmetatable(optim.new({ type = "adamw" })) == optim.AdamW)
  local l = optim.new({ type = "LION", params = { lr = 3e-5, betas = { 0.95, 0.98 } } })
  assert(getmetatable(l) == optim.Lion)
  assert(l.lr == 3e-5 and l.beta1 == 0.95 and l.beta2 == 0.98 and l.weight_decay == 0)
  expect_error(function() optim.new({ type = "Lamb" }) end,
               "config: optimizer.type must be Adam, AdamW or Lion (got Lamb)")
  expect_error(function() optim.new({ type = 42 }) end, "(got 42)")
  -- A block without a type (a partial table from Lua) is the engine's AdamW.
  assert(getmetatable(optim.new({})) == optim.AdamW and getmetatable(optim.new()) == optim.AdamW)
end

function T.defaults_are_deepspeeds()
  local a = optim.AdamW.new({})
  assert(a.lr == 1e-3 and a.beta1 == 0.9 and a.beta2 == 0.999 and a.eps == 1e-8)
  assert(a.weight_decay == 0)
  local l = optim.Lion.new()
  assert(l.lr == 1e-3 and l.beta1 == 0.9 and l.beta2 == 0.999 and l.weight_decay == 0)
  assert(#optim.AdamW.states == 2 and optim.Lion.states[1] == "m" and #optim.Lion.states == 1)
end

-- Two calls over one flat buffer, the first with decay, the second without;
-- values exact in fp32 (b1 1/2, b2 3/4, lr 1/4, wd 1/2, grad_scale 2).
function T.lion_update_runs_each_call_with_its_decay()
  local p = lz.from_table({ 1, -2, 1, -2 })
  local g = lz.from_table({ 0.5, -1, 0.5, -1 })
  local m = lz.tensor({ 4 }, "f32")
  local w = lz.tensor({ 4 }, "bf16")
  local opt = optim.new({ type = "Lion", params = { betas = { 0.5, 0.75 }, weight_decay = 0.5 } })
  local function call(off, decay)
    return { p = p:view(off, { 2 }), g = g:view(off, { 2 }), s = { m:view(off, { 2 }) },
             w = w:view(off, { 2 }), decay = decay }
  end
  opt:update(call(0, true), 1, 0.25, 2)
  opt:update(call(2, false), 1, 0.25, 2)
  -- c = g/2 = 0.5, -1: p = p * 7/8 -+ 1/4 with decay, p -+ 1/4 without.
  local want_p, want_m = { 0.625, -1.5, 0.75, -1.75 }, { 0.25, -0.5, 0.25, -0.5 }
  for i = 0, 3 do
    assert(p:get(i) == want_p[i + 1], ("p[%d] = %g, expected %g"):format(i, p:get(i), want_p[i + 1]))
    assert(m:get(i) == want_m[i + 1], ("m[%d] = %g"):format(i, m:get(i)))
    assert(w:get(i) == want_p[i + 1], ("working[%d] = %g"):format(i, w:get(i)))
  end
  expect_error(function() opt:update(call(0, true), 2, -1, 1) end, "lion_step: args->lr is -1")
  for _, t in ipairs({ p, g, m, w }) do t:free() end
end

-- AdamW's first step is lr * g / (|g| + eps): nearly lr * sign(g).
function T.adamw_update_first_step()
  local p = lz.from_table({ 1, 1 })
  local g = lz.from_table({ 0.5, -4 })
  local m, v = lz.tensor({ 2 }, "f32"), lz.tensor({ 2 }, "f32")
  local opt = optim.new({ type = "AdamW", params = { weight_decay = 0.5 } })
  opt:update({ p = p, g = g, s = { m, v }, decay = false }, 1, 0.125, 1)
  assert(math.abs(p:get(0) - 0.875) < 1e-6 and math.abs(p:get(1) - 1.125) < 1e-6,
         ("p = %g, %g"):format(p:get(0), p:get(1)))
  -- m = (1 - b1) g, v = (1 - b2) g^2 with b1, b2 rounded to fp32.
  assert(math.abs(m:get(0) - 0.05) < 1e-7 and math.abs(v:get(1) - 0.016) < 1e-6)
  opt:update({ p = p, g = g, s = { m, v }, decay = true }, 2, 0.125, 1)
  -- Decay 1 - 0.125 * 0.5 before the step.
  assert(p:get(0) < 0.875 * (1 - 0.0625) - 0.1, p:get(0))
  for _, t in ipairs({ p, g, m, v }) do t:free() end
end

return T
