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

local train, x, y = support.engine_batch()

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
  -- The REPL's norms show the 8-bit states by the values they stand for.
  local text = tostring(require("luazero.ui.inspect").norms(e))
  assert(text:find("AdamW8bit m (values) u8", 1, true), text)
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

-- Over bf16 master weights (bf16_stochastic_round): each chunk widened,
-- stepped with its blocks' absmaxes, rounded back; stages 0 and 3 end alike,
-- and the master moves (the 8-bit states drive it).
function T.bf16_master_weights_end_alike_at_stages_0_and_3()
  local zero = require("luazero.zero")
  local function run(stage)
    local p = {}
    for k, v in pairs(PARAMS) do p[k] = v end
    p.bf16_stochastic_round = true
    local cfg = require("luazero.config").load({ train_micro_batch_size_per_gpu = 2,
      bf16 = { enabled = true }, zero_optimization = { stage = stage },
      optimizer = { type = "AdamW8bit", params = p } }, 1)
    local e = zero.initialize{ model = model(), seed = 3, batch = { 2, 8 }, config = cfg }
    assert(e.P.master.dtype == "bf16")
    local before = e:params_checksum()
    local after = train(e, 3)
    e:free()
    return before, after
  end
  local b0, a0 = run(0)
  local _, a3 = run(3)
  assert(a0 ~= b0 and a0 == a3, ("%s -> %s, stage 3 %s"):format(b0, a0, a3))
end

-- A resume into another optimizer or other formats is refused, naming
-- tools/ckpt convert-states; u8 -> f32 names AdamW (which resumes it),
-- f32 -> u8 names AdamW8bit again, and since a checkpoint holds the values
-- the 8-bit states stand for, that round trip resumes bit for bit as the
-- run that was never converted. An AdamW checkpoint converts to u8 too.
function T.convert_states_to_and_from_u8()
  local convert = require("luazero.checkpoint.convert")
  local cjson = require("cjson")
  local function manifest(d)
    local f = assert(io.open(d .. "/manifest.json", "rb"))
    local m = cjson.decode(f:read("*a"))
    f:close()
    return m
  end
  local sum = train(engine({ stage = 0 }), 4)
  local dir = tmp .. "/conv"
  local e = engine({ stage = 2 })
  -- (the start-up line and a checkpoint's summary say the states' formats)
  assert(e:describe():find("AdamW8bit (m, v in u8),", 1, true), e:describe())
  train(e, 2)
  e:save(dir, {})
  e:free()
  local step = dir .. "/step-000002"
  local summary = require("luazero.checkpoint").open(step):summary()
  support.eq(summary.states_text, "master, m (u8), v (u8)", "the saved states in words")
  local adamw = { type = "AdamW", params = { lr = 3e-3, weight_decay = 0.1 } }
  local f32 = engine({ stage = 1 }, adamw)
  expect_error(function() f32:load(step) end,
               "was saved by the optimizer AdamW8bit; this run's is AdamW: resume with the " ..
               "optimizer that saved it (optimizer.type \"AdamW8bit\"), or convert its states " ..
               "first (tools/ckpt convert-states " .. step .. " OUT --to f32)")
  local said = convert.states(step, tmp .. "/c32/step-000002", "f32")
  assert(said:find("the optimizer states (m u8, v u8) now in f32; the optimizer now AdamW", 1, true),
         said)
  local rec = manifest(tmp .. "/c32/step-000002").optimizer
  assert(rec.type == "AdamW" and rec.state_formats.m == "f32" and rec.params.min_8bit_size == nil
         and rec.params.weight_decay == 0.1, cjson.encode(rec))
  f32:load(tmp .. "/c32/step-000002")
  train(f32, 1)
  f32:free()
  local e8 = engine({ stage = 3 })
  expect_error(function() e8:load(tmp .. "/c32/step-000002") end,
               "was saved by the optimizer AdamW; this run's is AdamW8bit")
  e8:free()
  -- Back to u8 on the command line: AdamW8bit with its default min_8bit_size.
  local q = support.quote
  local out, st = support.sh(("cd %s && LUAZERO=%s tools/ckpt convert-states %s %s --to u8")
    :format(q(lz.root), q(lz.executable()), q(tmp .. "/c32/step-000002"),
            q(tmp .. "/c8/step-000002")))
  assert(st == 0 and out:find("now in u8; the optimizer now AdamW8bit (resume with " ..
                              "optimizer.type \"AdamW8bit\")", 1, true), out)
  support.eq(require("luazero.checkpoint").open(tmp .. "/c32/step-000002"):summary().states_text,
             "master, m, v", "f32 states in words")
  rec = manifest(tmp .. "/c8/step-000002").optimizer
  assert(rec.type == "AdamW8bit" and rec.params.min_8bit_size == 4096 and
         rec.converted_from == "f32", cjson.encode(rec))
  local back = engine({ stage = 1 })
  back:load(tmp .. "/c8/step-000002")
  assert(train(back, 2) == sum, "u8 -> f32 -> u8 resumes as the run that was not converted")
  back:free()
  -- An AdamW run's checkpoint in u8: AdamW8bit loads and trains it.
  local a = engine({ stage = 0 }, adamw)
  train(a, 1)
  a:save(tmp .. "/aw", {})
  a:free()
  convert.states(tmp .. "/aw/step-000001", tmp .. "/aw8/step-000001", "u8")
  local r = engine({ stage = 2 })
  r:load(tmp .. "/aw8/step-000001")
  local loss = r:forward(x, y)
  assert(loss == loss, "the converted run trains")
  r:backward(loss); r:step()
  r:free()
end

-- convert-states never writes over a folder that exists (another step of
-- the run, another run's checkpoint); refuses a copy no run could resume
-- (Lion keeps its state in f32 only and has no bf16 master); and
-- Adam8bit, AdamW8bit's update under another default, resumes an
-- AdamW8bit checkpoint (what an Adam8bit run's u8 -> f32 -> u8 round trip
-- records) and AdamW8bit an Adam8bit one.
function T.convert_states_refuses_what_no_run_resumes()
  local convert = require("luazero.checkpoint.convert")
  local e = engine({ stage = 0 }, { type = "Adam8bit", params = { lr = 3e-3, min_8bit_size = 500 } })
  train(e, 1)
  e:save(tmp .. "/adam8", {})
  e:free()
  local step = tmp .. "/adam8/step-000001"
  expect_error(function() convert.states(step, step, "f32") end,
               "convert-states: " .. step .. " exists; give a new folder (convert-states never " ..
               "replaces a checkpoint)")
  convert.states(step, tmp .. "/adam8f/step-000001", "f32")
  expect_error(function() convert.states(step, tmp .. "/adam8f/step-000001", "u8") end,
               "exists; give a new folder")
  convert.states(tmp .. "/adam8f/step-000001", tmp .. "/adam8b/step-000001", "u8")
  local back = engine({ stage = 1 }, { type = "Adam8bit", params = { lr = 3e-3, min_8bit_size = 500 } })
  back:load(tmp .. "/adam8b/step-000001") -- recorded as AdamW8bit
  back:free()
  local w8 = engine({ stage = 0 })
  w8:load(step) -- an Adam8bit checkpoint
  w8:free()
  local lion = engine({ stage = 0 }, { type = "Lion", params = { lr = 1e-4 } })
  train(lion, 1)
  lion:save(tmp .. "/lion", {})
  lion:free()
  local ls = tmp .. "/lion/step-000001"
  expect_error(function() convert.states(ls, tmp .. "/l16/step-000001", "bf16") end,
               "the optimizer Lion keeps its states in f32, not bf16, and names no optimizer " ..
               "that keeps them in bf16: no run could resume the copy")
  expect_error(function() convert.states(ls, tmp .. "/lm/step-000001", nil, "bf16") end,
               "the optimizer Lion keeps no bf16 master weights (it has no " ..
               "bf16_stochastic_round): no run could resume the copy")
  for _, d in ipairs({ "/l16", "/lm" }) do
    assert(io.open(tmp .. d .. "/step-000001/manifest.json") == nil, d .. " was written")
  end
end

-- A resume whose min_8bit_size is lower than the saving run's would
-- quantise f32 moments: refused, naming the setting (a checkpoint
-- convert-states brought into u8, above, is quantised by whatever
-- min_8bit_size loads it). A higher one keeps every bit (u8 values into
-- f32) and resumes.
function T.resume_refuses_quantising_f32_states()
  local function run(min)
    return engine({ stage = 0 }, { type = "AdamW8bit", params = { lr = 3e-3, min_8bit_size = min } })
  end
  local e = run(4096)
  train(e, 2)
  e:save(tmp .. "/small", {})
  e:free()
  local step = tmp .. "/small/step-000002"
  local low = run(500)
  expect_error(function() low:load(step) end,
               step .. " was saved keeping the optimizer states of tensors under 4096 elements " ..
               "in f32 (min_8bit_size 4096); this run's 500 would quantise those of " ..
               "transformer.h.0.attn.c_attn.weight (1728 elements): " ..
               "resume with optimizer.params.min_8bit_size 4096")
  low:free()
  local same = run(4096)
  same:load(step)
  local want = train(same, 1)
  same:free()
  local high = run(8192)
  high:load(step)
  high:free()
  -- u8 moments saved under 500 resume under 4096 (kept in f32 from then on)
  -- and, back in a run under 500, give the same bits as one never changed.
  local a = run(500)
  train(a, 2)
  a:save(tmp .. "/small5", {})
  local sum = train(a, 1)
  a:free()
  local b = run(4096)
  b:load(tmp .. "/small5/step-000002")
  b:free()
  local c = run(500)
  c:load(tmp .. "/small5/step-000002")
  assert(train(c, 1) == sum, "the reloaded u8 states give the same step")
  c:free()
  assert(want ~= nil)
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

-- The fused step over a bf16 master (what the engine runs on the cpu) is the
-- three passes it replaces, bit for bit: widen, lz_adamw8bit_step,
-- lz_bf16_round_stochastic keyed by the same (seed, step, index); u8 states
-- with a partial last block and f32 ones, lengths past one 16384-element tile.
function T.bf16_master_step_is_widen_step_round()
  local function bytes_equal(a, b) return ffi.C.memcmp(a.data, b.data, a:bytes()) == 0 end
  local a = lz.adamw_args({})
  a.lr, a.beta1, a.beta2, a.eps, a.grad_scale, a.weight_decay = 1e-2, 0.9, 0.999, 1e-8, 0.7, 0.1
  for _, n in ipairs({ 300, 16384 + 517, 50000 }) do
    for _, eight in ipairs({ true, false }) do
      local wide, g = lz.tensor({ n }, "f32"), lz.tensor({ n }, "f32")
      for i = 0, n - 1 do
        wide:set(i, math.sin(i * 0.37) * (i % 97 == 0 and 1e4 or 1))
        g:set(i, math.cos(i * 1.3) * 0.1)
      end
      local fused, three = lz.tensor({ n }, "bf16"), lz.tensor({ n }, "bf16")
      fused:convert(wide)
      three:copy(fused)
      local work = lz.tensor({ n }, "bf16"):zero()
      local st = {}
      for k = 1, 2 do
        if eight then
          local nb = math.ceil(n / 256)
          st[k] = { lz.tensor({ n }, "u8"):zero(), lz.tensor({ n }, "u8"):zero(),
                    lz.tensor({ nb }, "f32"):zero(), lz.tensor({ nb }, "f32"):zero() }
        else
          st[k] = { lz.tensor({ n }, "f32"):zero(), lz.tensor({ n }, "f32"):zero() }
        end
      end
      local f, t = st[1], st[2]
      for step = 1, 4 do
        a.step = step
        lz.ops.adamw8bit_step_bf16(fused, g, f[1], f[2], f[3], f[4], work, a, 1234, 777)
        wide:convert(three)
        lz.ops.adamw8bit_step(wide, g, t[1], t[2], t[3], t[4], nil, a)
        lz.ops.bf16_round_stochastic(three, wide, 1234, step, 777)
      end
      local what = ("%d elements, %s states"):format(n, eight and "u8" or "f32")
      assert(bytes_equal(fused, three), what .. ": the bf16 masters differ")
      assert(bytes_equal(work, fused), what .. ": the working copy is not the master")
      for k = 1, #f do assert(bytes_equal(f[k], t[k]), what .. ": state " .. k .. " differs") end
    end
  end
  expect_error(function()
    lz.ops.adamw8bit_step_bf16(lz.tensor({ 4 }, "bf16"), lz.tensor({ 4 }, "f32"),
                               lz.tensor({ 4 }, "f32"), lz.tensor({ 4 }, "f32"), nil, nil, nil,
                               a, 1, -1)
  end, "index is -1")
end

return T
