-- test_api_args.lua — the public API's arguments refused where a script
-- gives them, each naming the argument and what it takes (docs/api.md):
-- zero.initialize's options, lr, seed and batch, an lr function's result,
-- train_batch's batches, evaluate's loader and n, a loader's options and a
-- validation batch past the held-out part (which used to read past the
-- corpus), and a forward before any batch shape.
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local data = require("luazero.data")
local models = require("models.registry")
local zero = require("luazero.zero")

local T = {}
local expect_error = support.expect_error
local write_file = support.scratch()
local corpus_path = write_file("corpus.txt", support.HAMLET:rep(20))
local CFG = models.config("gpt2-nano", { n_layer = 1, n_embd = 32, n_head = 2, context = 16 })

local function engine(opts)
  local o = { model = models.new(CFG), config = {}, batch = { 2, 16 } }
  for k, v in pairs(opts or {}) do o[k] = v end
  return zero.initialize(o)
end

function T.a_loaders_options_and_validation_batches_are_checked()
  local c = data.load(corpus_path)
  local L = data.loader(c, { B = 2, T = 16, seed = 1, vocab = CFG.vocab })
  local n = L.val_batches
  assert(n >= 1, "validation batches " .. n)
  for _, i in ipairs({ 0, n + 1, 1.5, "1" }) do
    expect_error(function() L:val_batch(i) end,
                 ("data: validation batch %s is not one of 1 .. %d (loader.val_batches)")
                 :format(tostring(i), n))
  end
  expect_error(function() data.load(42) end, "data.load: path must be a file name (got 42)")
  expect_error(function() data.loader(c, { B = 2, vocab = 256 }) end,
               "the loader's T must be a whole number >= 1 (got nil)")
  expect_error(function() data.loader(c, { B = math.huge, T = 16, vocab = 256 }) end,
               "the loader's B must be a whole number >= 1 (got inf)")
  expect_error(function() data.loader(c, { B = 2, T = 16 }) end,
               "the loader's vocab must be a whole number >= 1 (got nil)")
  expect_error(function() data.loader(c, { B = 2, T = 16, vocab = 256, rank = 3, world = 2 }) end,
               "the loader's rank 3 must be one of 0 .. world - 1 (world 2)")
  expect_error(function() data.loader(c, { B = 2, T = 16, vocab = 256, val_fraction = 1.5 }) end,
               "the loader's val_fraction must be in [0, 1] (got 1.5)")
  L:free()
end

-- set_position takes what position() returned; anything else used to be
-- taken without a word, the loader left where it was.
function T.a_loaders_position_is_checked()
  local c = data.load(corpus_path)
  local L = data.loader(c, { B = 2, T = 16, seed = 1, vocab = CFG.vocab })
  local pos = L:position()
  local _, first = L:next_batch()
  local want = { first[0], first[1], first[2] }
  for _, bad in ipairs({ "x", 7, {}, { rng_state = 12 }, { rng_state = "zz" } }) do
    expect_error(function() L:set_position(bad) end,
                 "data: set_position takes what loader:position() returned")
  end
  L:set_position(pos)
  local _, again = L:next_batch()
  assert(again[0] == want[1] and again[1] == want[2] and again[2] == want[3],
         "the batch after set_position(position()) is the first batch again")
end

-- forward(x) without targets is the logits only; a backward after it is
-- refused before it changes anything, and a forward with targets goes on.
function T.a_backward_after_a_forward_without_targets_is_refused()
  local e = engine()
  local x, y = lz.tensor({ 2, 16 }, "i32"), lz.tensor({ 2, 16 }, "i32")
  assert(e:forward(x) == nil, "forward(x) without targets returns no loss")
  assert(e.model.logits and e.model.logits:dim(3) >= CFG.vocab, "forward(x) leaves the logits")
  expect_error(function() e:backward(nil) end,
               "engine: backward after engine:forward(x) without targets, which computes " ..
               "the logits only")
  local loss = e:forward(x, y)
  assert(type(loss) == "number", "forward(x, y) after the refusal returns the loss")
  e:backward(loss)
  e:free()
end

-- The REPL's helpers: a pattern that is not a string is refused, one that
-- names no parameter says so, and mem takes no argument.
function T.the_repl_helpers_arguments_are_checked()
  local inspect = require("luazero.ui.inspect")
  local e = engine()
  expect_error(function() inspect.shards(e, 5) end,
               "shards: the pattern is number 5; give a part of a parameter's name as a string")
  for _, helper in ipairs({ "shards", "norms" }) do
    local text = tostring(inspect[helper](e, "zzz"))
    assert(text:find("(no parameter's name contains 'zzz': " .. helper ..
                     "(engine) lists them all)", 1, true), text)
    assert(not tostring(inspect[helper](e, "wte")):find("no parameter's name", 1, true))
  end
  expect_error(function() inspect.mem(3) end, "mem: takes no argument")
  e:free()
end

function T.the_engines_arguments_are_checked()
  expect_error(function() engine({ lr = "fast" }) end,
               "zero.initialize: lr must be a number >= 0 or a function of the step returning " ..
               "one (got fast)")
  expect_error(function() engine({ seed = "abc" }) end,
               "zero.initialize: seed must be a whole number (got abc)")
  expect_error(function() engine({ batch = { 2 } }) end, "zero.initialize: batch must be { B, T }")
  expect_error(function() engine({ seeds = 1 }) end,
               "zero.initialize: no option seeds (did you mean seed?) (its options: batch, ")
  local L = data.loader(data.load(corpus_path), { B = 2, T = 16, seed = 1, vocab = CFG.vocab })
  local e = engine({ lr = function() return 0 / 0 end })
  expect_error(function() e:train_batch(L) end,
               "engine: the lr function gave nan at step 1; it must return a finite number >= 0")
  e:free()
  e = engine()
  expect_error(function() e:train_batch({}) end,
               "engine:train_batch: batches must have next_batch() (a data loader")
  for _, n in ipairs({ 0, "two", L.val_batches + 1 }) do
    expect_error(function() e:evaluate(L, n) end,
                 ("engine:evaluate: n is %s; it must be a whole number from 1 to the loader's " ..
                  "val_batches (%d)"):format(tostring(n), L.val_batches))
  end
  local loss = e:evaluate(L, 1)
  assert(loss == loss and loss > 0, "evaluate(L, 1): " .. tostring(loss))
  e:free()
  -- a constant lr as a number trains as the same function would
  local a, b = engine({ lr = 1e-3 }), engine({ lr = function() return 1e-3 end })
  support.eq(a:train_batch(L).lr, b:train_batch(L).lr, "lr as a number and as a function")
  a:free(); b:free()
  -- no batch shape: the refusal names the engine's ways to give one
  e = zero.initialize({ model = models.new(CFG), config = {} })
  expect_error(function() e:train_batch(L) end,
               "model: no batch shape yet: call model:prepare(B, T) before forward (an engine: " ..
               "zero.initialize{..., batch = {B, T}}, or engine:prepare(B, T))")
  e:free()
  L:free()
end

return T
