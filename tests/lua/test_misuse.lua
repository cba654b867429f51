-- test_misuse.lua — what a script of one's own can get wrong gets one line
-- that names the fix: step before backward, backward twice, a module with a
-- forward and no backward, a parameter made outside the engine, a batch of
-- the wrong shape; and through `luazero script.lua` the line is all there is.
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local nn = require("luazero.nn")
local zero = require("luazero.zero")
local models = require("models.registry")

local T = {}
local B, S = 2, 8

local function engine_and_batch()
  local cfg = models.config("gpt2-nano", { n_layer = 1, n_embd = 32, n_head = 2, context = 16 })
  local engine = zero.initialize{ model = models.new(cfg), seed = 1, batch = { B, S },
                                  config = { train_micro_batch_size_per_gpu = B } }
  local x, y = lz.tensor({ B, S }, "i32"), lz.tensor({ B, S }, "i32")
  for i = 0, B * S - 1 do x:set(i, i % 50); y:set(i, (i + 1) % 50) end
  return engine, x, y
end

-- err must be one line holding each needle.
local function one_line(fn, ...)
  local ok, err = pcall(fn)
  assert(not ok, "expected an error")
  err = tostring(err)
  assert(not err:find("\n"), "more than one line: " .. err)
  for _, needle in ipairs({ ... }) do
    assert(err:find(needle, 1, true), ("%q does not say %q"):format(err, needle))
  end
  return err
end

function T.step_before_backward()
  local engine, x, y = engine_and_batch()
  one_line(function() engine:step() end, "engine: step before backward",
           "engine:backward(loss) first")
  engine:backward(engine:forward(x, y))
  local r = engine:step()
  assert(r.loss > 0, "the step after a backward runs")
  one_line(function() engine:step() end, "step before backward") -- again, without a new backward
  engine:free()
end

function T.backward_twice()
  local engine, x, y = engine_and_batch()
  local loss = engine:forward(x, y)
  engine:backward(loss)
  one_line(function() engine:backward(loss) end, "backward twice",
           "engine:forward(x, y) before each")
  engine:step()
  engine:free()
end

function T.a_batch_of_the_wrong_shape()
  local engine, x, y = engine_and_batch()
  local flat = lz.tensor({ B * S }, "i32")
  one_line(function() engine:forward(flat, y) end, "a batch must be", "[B, T]", "t:view(0, {B, T})")
  local other = lz.tensor({ B, S - 1 }, "i32")
  one_line(function() engine:forward(x, other) end, "the same shape")
  one_line(function() engine:forward(lz.tensor({ B, S }, "f32"), y) end, "i32")
  engine:backward(engine:forward(x, y)) -- the refused batches left nothing half done
  engine:step()
  engine:free()
end

-- A model of one's own with a module the engine cannot train.
local function model_with(child)
  local cfg = models.config("gpt2-nano", { n_layer = 1, n_embd = 32, n_head = 2, context = 16 })
  local model = models.new(cfg)
  local body = model.children[1].module
  body:add("extra", child)
  return model
end

function T.a_module_without_backward()
  local Half = nn.Module:extend("Half")
  function Half.new() return setmetatable({}, Half):init() end
  function Half:forward(x) return x end
  one_line(function() zero.initialize{ model = model_with(Half.new()), config = {} } end,
           "module transformer.extra (Half) has a forward but no backward", "give it backward(dy)")
end

function T.a_parameter_made_outside_the_engine()
  local Scale = nn.Module:extend("Scale")
  function Scale.new()
    local self = setmetatable({}, Scale):init()
    self.p.gain = lz.tensor({ 4 }) -- should have been self:param("gain", {4}, ...)
    return self
  end
  function Scale:forward(x) return x end
  function Scale:backward(dy) return dy end
  one_line(function() zero.initialize{ model = model_with(Scale.new()), config = {} } end,
           "transformer.extra (Scale) holds p.gain", 'self:param("gain", shape, init)')
end

function T.through_luazero_the_error_is_one_line()
  local write = support.scratch()
  local script = write("misuse.lua", [[
local zero, models = require("luazero.zero"), require("models.registry")
local cfg = models.config("gpt2-nano", { n_layer = 1, n_embd = 32, n_head = 2, context = 16 })
local engine = zero.initialize{ model = models.new(cfg), config = {}, batch = { 2, 8 } }
engine:step()
]])
  local out, st = support.sh(support.quote(lz.executable()) .. " " .. support.quote(script))
  support.eq(st, 1, "exit status")
  support.eq(out, "luazero: engine: step before backward: no gradients since the last step; " ..
             "call engine:forward(x, y) and engine:backward(loss) first (or " ..
             "engine:train_batch)\n", "output")
end

-- Ranks given different seeds, lr or stages, or running other CPU code
-- paths at stage 0: zero.initialize refuses on every rank, naming what
-- differs (before, each trained its own copy or shard apart, exit 0); the
-- same settings build, and other code paths do from stage 1.
function T.ranks_given_different_settings_are_refused_on_every_rank()
  local write = support.scratch()
  local script = write("ranks.lua", [[
local zero, models = require("luazero.zero"), require("models.registry")
local comm = require("luazero.comm")
local rank, what = comm.rank(), arg[1]
local cfg = models.config("gpt2-nano", { n_layer = 1, n_embd = 32, n_head = 2, context = 16 })
local lr = what == "lr" and rank == 1 and 1e-2 or 1e-3
local stage = what == "stage" and rank == 1 and 3 or (what == "cpu0" and 0 or 2)
-- (cpu0, cpu2: rank 1 runs bf16 GEMMs widened to fp32, as a CPU without
-- avx512_bf16 does, and oneDNN's GEMMs in SSE4.1, which any CPU has; a8:
-- rank 1 runs the 8-bit update in its plainest form, which gives the same
-- bits)
local ffi = require("ffi")
ffi.cdef("int setenv(const char *name, const char *value, int overwrite);")
if what:find("^cpu") and rank == 1 then
  ffi.C.setenv("LZ_BF16_MATMUL", "f32", 1)
  ffi.C.setenv("DNNL_MAX_CPU_ISA", "SSE41", 1)
end
if what == "a8" and rank == 1 then ffi.C.setenv("LZ_ADAMW8BIT_ISA", "base", 1) end
if what == "a8" then stage = 0 end
local ok, err = pcall(zero.initialize, { model = models.new(cfg), batch = { 2, 8 },
  seed = what == "seed" and rank + 1 or 1,
  config = { train_micro_batch_size_per_gpu = 2, zero_optimization = { stage = stage },
             bf16 = { enabled = what:find("^cpu") ~= nil },
             optimizer = { type = what == "a8" and "AdamW8bit" or "AdamW",
                           params = { lr = lr } } } })
print(ok and "built" or err)
]])
  local cmd = support.quote(lz.executable()) .. " -n 2 " .. support.quote(script) .. " "
  -- (cpu2: stage 2 takes other CPU code paths; a8: other 8-bit forms, one set of bits)
  for _, same in ipairs({ "same", "cpu2", "a8" }) do
    local out, st = support.sh(cmd .. same)
    support.eq(st, 0, "exit status, " .. same)
    support.eq(select(2, out:gsub("built", "")), 2, same .. ": both ranks built: " .. out)
  end
  local out, st
  -- evaluate with another n per rank: refused on every rank (before, each
  -- averaged other batches into one wrong number)
  local ev = write("evaluate.lua", [[
local zero, models, data = require("luazero.zero"), require("models.registry"), require("luazero.data")
local comm = require("luazero.comm")
local cfg = models.config("gpt2-nano", { n_layer = 1, n_embd = 32, n_head = 2, context = 16 })
local engine = zero.initialize({ model = models.new(cfg), batch = { 2, 8 }, seed = 1,
  config = { train_micro_batch_size_per_gpu = 2 } })
local corpus = data.load(arg[1])
local loader = data.loader(corpus, { B = 2, T = 8, seed = 1, vocab = cfg.vocab,
                                     rank = comm.rank(), world = comm.size() })
print(select(2, pcall(engine.evaluate, engine, loader, comm.rank() == 0 and 2 or 1)))
print(("same n: %.6f"):format(engine:evaluate(loader, 1)))
]])
  local text = write("stage.txt", ("All the world's a stage. "):rep(200))
  local eout, est = support.sh(support.quote(lz.executable()) .. " -n 2 " .. support.quote(ev) ..
                               " " .. support.quote(text))
  support.eq(est, 0, "exit status, evaluate\n" .. eout)
  support.eq(select(2, eout:gsub("engine:evaluate: the ranks asked for different numbers of " ..
                                 "batches %(rank 0: 2, rank 1: 1%)", "")), 2, eout)
  assert(eout:match("same n: ([%d.]+)") == eout:match("%[rank 1%] same n: ([%d.]+)"), eout)
  for what, needles in pairs({
    seed = { "different seed: rank 1 differs from rank 0's (this rank, ", "has 1)", "has 2)" },
    lr = { "different optimizer: rank 1 differs", "lr=0.001", "lr=0.01" },
    stage = { "different zero_optimization.stage", "has 2)", "has 3)" },
    cpu0 = { "the ranks run different CPU code paths: rank 1 differs from rank 0's (this rank, ",
             "GEMMs oneDNN sse41", "at ZeRO stage 0 every rank updates its own copy of the weights" },
  }) do
    out, st = support.sh(cmd .. what)
    support.eq(st, 0, "exit status, " .. what)
    for _, needle in ipairs(needles) do
      assert(out:find(needle, 1, true), ("%s: %q does not say %q"):format(what, out, needle))
    end
    assert(not out:find("built", 1, true), what .. ": a rank built its engine: " .. out)
  end
end

return T
