-- test_family_tools.lua — the tools on every model family models/registry.lua
-- lists (its FAMILIES, each at its first, smallest size): tools/estimate
-- counts the parameters the family builds, and its model-state bytes are
-- what the engine allocates for it; scripts/train.lua --profile profiles its
-- steps; the REPL builds and shows it.
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local families = require("luazero.families")
local models = require("models.registry")

local T = {}
local eq, q = support.eq, support.quote
local _, _, corpus = support.scratch_corpus(support.HAMLET, 60)

-- Each family's first size, in the registry's order.
local function sizes()
  local out = {}
  for _, f in ipairs(families.list()) do out[#out + 1] = f.names[1] end
  assert(#out >= 9, "the nine families and any registered since")
  return out
end

local function run(cmd)
  return support.sh(("cd %s && %s %s"):format(q(lz.root), q(lz.executable()), cmd))
end

local function thousands(s) return tonumber((s:gsub(",", ""))) end

function T.estimate_counts_what_each_family_builds()
  for _, name in ipairs(sizes()) do
    local m = models.new(models.config(name))
    local out, st = run("tools/estimate.lua --world 1 --model " .. name)
    assert(st == 0, out)
    local all, real = out:match(name:gsub("%p", "%%%0") ..
                                ": ([%d,]+) parameters %(([%d,]+) without the vocabulary padding")
    assert(all, name .. ": no parameter count in\n" .. out)
    eq(thousands(all), m.n_params, name .. ": tools/estimate's parameters")
    eq(thousands(real), m:count_params(), name .. ": without the padding")
  end
end

-- Stage 3, bf16, one rank on the cpu: the ledger's growth over an engine
-- and a step is the estimator's host bytes (within 5%), and
-- engine:estimate() is the estimator's figure to the byte.
function T.estimated_bytes_are_what_the_engine_allocates_for_each_family()
  local estimate = require("luazero.estimate")
  local zero = require("luazero.zero")
  local data = require("luazero.data")
  local text = data.load(corpus)
  for _, name in ipairs(sizes()) do
    local cfg = { train_micro_batch_size_per_gpu = 2, bf16 = { enabled = true },
                  zero_optimization = { stage = 3, stage3_param_persistence_threshold = 600 },
                  optimizer = { type = "AdamW", params = { lr = 1e-3 } } }
    local mc = models.config(name)
    local model = models.new(mc)
    local counts = estimate.counts(model, 1, 600)
    jit.flush(); collectgarbage(); collectgarbage()
    local before = lz.mem()
    local engine = zero.initialize({ model = model, config = cfg, seed = 1, batch = { 2, 16 } })
    local loader = data.loader(text, { B = 2, T = 16, seed = 1, vocab = mc.vocab })
    engine:train_batch(loader)
    local m, host = lz.mem(), 0
    for _, cat in ipairs({ "params", "grads", "optimizer", "offload" }) do
      host = host + m[cat] - before[cat]
    end
    local r = estimate.rank(counts, estimate.settings_of(cfg, "cpu"))
    local want = estimate.kept(r, "host")
    assert(math.abs(host - want) <= 0.05 * want,
           ("%s: the ledger grew %d bytes, the estimate %d"):format(name, host, want))
    eq(engine:estimate().host.total, r.host.total, name .. ": engine:estimate()")
    loader:free()
    engine:free()
  end
  data.free(text)
end

function T.profile_runs_for_each_family()
  for _, name in ipairs(sizes()) do
    local out, st = run(("scripts/train.lua --model %s --data %s --steps 3 --seq-len 16 " ..
                         "--micro-batch 2 --sample 0 --eval-batches 1 --profile")
                        :format(name, q(corpus)))
    assert(st == 0, out)
    assert(out:find("profile: 2 steps after the warm-up", 1, true), name .. ":\n" .. out)
    assert(out:find("\nGEMM ", 1, true) and out:find("attention", 1, true) and
           out:find("sum of the rows", 1, true), name .. ": the profile's rows\n" .. out)
    -- the MLP's activation has rows of its own, not Lua glue's time
    assert(out:find("\n[%a_]*gelu_forward ") or out:find("\n[%a_]*glu[%a_]*_forward "),
           name .. ": no activation row\n" .. out)
  end
end

function T.the_repl_builds_and_shows_each_family()
  for _, name in ipairs(sizes()) do
    local m = models.new(models.config(name))
    local out, st = support.sh(("cd %s && printf '=m:count_params()\\n=m\\n' | timeout 60 %s -i " ..
                                "-e %s"):format(q(lz.root), q(lz.executable()),
                               q(("local r = require('models.registry'); m = r.new(r.config(%q))")
                                 :format(name))))
    assert(st == 0, out)
    assert(out:find("\n" .. m:count_params() .. "\n", 1, true) or
           out:find("^" .. m:count_params() .. "\n"), name .. ": the count\n" .. out)
    assert(out:find(" params", 1, true) and not out:find("traceback", 1, true),
           name .. ": the model shown\n" .. out)
  end
end

return T
