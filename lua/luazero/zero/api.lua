-- zero/api.lua — the engine's public arguments, checked where a script
-- gives them, each refusal naming the argument and what it takes (a wrong
-- one would otherwise fail deep inside, naming an internal line).
local M = {}

local function fail(fmt, ...) error(fmt:format(...), 0) end

local values = require("luazero.config.values")
local whole = values.is_whole -- finite, no fraction

-- zero.initialize's options (docs/api.md).
local OPTIONS = { model = true, config = true, seed = true, batch = true, lr = true, comm = true,
                  device = true, draw_weights = true, checkpoint_activations = true }

-- zero.initialize's opts: only its options; lr (a number, or a function of
-- the step giving one), seed (a whole number), batch ({B, T}).
function M.initialize(opts)
  if type(opts) ~= "table" then
    fail("zero.initialize: takes a table of options ({ model = ..., config = ... }); got %s",
         type(opts))
  end
  for k in pairs(opts) do
    if not OPTIONS[k] then
      fail("zero.initialize: no option %s%s (its options: %s)", tostring(k),
           values.did_you_mean(k, OPTIONS), table.concat(values.sorted_keys(OPTIONS), ", "))
    end
  end
  local lr = opts.lr
  if lr ~= nil and type(lr) ~= "function" and not (type(lr) == "number" and lr >= 0 and
                                                  lr < math.huge) then
    fail("zero.initialize: lr must be a number >= 0 or a function of the step returning one " ..
         "(got %s)", tostring(lr))
  end
  if opts.seed ~= nil and not whole(opts.seed) then
    fail("zero.initialize: seed must be a whole number (got %s)", tostring(opts.seed))
  end
  local b = opts.batch
  if b ~= nil and not (type(b) == "table" and whole(b[1]) and whole(b[2]) and b[1] >= 1 and
                       b[2] >= 1) then
    fail("zero.initialize: batch must be { B, T }, sequences and tokens a micro-batch, whole " ..
         "numbers >= 1 (got %s)", tostring(b))
  end
  local m = opts.model
  if m ~= nil and (type(m) ~= "table" or type(m.walk) ~= "function") then
    fail("zero.initialize: model must be a model (models.new(cfg), or an nn.Model); got %s",
         type(m) == "table" and "a table that is not one (a config? give models.new(it))" or
         type(m))
  end
  -- (one engine a model: its parameters are that engine's buffers' views)
  if m and m.zero_engine then
    fail("initialize: this model is an engine's already (its parameters are views of that " ..
         "engine's buffers); build another with models.new for a second engine, or " ..
         "engine:free() the first")
  end
end

-- The metatable a freed engine takes (Engine: the engine's class): its
-- fields stay, each method refuses in one line.
function M.freed(Engine)
  return { __index = function(_, k)
    if type(Engine[k]) == "function" then
      return function()
        error(("engine:%s: this engine was freed (engine:free()); make another with " ..
               "zero.initialize"):format(k), 2)
      end
    end
  end }
end

-- The engine's lr(step): a function's result, checked each step.
function M.lr(fn)
  if type(fn) == "number" then return function() return fn end end
  return function(step)
    local v = fn(step)
    if type(v) ~= "number" or v ~= v or v < 0 or v == math.huge then
      error(("engine: the lr function gave %s at step %d; it must return a finite number >= 0")
            :format(tostring(v), step), 0)
    end
    return v
  end
end

-- train_batch's batches: what hands out the next micro-batch.
function M.batches(b)
  if type(b) ~= "table" or type(b.next_batch) ~= "function" then
    fail("engine:train_batch: batches must have next_batch() (a data loader: luazero.data." ..
         "loader); got %s", tostring(b))
  end
end

-- evaluate's loader and n: validation batches 1 .. n of it.
function M.evaluate(loader, n)
  if type(loader) ~= "table" or type(loader.val_batch) ~= "function" then
    fail("engine:evaluate: loader must have val_batch(i) (a data loader); got %s",
         tostring(loader))
  end
  local most = loader.val_batches
  if not whole(n) or n < 1 or (most and n > most) then
    fail("engine:evaluate: n is %s; it must be a whole number from 1 to the loader's " ..
         "val_batches (%s)", tostring(n), tostring(most))
  end
end

return M
