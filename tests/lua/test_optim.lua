-- test_optim.lua — the optimizer table: optim.new picks the class a config
-- names, and update() runs its kernel over a call's views with the call's
-- decay setting; an optimizer from one file outside the tree
-- (tests/fixtures/optim/sgd_toy.lua through LZ_OPTIMIZERS) trains, is
-- recorded in the manifest and resumes, and is unknown everywhere without
-- that file; the manifest's record (or an older checkpoint's config) is
-- what loads and resumes read.
local cjson = require("cjson")
local lz = require("luazero")
local optim = require("luazero.optim")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local T = {}

local expect_error, q = support.expect_error, support.quote

function T.new_picks_the_class_by_type()
  assert(getmetatable(optim.new({ type = "Adam" })) == optim.AdamW)
  assert(getmetatable(optim.new({ type = "adamw" })) == optim.AdamW)
  local l = optim.new({ type = "LION", params = { lr = 3e-5, betas = { 0.95, 0.98 } } })
  assert(getmetatable(l) == optim.Lion)
  assert(l.lr == 3e-5 and l.beta1 == 0.95 and l.beta2 == 0.98 and l.weight_decay == 0)
  expect_error(function() optim.new({ type = "Lamb" }) end,
               "config: optimizer.type must be Adam, AdamW, Lion, Muon, AdamW8bit or Adam8bit (got Lamb)")
  expect_error(function() optim.new({ type = 42 }) end, "(got 42)")
  -- A block without a type (a partial table from Lua) is the engine's AdamW.
  assert(getmetatable(optim.new({})) == optim.AdamW and getmetatable(optim.new()) == optim.AdamW)
end

-- The schema's kinds check what a config gives, naming the key.
function T.schema_kinds_name_the_key_and_the_range()
  local schema = require("luazero.optim.schema")
  local d = { "momentum", "number", min = 0, below = 1, default = 0.9 }
  assert(schema.KINDS.number("optimizer.params.momentum", 0.5, d) == 0.5)
  expect_error(function() schema.KINDS.number("optimizer.params.momentum", 1.5, d) end,
               "config: optimizer.params.momentum must be a number in [0, 1) (got 1.5)")
  expect_error(function() schema.KINDS.number("optimizer.params.lr", -1, { "lr", "number" }) end,
               "config: optimizer.params.lr must be a number >= 0 (got -1)")
  -- A declaration that is not one is refused naming its file.
  local registry = require("luazero.optim.registry")
  expect_error(function()
    registry.define({ name = "Bad", step = function() end, params = {},
                      states = { { name = "m", format = "f16" } } }, "bad.lua")
  end, "optim: bad.lua: state m has format f16: a state is kept in f32, bf16, u8")
  expect_error(function()
    registry.define({ name = "Bad", types = { "adamw" }, step = function() end, params = {},
                      states = {} }, "bad.lua")
  end, "optim: bad.lua: optimizer.type adamw is AdamW's already")
  assert(registry.find("Bad") == nil and registry.by_name.Bad == nil)
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

---------------------------------------------------------------- one file

local write_file, tmp = support.scratch()
local lines = {}
for i = 1, 80 do lines[i] = ("line %d of the corpus: %d\n"):format(i, i * 7919 % 1000) end
local corpus = write_file("corpus.txt", table.concat(lines))
local train, ok_train = support.trainer("--model gpt2-nano --n-layer 2 --n-embd 64 --n-head 4 " ..
  "--context 32 --seq-len 16 --sample 0 --eval-batches 1 --seed 7 --micro-batch 2 --data " .. q(corpus))
local TOY = "LZ_OPTIMIZERS=" .. q(lz.root .. "/tests/fixtures/optim/sgd_toy.lua")

local function manifest(dir)
  local f = assert(io.open(dir .. "/manifest.json", "rb"))
  local m = cjson.decode(f:read("*a"))
  f:close()
  return m
end

local function script(name, flags, env)
  return support.sh(("cd %s && %s %s scripts/%s.lua %s"):format(q(lz.root), env or "",
                                                              q(lz.executable()), name, flags))
end

function T.a_lua_optimizer_is_one_file()
  local cfg = write_file("toy.json", cjson.encode({
    train_micro_batch_size_per_gpu = 2,
    optimizer = { type = "sgdtoy", params = { lr = 0.05, momentum = 0.5 } } }))
  local dir, log = tmp .. "/toy", tmp .. "/toy.jsonl"
  local flags = ("--config %s --stage 2 --steps 4"):format(q(cfg))
  local _, straight = ok_train(2, flags .. (" --save %s --save-every 2 --log %s")
                                            :format(q(dir), q(log)), TOY)
  local recs = support.records(log)
  assert(recs[4].loss < recs[1].loss, ("loss %g then %g"):format(recs[1].loss, recs[4].loss))
  -- The manifest names it as declared, with its hyperparameters and states.
  local m = manifest(dir .. "/step-000004")
  assert(m.optimizer.type == "SGDToy", tostring(m.optimizer.type))
  local p = m.optimizer.params
  assert(p.lr == 0.05 and p.momentum == 0.5 and p.weight_decay == 0, cjson.encode(p))
  assert(table.concat(m.states, ",") == "master,momentum_buffer", table.concat(m.states, ","))
  -- A resume continues bitwise; another optimizer is refused.
  local _, resumed = ok_train(2, flags .. " --resume " .. q(dir .. "/step-000002"), TOY)
  assert(resumed == straight, ("resumed %s, straight %s"):format(resumed, straight))
  local lion = write_file("lion.json", cjson.encode({ train_micro_batch_size_per_gpu = 2,
                                                       optimizer = { type = "Lion" } }))
  local out, st = train(1, ("--config %s --steps 4 --resume %s"):format(q(lion), q(dir)), TOY)
  assert(st ~= 0 and out:find("holds the states master, momentum_buffer; this run's optimizer " ..
                              "Lion keeps master, m", 1, true), out)
  -- Its checkpoint loads for evaluation with the file.
  out, st = script("eval", ("--load %s --data %s --seq-len 16"):format(q(dir), q(corpus)), TOY)
  assert(st == 0, out)
  -- Without the file the name is unknown everywhere: the config, loading
  -- its checkpoint; tools/ckpt still shows the record.
  out, st = train(2, flags)
  assert(st ~= 0 and out:find('config: optimizer.type "sgdtoy" is not available; luazero has ' ..
                              '"Adam", "AdamW", "Lion", "Muon", "AdamW8bit" and "Adam8bit"', 1, true), out)
  out, st = script("eval", ("--load %s --data %s --seq-len 16"):format(q(dir), q(corpus)))
  assert(st ~= 0 and out:find("was saved by the optimizer SGDToy, which this luazero does not " ..
                              "have (it has Adam, AdamW, Lion, Muon, AdamW8bit and Adam8bit)", 1, true), out)
  expect_error(function() optim.new({ type = "SGDToy" }) end,
               "config: optimizer.type must be Adam, AdamW, Lion, Muon, AdamW8bit or Adam8bit (got SGDToy)")
  out, st = support.sh(("cd %s && LUAZERO=%s tools/ckpt inspect %s"):format(q(lz.root),
                       q(lz.executable()), q(dir)))
  assert(st == 0 and out:find("optimizer SGDToy lr 0.05 momentum 0.5 weight_decay 0; states " ..
                              "master, momentum_buffer", 1, true), out)
end

-- A checkpoint saved in process (Lion), its manifest then rewritten as an
-- older luazero or another optimizer would have left it.
function T.loads_read_the_manifest_s_optimizer_record()
  local gpt2 = require("models.gpt2")
  local zero = require("luazero.zero")
  local manifest_io = require("luazero.checkpoint.manifest")
  local inference = require("luazero.inference")
  local cfg = { train_micro_batch_size_per_gpu = 2,
                optimizer = { type = "lion", params = { lr = 3e-5, betas = { 0.9, 0.99 } } } }
  local function engine()
    return zero.initialize{ model = gpt2.new(gpt2.config("gpt2-nano", { n_layer = 2, n_embd = 64,
                            n_head = 4, context = 32 })), config = cfg, seed = 1, batch = { 2, 16 } }
  end
  local e = engine()
  local dir = tmp .. "/lion"
  e:save(dir, {}, { config = { optimizer = { type = "Lion", params = { lr = 3e-5 } } } })
  e:free()
  local step = dir .. "/step-000000"
  local m = manifest(step)
  assert(m.optimizer.type == "Lion" and m.optimizer.params.lr == 3e-5 and
         m.optimizer.params.betas[2] == 0.99 and m.optimizer.params.weight_decay == 0,
         cjson.encode(m.optimizer))
  local function rewrite(fn)
    local t = manifest(step)
    t.manifest_xxh64 = nil
    fn(t)
    local f = assert(io.open(step .. "/manifest.json", "wb"))
    f:write(manifest_io.encode(t))
    f:close()
  end
  local models = require("models.registry")
  local function open() return inference.open({ models = models, load = dir, seq_len = 16 }) end
  local checkpoint = require("luazero.checkpoint")
  -- Another optimizer's record over the same states: refused in one line.
  rewrite(function(t) t.optimizer = { type = "Adam", params = {} } end)
  e = engine()
  expect_error(function() e:load(dir) end, "was saved by the optimizer Adam; this run's is Lion: " ..
               'resume with the optimizer that saved it (optimizer.type "Adam")')
  -- No record (saved before it existed): the config it holds says.
  rewrite(function(t) t.optimizer = nil end)
  e:load(dir)
  local sm = checkpoint.open(dir):summary()
  assert(sm.optimizer.type == "Lion" and sm.optimizer_from == "config", cjson.encode(sm.optimizer))
  local w = open()
  assert(getmetatable(w.engine.optimizer) == optim.Lion)
  w.free()
  -- Neither: resuming goes by the states, as before; loading for
  -- inference names the fix.
  rewrite(function(t) t.config = {} end)
  e:load(dir)
  e:free()
  expect_error(open, "its manifest records no optimizer (a checkpoint saved without a config); " ..
               "consolidate it")
end

-- A state's format is data (optim/formats.lua): bytes per element and per
-- block, what the plan counts, what a config asks with AnyPrecisionAdamW's
-- momentum_dtype / variance_dtype, and what the record keeps.
function T.state_formats_are_declared_and_configured()
  local formats = require("luazero.optim.formats")
  assert(formats.bytes("f32", 1000) == 4000 and formats.bytes("bf16", 1000) == 2000)
  assert(formats.bytes("u8", 4096) == 4096 + 16 * 4 and formats.bytes("u8", 257) == 257 + 2 * 4)
  assert(formats.per_element("u8") == 1 + 4 / 256)
  expect_error(function() formats.master("u8") end, "master weights cannot be kept in u8")
  local config = require("luazero.config")
  local function cfg(params) return config.load({ train_micro_batch_size_per_gpu = 2,
    optimizer = { type = "AdamW", params = params } }, 1) end
  local c = cfg({ lr = 1e-3, momentum_dtype = "bfloat16", variance_dtype = "torch.bfloat16" })
  local a = optim.new(c.optimizer)
  assert(a.state_formats.m == "bf16" and a.state_formats.v == "bf16")
  assert(a:record().state_formats.v == "bf16" and a:record().params.momentum_dtype == nil)
  assert(optim.new(cfg({ lr = 1e-3 }).optimizer).state_formats.m == "f32")
  expect_error(function() cfg({ momentum_dtype = "bfloat16" }) end,
               "config: optimizer.params.momentum_dtype and optimizer.params.variance_dtype " ..
               "must be the same (both float32 or both bfloat16; got \"bfloat16\" and")
  expect_error(function() cfg({ momentum_dtype = "float16", variance_dtype = "float16" }) end,
               "config: optimizer.params.momentum_dtype must be \"float32\" or \"bfloat16\" " ..
               "(got \"float16\")")
  -- The plan counts each state's bytes by its format.
  local placement = require("luazero.zero.plan")
  local function opt_bytes(fmts)
    local P = placement.new({ stage = 1, optimizer_states = { "m", "v" },
                              optimizer_formats = fmts })
    return P:bytes({ full = 8192, shard = 4096 }).states.optimizer
  end
  assert(opt_bytes(nil) == 2 * 4096 * 4, opt_bytes(nil))
  assert(opt_bytes({ m = "bf16", v = "bf16" }) == 2 * 4096 * 2)
  assert(opt_bytes({ m = "u8", v = "u8" }) == 2 * (4096 + 16 * 4))
end

-- bf16 moments in the engine: the states are bf16 tensors, the NVMe region
-- of a sub-group holds 2 bytes an element for each moment, stages 0 and 3 (and
-- the NVMe tier) end with the same parameters, a checkpoint's f32 copy of
-- the moments resumes exactly, a resume into f32 moments is refused, and
-- tools/ckpt convert-states changes the formats a checkpoint records.
function T.bf16_moments_train_on_every_tier_and_resume()
  local gpt2 = require("models.gpt2")
  local zero = require("luazero.zero")
  local function engine(zo)
    local cfg = { train_micro_batch_size_per_gpu = 2, zero_optimization = zo,
                  optimizer = { type = "AdamW", params = { lr = 1e-3, weight_decay = 0.1,
                    momentum_dtype = "bfloat16", variance_dtype = "bfloat16" } } }
    return zero.initialize{ model = gpt2.new(gpt2.config("gpt2-nano", { n_layer = 1, n_embd = 32,
                            n_head = 2, context = 16 })), config = cfg, seed = 3, batch = { 2, 8 } }
  end
  local x = lz.tensor({ 2, 8 }, "i32", "activations")
  local y = lz.tensor({ 2, 8 }, "i32", "activations")
  for i = 0, 15 do x:set(i, (i * 7) % 50); y:set(i, (i * 11) % 50) end
  local function train(e, steps)
    for _ = 1, steps do e:backward(e:forward(x, y)); e:step() end
    return e:params_checksum()
  end
  local e0 = engine({ stage = 0 })
  assert(e0.states.s[1]:dtype_name() == "bf16" and e0.states.s[2]:dtype_name() == "bf16")
  local sum0 = train(e0, 3)
  local dir = tmp .. "/bf16m"
  local e3 = engine({ stage = 3 })
  train(e3, 1)
  e3:save(dir, {})
  assert(train(e3, 2) == sum0)
  e3:free()
  local nv = engine({ stage = 3, offload_optimizer = { device = "nvme", nvme_path = tmp } })
  -- (an fp32 master of 4 bytes where the tier keeps one, m and v of 2 each)
  assert(nv.states.region == nv.states.G * ((nv.states.has_master and 4 or 0) + 4))
  assert(train(nv, 3) == sum0)
  nv:free()
  local r = engine({ stage = 2 })
  r:load(dir .. "/step-000001")
  assert(train(r, 2) == sum0)
  r:free()
  assert(manifest(dir .. "/step-000001").optimizer.state_formats.m == "bf16")
  local f32 = zero.initialize{ model = gpt2.new(gpt2.config("gpt2-nano", { n_layer = 1,
    n_embd = 32, n_head = 2, context = 16 })), config = { train_micro_batch_size_per_gpu = 2 },
    seed = 3, batch = { 2, 8 } }
  expect_error(function() f32:load(dir .. "/step-000001") end,
               "keeps the optimizer state m in bf16; this run keeps it in f32: convert it " ..
               "first (tools/ckpt convert-states")
  -- tools/ckpt convert-states: to f32 the run with f32 moments loads it;
  -- back to bf16 it resumes exactly as the original.
  local convert = require("luazero.checkpoint.convert")
  convert.states(dir .. "/step-000001", tmp .. "/c32/step-000001", "f32")
  f32:load(tmp .. "/c32/step-000001")
  f32:free()
  convert.states(tmp .. "/c32/step-000001", tmp .. "/c16/step-000001", "bf16")
  local r2 = engine({ stage = 1 })
  r2:load(tmp .. "/c16/step-000001")
  assert(train(r2, 2) == sum0)
  r2:free()
  expect_error(function() convert.states(dir .. "/step-000001", tmp .. "/c8/s", "u8") end,
               "convert-states: u8 states are block-scaled, which the engine does not place")
  -- The command line: one line saying what it wrote; --to beside another
  -- command is refused.
  local out, st = support.sh(("cd %s && LUAZERO=%s tools/ckpt convert-states %s %s --to f32")
    :format(q(lz.root), q(lz.executable()), q(dir .. "/step-000001"),
            q(tmp .. "/cli/step-000001")))
  assert(st == 0 and out:find("the optimizer states (m bf16, v bf16) now in f32", 1, true), out)
  assert(manifest(tmp .. "/cli/step-000001").optimizer.state_formats.v == "f32")
  out, st = support.sh(("cd %s && LUAZERO=%s tools/ckpt inspect %s --to f32"):format(
    q(lz.root), q(lz.executable()), q(dir .. "/step-000001")))
  assert(st == 2 and out:find("goes with convert-states", 1, true), out)
  e0:free()
end

return T
