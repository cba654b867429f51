-- test_plan.lua — the placement plan (zero/plan.lua): what each stage
-- keeps where, its bytes against the ledger after one step and against
-- tools/estimate for every stage x dtype x offload (tests/lua/plan_check.lua,
-- at world 1 and 2), and its printout.
local lz = require("luazero")
local Placement = require("luazero.zero.plan")
local support = dofile(lz.root .. "/tests/lua/support.lua")

local T = {}
local q = support.quote
local write_file, tmp = support.scratch()

function T.stages_are_data()
  local function p(stage, extra)
    local o = { stage = stage, dtype = "bf16" }
    for k, v in pairs(extra or {}) do o[k] = v end
    return Placement.new(o)
  end
  local s0, s1, s2, s3 = p(0), p(1), p(2), p(3)
  assert(s0.params.extent == "full" and s0.grads.extent == "full" and s0.optimizer.extent == "full")
  assert(s0.reduce.op == "all_reduce" and s0.reduce.bucketed and s0.after_step == "none")
  assert(s1.grads.extent == "full" and s1.optimizer.extent == "shard" and s1.reduce.op == "reduce_scatter")
  assert(not s1.reduce.buffered and s1.after_step == "gather_full")
  assert(s2.grads.extent == "shard" and s2.reduce.buffered and s2.reduce.into == "shard")
  assert(s3.params.extent == "shard" and s3.params.gather == "per_module")
  assert(s3.after_step == "gather_persistent")
  -- fp32: the master is the working copy; bf16: its own fp32 copy.
  assert(p(2, { dtype = "fp32" }).master.alias == "params" and s2.master.alias == nil)
  -- Accumulation and half gradients stage stages 0-1.
  assert(p(0, { accum = 2 }).reduce.buffered and p(1, { grad_dtype = "bf16" }).reduce.buffered)
  -- Offload: host tier; on an accelerator the optimizer reads an fp32
  -- gradient shard in host memory, and stage 2 keeps no gradients on it.
  local off = p(2, { offload_optimizer = "cpu", device = "cuda" })
  assert(off.optimizer.tier == "host" and off.opt_grads.tier == "host" and off.grads.extent == "none")
  assert(p(2, { offload_optimizer = "cpu" }).opt_grads.alias == "grads")
  assert(p(3, { offload_param = "nvme" }).params.tier == "nvme")
  -- Bytes: bf16 stage 2 at 1000 / 250 elements: 2 * 1000 + 4 * 250 device
  -- params + grads, 12 * 250 optimizer.
  local by = s2:bytes{ full = 1000, shard = 250 }
  assert(by.device.params == 2000 and by.device.grads == 1000 and by.device.optimizer == 3000)
  -- The optimizer's states: Lion keeps one, 4 bytes per shard element.
  local lion = Placement.new{ stage = 2, dtype = "bf16", optimizer_states = { "m" } }
  assert(lion:bytes{ full = 1000, shard = 250 }.device.optimizer == 2000)
  local ok, err = pcall(Placement.new, { stage = 0, offload_optimizer = "cpu" })
  assert(not ok and err == "plan: offload_optimizer needs stage 1, 2 or 3", err)
  ok, err = pcall(Placement.new, { stage = 2, offload_param = "cpu" })
  assert(not ok and err == "plan: offload_param needs stage 3", err)
end

function T.the_plan_prints_what_lives_where()
  local text = tostring(Placement.new{ stage = 3, dtype = "bf16", offload_optimizer = "nvme" })
  assert(text:find("ZeRO stage 3 on cpu: working bf16, gradients f32", 1, true), text)
  assert(text:find("params     shard       bf16  device, gathered per module", 1, true), text)
  assert(text:find("m          shard       f32   nvme", 1, true), text)
  assert(text:find("after step gather persistent", 1, true), text)
end

-- The modes the engine reads from the plan rather than from its buffers:
-- where reductions add and whether they are copied off the device first,
-- whether gathered slices are copied to the device, whether the updated
-- working shard is pushed from the host, which states the host reads
-- through a copy; and the stage rules the config and the estimate share.
function T.the_engine_s_modes_are_plan_fields()
  local function p(o) o.dtype = o.dtype or "bf16"; return Placement.new(o) end
  local cpu2 = p{ stage = 2, offload_optimizer = "cpu" }
  assert(cpu2.reduce.dst == "grads" and not cpu2.reduce.to_host and not cpu2.push_params)
  local sim2 = p{ stage = 2, offload_optimizer = "cpu", device = "sim" }
  assert(sim2.reduce.dst == "opt_grads" and sim2.reduce.to_host and sim2.push_params)
  local sim1 = p{ stage = 1, offload_optimizer = "cpu", device = "sim" }
  assert(sim1.reduce.dst == "grads" and not sim1.reduce.to_host and sim1.push_params)
  assert(not p{ stage = 2, device = "sim" }.push_params)
  -- Stage 3: a host or NVMe parameter shard is copied to the device per
  -- gather on an accelerator; on the cpu it is read where it is.
  assert(p{ stage = 3, offload_optimizer = "cpu", offload_param = "cpu", device = "sim" }
         .params.upload)
  assert(not p{ stage = 3, offload_optimizer = "cpu", offload_param = "cpu" }.params.upload)
  assert(not p{ stage = 3, device = "sim" }.params.upload and not p{ stage = 2 }.params.upload)
  assert(p{ stage = 3, offload_optimizer = "cpu", offload_param = "nvme", device = "sim" }
         .params.upload)
  -- The host reads device-tier states through a copy only on an accelerator.
  assert(p{ stage = 0, device = "sim" }:on_device("master"))
  assert(not p{ stage = 0 }:on_device("master"))
  assert(not sim2:on_device("optimizer") and sim2:on_device("params"))
  -- The push is printed; a cpu plan has none.
  assert(tostring(sim2):find("push       the updated working shard from the host to the device",
                             1, true), tostring(sim2))
  assert(not tostring(cpu2):find("push", 1, true), tostring(cpu2))
  -- Which stage each offload needs: one rule, read here, by the config and
  -- by the estimate (nil rows where DeepSpeed has none).
  assert(Placement.stage_allows("offload_optimizer", 1) and
         not Placement.stage_allows("offload_optimizer", 0))
  assert(Placement.stage_allows("offload_param", 3) and
         not Placement.stage_allows("offload_param", 2))
  local estimate = require("luazero.estimate")
  assert(estimate.model_states(1000, 2, 0, { offload = "cpu" }) == nil)
  assert(estimate.model_states(1000, 2, 2, { offload = "cpu+param" }) == nil)
  assert(estimate.model_states(1000, 2, 3, { offload = "cpu+param" }) ~= nil)
end

local text = ("Now is the winter of our discontent\nMade glorious summer by this sun of York;\n")
             :rep(40)
local corpus = write_file("corpus.txt", text)
os.execute("mkdir -p " .. q(tmp .. "/nvme"))

local function plan_check(n, device)
  local cmd = ("cd %s && %s %s tests/lua/plan_check.lua %s %s %s 2>&1")
              :format(q(lz.root), q(lz.executable()), n > 1 and ("-n " .. n) or "", q(corpus),
                      q(tmp .. "/nvme"), device or "cpu")
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  local oks = select(2, out:gsub("\nok   ", "")) + (out:find("^ok   ") and 1 or 0)
  -- 2 optimizers x 2 dtypes x (4 + 3 + 3 + 2) stage/offload combinations
  assert(out:find("done: 0 bad", 1, true) and oks == 48, out)
  print(("    world %d on %s: %d combinations match the ledger (and estimate where it has " ..
         "them)"):format(n, device or "cpu", oks))
end

function T.plan_bytes_equal_the_ledger_and_estimate_at_world_1() plan_check(1) end
function T.plan_bytes_equal_the_ledger_and_estimate_at_world_2() plan_check(2) end
-- On a device: device bytes from the device's ledger, host bytes from the host's.
function T.plan_bytes_equal_the_device_and_host_ledgers_on_sim_at_world_2() plan_check(2, "sim") end

-- tools/estimate prints the plan's bytes: every row of gpt2-nano at world 2
-- (--device cpu and cuda, bf16 and fp32) against the plan built here.
function T.tools_estimate_prints_the_plans_bytes()
  local gpt2 = require("models.gpt2")
  local layout = require("luazero.zero.layout")
  local estimate = require("luazero.estimate")
  local L = layout.new(gpt2.new(gpt2.config("gpt2-nano")).param_table, 2)
  local persistent = 0
  for _, seg in ipairs(L.segments) do
    if seg.numel <= 100000 then persistent = persistent + seg.padded end
  end
  local rows = 0
  for _, device in ipairs({ "cpu", "cuda" }) do
    for _, dtype in ipairs({ "bf16", "fp32" }) do
      local p = io.popen(("cd %s && %s tools/estimate.lua --model gpt2-nano --world 2 " ..
                          "--device %s --dtype %s 2>&1"):format(q(lz.root), q(lz.executable()),
                                                               device, dtype))
      local out = p:read("*a")
      p:close()
      for stage, offload, dev, cpu in out:gmatch("\n(%d)%s+(%S+)%s+([%d,]+)%s+%S+ GiB%s+([%d,]+)") do
        local plan = estimate.plan(tonumber(stage), dtype, offload, nil, device)
        local by = plan:bytes{ full = L.full_numel, shard = L.shard_numel, persistent = persistent }
        local function n(text) return tonumber((text:gsub(",", ""))) end
        assert(n(dev) == by.device.total and n(cpu) == by.host.total,
               ("%s %s stage %s %s: tools/estimate %s | %s, the plan %d | %d")
               :format(device, dtype, stage, offload, dev, cpu, by.device.total, by.host.total))
        rows = rows + 1
      end
    end
  end
  assert(rows == 4 * 8, ("%d rows read"):format(rows))
end

return T
