-- test_moe_config.lua — the "moe" block's ep_size (config/moe.lua): read,
-- checked against the world size, its groups as DeepSpeed builds them
-- (blocks of ep_size ranks, and the ranks ep_size apart), and an engine
-- that joins both groups for an MoE model, says so in its start-up line
-- and ends every stage on one checksum (a dense model joins none).
local lz = require("luazero")
local config = require("luazero.config")
local moe = require("luazero.config.moe")
local support = dofile(lz.root .. "/tests/lua/support.lua")

local T = {}
local q = support.quote
local write_file = support.scratch()

local function load_error(source, world)
  local ok, err = pcall(config.load, source, world)
  assert(not ok, "expected an error, the config loaded")
  return tostring(err)
end

function T.ep_size_is_read_and_checked()
  support.eq(config.load({ train_batch_size = 4 }, 4).moe.ep_size, 1, "default ep_size")
  local cfg = config.load({ train_batch_size = 4, moe = { ep_size = 2 } }, 4)
  support.eq(cfg.moe.ep_size, 2, "ep_size")
  assert(config.summary(cfg):find("moe.ep_size 2", 1, true), config.summary(cfg))
  support.eq(config.load({ train_batch_size = 4, moe = { ep_size = "auto" } }, 4).moe.ep_size, 1,
             "ep_size auto")
  support.eq(load_error({ train_batch_size = 4, moe = { ep_size = 3 } }, 4),
             "config: moe.ep_size must divide the world size 4 (got 3); each expert-parallel " ..
             "group is ep_size consecutive ranks")
  support.eq(load_error({ train_batch_size = 4, moe = { ep_size = 0 } }, 4),
             "config: moe.ep_size must be a whole number >= 1 (got 0)")
  assert(load_error({ train_batch_size = 4, moe = 2 }, 4):find("moe", 1, true))
  cfg = config.load({ train_batch_size = 4, moe = { ep_size = 1, top_k_gating = 2 } }, 4)
  support.eq(table.concat(cfg.unimplemented, ","), "moe.top_k_gating", "reported keys")
end

-- moe.placement: read, checked, and the plan's experts "world" where it
-- says so (its own placement, "edp", otherwise: at stage 0 too).
function T.placement_is_read_and_checked()
  local plan = require("luazero.zero.plan")
  support.eq(config.load({ train_batch_size = 4 }, 4).moe.placement, nil, "default placement")
  support.eq(config.load({ train_batch_size = 4, moe = { placement = "world" } }, 4).moe.placement,
             "world", "placement")
  support.eq(load_error({ train_batch_size = 4, moe = { placement = "ranks" } }, 4),
             'config: moe.placement must be "group" or "world" (got "ranks")')
  for stage = 0, 3 do
    support.eq(plan.new({ stage = stage, ep_size = 2 }).experts, "edp", "stage " .. stage)
    support.eq(plan.new({ stage = stage, ep_size = 2, expert_placement = "world" }).experts,
               "world", "stage " .. stage .. ", placement world")
    support.eq(plan.new({ stage = stage, ep_size = 2, dtype = "bf16", grad_dtype = "bf16" })
               .experts, "edp", "stage " .. stage .. ", bf16 gradients")
  end
end

function T.gather_and_routed_only_are_read_and_checked()
  local cfg = config.load({ train_batch_size = 4 }, 4)
  support.eq(cfg.moe.gather, nil, "default gather: as the model was built")
  support.eq(cfg.moe.routed_only, false, "default routed_only")
  cfg = config.load({ train_batch_size = 4, moe = { gather = "expert", routed_only = true } }, 4)
  support.eq(cfg.moe.gather, "expert", "gather")
  support.eq(cfg.moe.routed_only, true, "routed_only")
  support.eq(load_error({ train_batch_size = 4, moe = { gather = "layer" } }, 4),
             'config: moe.gather must be "block" or "expert" (got "layer")')
  support.eq(load_error({ train_batch_size = 4, moe = { routed_only = 1 } }, 4),
             "config: moe.routed_only must be true or false (got 1)")
  local plan = require("luazero.zero.plan")
  local ok, err = pcall(plan.new, { stage = 3, moe = { gather = "block", routed_only = true } })
  assert(not ok)
  support.eq(err, 'plan: moe.routed_only needs the experts gathered one by one; add "gather": ' ..
                  '"expert" to the config\'s moe block')
  local p = plan.new({ stage = 3, moe = { gather = "expert", routed_only = true, blocks = 2,
                                          experts = 8 } })
  support.eq(p.moe.gather, "expert", "plan field")
  assert(tostring(p):find("moe        per expert, routed only (2 blocks of 8 experts)", 1, true),
         tostring(p))
  support.eq(plan.new({ stage = 3 }).moe, nil, "no moe field without MoE blocks")
  -- An engine refuses a config whose granularity is not the model's, and
  -- routed_only over whole blocks, by name.
  local zero = require("luazero.zero")
  local mixtral = require("models.mixtral")
  local function init_error(moe_block)
    local model = mixtral.new(mixtral.config("mixtral-tiny"))
    local ok2, e = pcall(zero.initialize, { model = model, config = { moe = moe_block } })
    assert(not ok2, "expected an error")
    return e
  end
  support.eq(init_error({ gather = "expert" }),
             'initialize: the config\'s moe.gather is "expert" but the model\'s experts were ' ..
             'built gathered "block"; build it with models.config(name, { moe_gather = "expert" ' ..
             '}) (scripts/train.lua does)')
  support.eq(init_error({ routed_only = true }),
             'initialize: moe.routed_only needs the experts gathered one by one; add "gather": ' ..
             '"expert" to the config\'s moe block')
end

function T.groups_are_deepspeeds_blocks_and_strides()
  local function lists(ep_size, world, rank)
    local ep, edp = moe.groups(ep_size, world, rank)
    return table.concat(ep, " ") .. " / " .. table.concat(edp, " ")
  end
  support.eq(lists(2, 4, 3), "2 3 / 1 3", "world 4, ep_size 2, rank 3")
  support.eq(lists(4, 16, 5), "4 5 6 7 / 1 5 9 13", "world 16, ep_size 4, rank 5")
  support.eq(lists(1, 3, 2), "2 / 0 1 2", "ep_size 1")
  support.eq(lists(4, 4, 0), "0 1 2 3 / 0", "ep_size = world")
end

local corpus = write_file("corpus.txt", ("A seed corpus line of text for a tiny model.\n"):rep(50))
local RUN = "--seq-len 8 --micro-batch 2 --sample 0 --eval-batches 1 --steps 2 --data " .. q(corpus)
local train, ok_train = support.trainer("--model mixtral-tiny --n-layer 1 " .. RUN)
local _, ok_dense = support.trainer("--model gpt2-nano --n-layer 1 --n-embd 16 --n-head 2 " ..
                                    "--context 8 --vocab 128 " .. RUN)

-- An MoE model's engine joins both groups and says so; every stage ends on
-- one checksum. A dense model has no experts to place: it joins none and
-- trains as without the block.
function T.engine_joins_its_groups_and_trains_the_same()
  local with = write_file("moe.json", '{"train_micro_batch_size_per_gpu": 2, "moe": {"ep_size": 2}}')
  local without = write_file("plain.json", '{"train_micro_batch_size_per_gpu": 2}')
  local out, sum = ok_train(4, "--config " .. q(with))
  assert(out:find("ep_size 2 (expert-parallel ranks 0 1, expert-data-parallel ranks 0 2)", 1, true),
         out)
  local _, s2 = ok_train(4, "--stage 2 --config " .. q(with))
  support.eq(s2, sum, "params_checksum at stage 2 under moe.ep_size 2")
  local dense_out, dense = ok_dense(4, "--config " .. q(with))
  assert(not dense_out:find("ep_size 2", 1, true), dense_out)
  local _, plain = ok_dense(4, "--config " .. q(without))
  support.eq(dense, plain, "a dense model's params_checksum with and without moe.ep_size")
  local bad, st = train(3, "--config " .. q(with))
  assert(st ~= 0 and bad:find("moe.ep_size must divide the world size 3", 1, true), bad)
end

return T
