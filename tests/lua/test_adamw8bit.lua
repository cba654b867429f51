-- test_adamw8bit.lua — 8-bit AdamW (optimizer.type AdamW8bit) in the
-- engine: its steps are a plain loop of lz_adamw8bit_step over each tensor
-- whole (u8 states with one absmax per 256 elements from the tensor's
-- start, f32 ones under min_8bit_size), bit for bit; stages 0-3 and the
-- NVMe tier end alike; a checkpoint resumes exactly at another stage; a
-- resume into other formats is refused until tools/ckpt convert-states
-- converts them.
local ffi = require("ffi")
local lz = require("luazero")
local optim = require("luazero.optim")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local T = {}

local expect_error = support.expect_error
local _, tmp = support.scratch()

local function model()
  local gpt2 = require("models.gpt2")
  -- n_embd 24: tensors of 24, 72, 576 and 1728 elements; a min_8bit_size
  -- of 500 leaves the vectors in f32 and gives most matrices a partial
  -- last block.
  return gpt2.new(gpt2.config("gpt2-nano", { n_layer = 1, n_embd = 24, n_head = 2, context = 16 }))
end

local PARAMS = { lr = 3e-3, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1,
                 min_8bit_size = 500 }

local function engine(zo, opt)
  local zero = require("luazero.zero")
  local cfg = { train_micro_batch_size_per_gpu = 2, zero_optimization = zo,
                optimizer = opt or { type = "AdamW8bit", params = PARAMS } }
  return zero.initialize{ model = model(), config = cfg, seed = 3, batch = { 2, 8 } }
end

local x = lz.tensor({ 2, 8 }, "i32", "activations")
local y = lz.tensor({ 2, 8 }, "i32", "activations")
for i = 0, 15 do x:set(i, (i * 7) % 50); y:set(i, (i * 11) % 50) end

local function train(e, steps)
  for _ = 1, steps do e:backward(e:forward(x, y)); e:step() end
  return e:params_checksum()
end

local function bits_equal(a, b, n)
  return ffi.C.memcmp(a.data, b.data, n * 4) == 0
end
pcall(ffi.cdef, "int memcmp(const void *, const void *, size_t);")

function T.config_spelling_is_bitsandbytes()
  local config = require("luazero.config")
  local function load(type_name, params)
    return config.load({ train_micro_batch_size_per_gpu = 2,
                         optimizer = { type = type_name, params = params } }, 1)
  end
  local a = optim.new(load("adamw8bit", {}).optimizer)
  assert(a.type == "AdamW8bit" and a.weight_decay == 1e-2 and a.min_8bit_size == 4096)
  assert(a.state_formats.m == "u8" and a.state_formats.v == "u8" and a.block_min_numel == 4096)
  local b = optim.new(load("Adam8bit", { lr = 1e-4 }).optimizer)
  assert(b.type == "Adam8bit" and b.weight_decay == 0 and b.lr == 1e-4)
  local c = load("AdamW8bit", { min_8bit_size = 0, block_wise = true, percentile_clipping = 100 })
  assert(optim.new(c.optimizer).block_min_numel == 0 and #c.unimplemented == 0)
  local d = load("AdamW8bit", { percentile_clipping = 5, is_paged = true })
  assert(table.concat(d.unimplemented, ",") ==
         "optimizer.params.is_paged,optimizer.params.percentile_clipping",
         table.concat(d.unimplemented, ","))
  expect_error(function() load("AdamW8bit", { min_8bit_size = 1.5 }) end,
               "optimizer.params.min_8bit_size must be a whole number")
end

-- Stage 0, one rank: the engine's master and gradients of each tensor are
-- views of its flat buffers; a loop of lz_adamw8bit_step over copies of
-- each tensor whole, with states of its own, gives the same bits.
function T.engine_steps_are_a_loop_over_whole_tensors()
  local e = engine({ stage = 0 })
  local L = e.L
  local direct = {}
  local n8, n32 = 0, 0
  for _, seg in ipairs(L.segments) do
    for _, se in ipairs(seg.entries) do
      assert(se.seg_offset % 256 == 0, "a tensor starts on a block")
      local n = se.numel
      local d = { off = seg.full_offset + se.seg_offset, n = n, decay = se.decay,
                  p = lz.tensor({ n }, "f32"):copy(e.master:view(seg.full_offset + se.seg_offset, { n })),
                  g = lz.tensor({ n }, "f32") }
      if n >= PARAMS.min_8bit_size then
        local nb = tonumber(lz.C.lz_adamw8bit_blocks(n))
        d.m, d.v = lz.tensor({ n }, "u8"):zero(), lz.tensor({ n }, "u8"):zero()
        d.am, d.av = lz.tensor({ nb }, "f32"):zero(), lz.tensor({ nb }, "f32"):zero()
        n8 = n8 + 1
      else
        d.m, d.v = lz.tensor({ n }, "f32"):zero(), lz.tensor({ n }, "f32"):zero()
        n32 = n32 + 1
      end
      direct[#direct + 1] = d
    end
  end
  assert(n8 >= 3 and n32 >= 3, ("%d 8-bit tensors, %d f32"):format(n8, n32))
  local a = lz.adamw_args({})
  for t = 1, 3 do
    e:backward(e:forward(x, y))
    for _, d in ipairs(direct) do d.g:copy(e.grads:view(d.off, { d.n })) end
    e:step()
    a.lr, a.beta1, a.beta2, a.eps, a.grad_scale, a.step =
      PARAMS.lr, PARAMS.betas[1], PARAMS.betas[2], PARAMS.eps, 1, t
    for _, d in ipairs(direct) do
      a.weight_decay = d.decay and PARAMS.weight_decay or 0
      lz.ops.adamw8bit_step(d.p, d.g, d.m, d.v, d.am, d.av, nil, a)
      assert(bits_equal(d.p, e.master:view(d.off, { d.n }), d.n),
             ("step %d: the tensor at %d differs from the direct loop's"):format(t, d.off))
    end
  end
  e:free()
end

-- Stages 0-3 and the NVMe tier (whose region holds 1 byte an element for
-- m and v plus their absmaxes) end with one checksum; a checkpoint saved
-- at stage 3 resumes exactly at stage 1 and on the NVMe tier.
function T.stages_tiers_and_resume_end_alike()
  local sum = train(engine({ stage = 0 }), 4)
  for st = 1, 2 do assert(train(engine({ stage = st }), 4) == sum, "stage " .. st) end
  local cpu = engine({ stage = 2, offload_optimizer = { device = "cpu" } })
  assert(train(cpu, 4) == sum, "the cpu tier")
  cpu:free()
  local nv = engine({ stage = 3, sub_group_size = 8192,
                      offload_optimizer = { device = "nvme", nvme_path = tmp } })
  -- (m and v of 1 byte, each beside a page of absmaxes; the master is the
  -- working copy here)
  local st = nv.states
  assert(st.G == 8192 and not st.has_master and st.region == 2 * (8192 + 4096), st.region)
  assert(train(nv, 4) == sum, "the nvme tier")
  nv:free()
  local dir = tmp .. "/a8"
  local e3 = engine({ stage = 3 })
  train(e3, 2)
  e3:save(dir, {})
  assert(train(e3, 2) == sum)
  e3:free()
  for _, zo in ipairs({ { stage = 1 }, { stage = 3, offload_optimizer = { device = "nvme",
                                                                           nvme_path = tmp } } }) do
    local r = engine(zo)
    r:load(dir .. "/step-000002")
    assert(train(r, 2) == sum, "resumed at stage " .. zo.stage)
    r:free()
  end
end

-- lz_adamw8bit_requantize gives a dequantisation's values back bit for
-- bit, blocks whose largest magnitude is negative (the signed map has no
-- -1.0), denormal and zero blocks included. (The update stores its largest
-- magnitude of a block as the map's largest entry of its sign: each block
-- here holds one.)
function T.requantize_inverts_dequantize()
  local n = 256 * 6 + 37
  local q, back = lz.tensor({ n }, "u8"), lz.tensor({ n }, "u8")
  local am, am2 = lz.tensor({ 7 }, "f32"), lz.tensor({ 7 }, "f32")
  local d, d2 = lz.tensor({ n }, "f32"), lz.tensor({ n }, "f32")
  for signed = 0, 1 do
    for i = 0, n - 1 do q:set(i, (i * 37 + 11) % 256) end
    for b = 0, 6 do am:set(b, ({ 0.37, 1e-30, 3e5, 0, 2.5e-3, 1, 7.75 })[b + 1]) end
    -- block 4 with no +1.0 entry, so its largest magnitude is map[0]'s
    for i = 256 * 4, 256 * 5 - 1 do q:set(i, i % 255) end
    for i = 256 * 3, 256 * 4 - 1 do q:set(i, 0) end
    q:set(n - 1, 255)
    lz.check(lz.C.lz_adamw8bit_dequantize(q, am, signed, d))
    lz.check(lz.C.lz_adamw8bit_requantize(d, signed, back, am2))
    lz.check(lz.C.lz_adamw8bit_dequantize(back, am2, signed, d2))
    assert(bits_equal(d, d2, n), "signed " .. signed .. ": values differ after requantising")
  end
end

return T
