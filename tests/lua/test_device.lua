-- test_device.lua — training on a device: scripts/train.lua --device sim
-- (a device whose memory the host cannot touch and whose streams run
-- asynchronously, every queued op delayed at random by LZ_SIM_JITTER)
-- against --device cpu. The same params_checksum for stages 0-3 at world 1
-- and 2, fp32 and bf16, accumulation, activation checkpointing, each
-- offload tier and save -> resume; the device ledger and the bytes copied
-- each way against the plan's formulas; running out of device memory.
local cjson = require("cjson")
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local gpt2 = require("models.gpt2")

local T = {}

local write_file, tmp, corpus = support.scratch_corpus(support.HAMLET, 60)
local MODEL = { n_layer = 2, n_embd = 64, n_head = 4, context = 32 }
local B, SEQ, THRESHOLD = 2, 16, 128
local model_flags = ("--model gpt2-nano --n-layer %d --n-embd %d --n-head %d --context %d " ..
                     "--seq-len %d --sample 0 --eval-batches 1 --seed 7 --data %s")
                    :format(MODEL.n_layer, MODEL.n_embd, MODEL.n_head, MODEL.context, SEQ,
                            support.quote(corpus))
local train, ok_train = support.trainer(model_flags)
local JITTER = "LZ_SIM_JITTER=11"

local n_configs = 0
-- A DeepSpeed config: stage, dtype ("fp32", "bf16"), zero_optimization
-- extras, top-level extras.
local function config(stage, dtype, zero, top)
  local z = { stage = stage, stage3_param_persistence_threshold = THRESHOLD,
              reduce_bucket_size = 20000, sub_group_size = 4096, overlap_comm = true,
              stage3_prefetch_bucket_size = 20000 }
  for k, v in pairs(zero or {}) do z[k] = v end
  local c = { train_micro_batch_size_per_gpu = B, gradient_accumulation_steps = 1,
              gradient_clipping = 1.0, zero_optimization = z,
              bf16 = { enabled = dtype == "bf16" },
              optimizer = { type = "AdamW", params = { lr = 3e-3, weight_decay = 0.1 } } }
  for k, v in pairs(top or {}) do c[k] = v end
  n_configs = n_configs + 1
  return write_file(("config%d.json"):format(n_configs), cjson.encode(c))
end

local nvme = tmp .. "/nvme"
os.execute("mkdir -p " .. support.quote(nvme))

local function sum_of(n, device, cfg, extra)
  local _, sum = ok_train(n, ("--steps 3 --device %s --config %s %s"):format(device, cfg,
                                                                             extra or ""),
                          device == "sim" and JITTER or nil)
  return sum
end

-- The cpu's checksum for (world, dtype, extra), memoised: every stage gives it.
local cpu_sums = {}
local function cpu_sum(n, dtype, extra, top)
  local key = table.concat({ n, dtype, extra or "", cjson.encode(top or {}) }, "|")
  if not cpu_sums[key] then cpu_sums[key] = sum_of(n, "cpu", config(0, dtype, nil, top), extra) end
  return cpu_sums[key]
end

function T.sim_gives_the_cpus_checksum_at_every_stage_world_1_and_2()
  for _, n in ipairs({ 1, 2 }) do
    for _, dtype in ipairs({ "fp32", "bf16" }) do
      local want = cpu_sum(n, dtype)
      for stage = 0, 3 do
        local got = sum_of(n, "sim", config(stage, dtype))
        assert(got == want, ("world %d %s stage %d on sim: %s, on cpu %s"):format(n, dtype, stage,
                                                                             got, want))
      end
    end
  end
end

function T.sim_gives_the_cpus_checksum_with_accumulation_checkpointing_and_offload()
  local accum = { gradient_accumulation_steps = 2 }
  for _, c in ipairs({ { 2, "bf16" }, { 1, "fp32" } }) do
    local n, dtype = c[1], c[2]
    local want = cpu_sum(n, dtype, nil, accum)
    for _, stage in ipairs({ 0, 1, 2, 3 }) do
      local got = sum_of(n, "sim", config(stage, dtype, nil, accum))
      assert(got == want, ("world %d %s accumulation 2, stage %d on sim: %s, on cpu %s")
                          :format(n, dtype, stage, got, want))
    end
  end
  for _, stage in ipairs({ 0, 3 }) do
    local got = sum_of(1, "sim", config(stage, "fp32"), "--checkpoint-activations")
    assert(got == cpu_sum(1, "fp32"), ("world 1 fp32 checkpointing, stage %d on sim: %s")
                                      :format(stage, got))
  end
  want = cpu_sum(2, "bf16")
  local cases = {
    { "activation checkpointing, stage 2", config(2, "bf16"), "--checkpoint-activations" },
    { "activation checkpointing, stage 3", config(3, "bf16"), "--checkpoint-activations" },
    { "activation checkpointing with the kept inputs in host memory, stage 2",
      config(2, "bf16", nil, { activation_checkpointing = { cpu_checkpointing = true } }),
      "--checkpoint-activations" },
    { "offload_optimizer cpu, stage 1", config(1, "bf16", { offload_optimizer = { device = "cpu" } }) },
    { "offload_optimizer cpu, stage 2", config(2, "bf16", { offload_optimizer = { device = "cpu" } }) },
    { "offload_optimizer cpu + offload_param cpu, stage 3",
      config(3, "bf16", { offload_optimizer = { device = "cpu" }, offload_param = { device = "cpu" } }) },
    { "offload_optimizer nvme, stage 2",
      config(2, "bf16", { offload_optimizer = { device = "nvme", nvme_path = nvme } }) },
    { "parameters and optimizer on nvme, stage 3",
      config(3, "bf16", { offload_optimizer = { device = "nvme", nvme_path = nvme },
                          offload_param = { device = "nvme", nvme_path = nvme,
                                            buffer_size = 1000000 } }) },
  }
  for _, c in ipairs(cases) do
    local got = sum_of(2, "sim", c[2], c[3])
    assert(got == want, ("%s on sim: %s, on cpu %s"):format(c[1], got, want))
  end
  -- fp32 with the optimizer on the host: the master is a host copy of
  -- the device's fp32 parameters.
  local got = sum_of(1, "sim", config(2, "fp32", { offload_optimizer = { device = "cpu" } }))
  assert(got == cpu_sum(1, "fp32"), "fp32 offload_optimizer cpu on sim: " .. got)
end

-- Llama (grouped-query attention, rotary embeddings, RMSNorm, SwiGLU) on
-- sim: the cpu's checksum too.
function T.llama_on_sim_gives_the_cpus_checksum()
  local flags = "--model llama-tiny --seq-len 16 --sample 0 --eval-batches 1 --seed 7 --data " ..
                support.quote(corpus)
  local function run(device, cfg)
    local out, st = support.sh(("cd %s && %s %s -n 2 scripts/train.lua %s --steps 3 --device %s " ..
                                "--config %s"):format(support.quote(lz.root),
                               device == "sim" and JITTER or "", support.quote(lz.executable()),
                               flags, device, cfg))
    assert(st == 0, out)
    return assert(out:match("params_checksum (%x+)"), out)
  end
  local want = run("cpu", config(0, "bf16"))
  for _, cfg in ipairs({ config(0, "bf16"), config(3, "bf16"),
                         config(2, "bf16", { offload_optimizer = { device = "cpu" } }) }) do
    local got = run("sim", cfg)
    assert(got == want, ("llama-tiny on sim (%s): %s, on cpu %s"):format(cfg, got, want))
  end
end

-- Every MoE family on sim: Qwen2-MoE's shared expert and its gate, OLMoE's
-- whole-projection QK-norm and its clip_qkv (0.3 here, which clamps many of
-- the normed q and k values), Mixtral's router jitter (0.1; on the host, a
-- copy each way), at stages 0 and 3, fp32 and bf16, on the cpu's checksum.
function T.moe_families_on_sim_give_the_cpus_checksum()
  local olmoe = write_file("olmoe.json", cjson.encode({
    architectures = { "OlmoeForCausalLM" }, model_type = "olmoe", num_hidden_layers = 2,
    num_attention_heads = 4, num_key_value_heads = 2, hidden_size = 64, intermediate_size = 32,
    max_position_embeddings = 256, vocab_size = 256, rms_norm_eps = 1e-5, rope_theta = 10000,
    tie_word_embeddings = false, num_experts = 8, num_experts_per_tok = 2, clip_qkv = 0.3,
    norm_topk_prob = false, output_router_logits = true, router_aux_loss_coef = 0.01 }))
  local mixtral = write_file("mixtral.json", cjson.encode({
    architectures = { "MixtralForCausalLM" }, model_type = "mixtral", num_hidden_layers = 2,
    num_attention_heads = 4, num_key_value_heads = 2, hidden_size = 64, intermediate_size = 48,
    max_position_embeddings = 256, vocab_size = 256, rms_norm_eps = 1e-5, rope_theta = 1e6,
    tie_word_embeddings = false, num_local_experts = 8, num_experts_per_tok = 2,
    output_router_logits = true, router_aux_loss_coef = 0.02, router_jitter_noise = 0.1 }))
  for _, model in ipairs({ "--model qwen2-moe-tiny", "--model qwen3-moe-tiny",
                           "--model-config " .. olmoe, "--model-config " .. mixtral }) do
    local flags = ("%s --seq-len 16 --sample 0 --eval-batches 1 --seed 7 --data %s")
                  :format(model, support.quote(corpus))
    for _, dtype in ipairs({ "fp32", "bf16" }) do
      local function run(device, cfg)
        local out, st = support.sh(("cd %s && %s %s scripts/train.lua %s --steps 2 --device %s " ..
                                    "--config %s"):format(support.quote(lz.root),
                                   device == "sim" and JITTER or "",
                                   support.quote(lz.executable()), flags, device, cfg))
        assert(st == 0, out)
        return assert(out:match("params_checksum (%x+)"), out)
      end
      local want = run("cpu", config(0, dtype))
      for _, stage in ipairs({ 0, 3 }) do
        local got = run("sim", config(stage, dtype))
        assert(got == want, ("%s %s on sim at stage %d: %s, on cpu %s"):format(model, dtype,
                                                                              stage, got, want))
      end
    end
  end
end

function T.save_on_sim_resumes_on_sim_and_on_cpu_to_the_same_checksum()
  -- The optimizer's states on the device (stage 1), and in host memory (stage 3).
  for i, cfg in ipairs({ config(1, "bf16"),
                         config(3, "bf16", { offload_optimizer = { device = "cpu" } }) }) do
    local dir = ("%s/ckpt%d"):format(tmp, i)
    local _, whole = ok_train(2, ("--steps 4 --device sim --config %s"):format(cfg), JITTER)
    ok_train(2, ("--steps 2 --device sim --config %s --save %s"):format(cfg, dir), JITTER)
    for _, device in ipairs({ "sim", "cpu" }) do
      local _, resumed = ok_train(2, ("--steps 4 --device %s --config %s --resume %s")
                                     :format(device, cfg, dir),
                                  device == "sim" and JITTER or nil)
      assert(resumed == whole, ("%s resumed on %s: %s, uninterrupted %s"):format(cfg, device,
                                                                                 resumed, whole))
    end
  end
end

-- A world-2 stage-3 checkpoint saved on sim loads at world 1, stage 1, on
-- sim: the same weights (a resume at the step it was saved runs no step).
function T.a_sim_checkpoint_reshards_on_sim()
  local dir = tmp .. "/reshard"
  local _, saved = ok_train(2, ("--steps 2 --device sim --config %s --save %s")
                               :format(config(3, "bf16"), dir), JITTER)
  local _, loaded = ok_train(1, ("--steps 2 --device sim --config %s --resume %s")
                                :format(config(1, "bf16"), dir), JITTER)
  assert(loaded == saved, ("resharded %s, saved %s"):format(loaded, saved))
end

------------------------------------------------------------ bytes and tiers

-- The log records of one sim run.
local function records(n, cfg, extra)
  local log = ("%s/log%d.jsonl"):format(tmp, n_configs)
  ok_train(n, ("--steps 2 --device sim --config %s --log %s %s"):format(cfg, log, extra or ""),
           JITTER)
  local recs = support.records(log)
  return recs
end

local function the_layout(world) return support.gpt2_layout(MODEL, world) end

-- Batches move as i32 tokens and targets (host to device) and the
-- per-position losses come back (device to host), every micro-step.
local BATCH_H2D, BATCH_D2H = 2 * B * SEQ * 4, B * SEQ * 4

function T.zero_offload_stage_2_bf16_holds_2psi_on_the_device_and_16psi_over_n_on_the_host()
  local W = 2
  local L = the_layout(W)
  local F, S = L.full_numel, L.shard_numel
  local rec = records(W, config(2, "bf16", { offload_optimizer = { device = "cpu" } }))[2]
  local dev, host = rec.dev_mem, rec.mem
  -- Device: the bf16 working parameters, whole; no gradient shard, no
  -- optimizer states; gradient buckets under comm (reduce_bucket_size).
  assert(dev.params == 2 * F, ("device params %d, want 2 x %d"):format(dev.params, F))
  assert(dev.grads == 0 and dev.optimizer == 0, cjson.encode(dev))
  assert(dev.comm > 0 and dev.comm <= 2 * 20000 * 4 + 4 * F,
         ("device comm %d: gradient buckets beyond reduce_bucket_size"):format(dev.comm))
  -- Host: fp32 master, m, v and gradients of the shard (16 bytes each),
  -- plus the stated buffers: the bf16 staging of the updated working
  -- shard (2 bytes each) and the reduced-gradient staging (at most one
  -- segment's slice in flight per bucket, fp32).
  local states = 16 * S
  local staging = 2 * S
  local slack = host.offload - states - staging
  assert(slack >= 0 and slack <= 0.02 * states + 2 * 20000 * 4,
         ("host offload %d: 16 x %d + 2 x %d + %d"):format(host.offload, S, S, slack))
  assert(host.grads == 0 and host.optimizer == 0 and host.params == 0, cjson.encode(host))
  -- Per step: the reduced gradients come off the device (fp32 shard), the
  -- updated working shard goes on (bf16).
  assert(rec.d2h == 4 * S + BATCH_D2H, ("d2h %d, want 4 x %d + %d"):format(rec.d2h, S, BATCH_D2H))
  assert(rec.h2d == 2 * S + BATCH_H2D, ("h2d %d, want 2 x %d + %d"):format(rec.h2d, S, BATCH_H2D))
  -- The NVMe tier: the same device and the same crossings; the host keeps
  -- staging only, the states go to the swap file.
  local nv = records(W, config(2, "bf16", { offload_optimizer = { device = "nvme",
                                                                   nvme_path = nvme } }))[2]
  assert(nv.dev_mem.params == 2 * F and nv.dev_mem.grads == 0 and nv.dev_mem.optimizer == 0,
         cjson.encode(nv.dev_mem))
  assert(nv.d2h == rec.d2h and nv.h2d == rec.h2d, ("nvme: h2d %d, d2h %d"):format(nv.h2d, nv.d2h))
  assert(nv.nvme_read > 0 and nv.nvme_written > 0, cjson.encode(nv))
end

function T.zero_3_offload_param_keeps_only_live_modules_and_persistent_params_on_the_device()
  local W = 2
  local L = the_layout(W)
  local S, persistent, gathers, largest = L.shard_numel, 0, 0, 0
  for _, seg in ipairs(L.segments) do
    if seg.numel <= THRESHOLD then
      -- Kept whole on the device, gathered from the host's shard after each step.
      persistent = persistent + seg.padded
      gathers = gathers + seg.slice
    else
      -- Gathered for forward and for backward; the tied LM head reads the
      -- embedding's table once more each way.
      local users = 1
      for _, e in ipairs(seg.entries) do
        if e.entry.name:find("wte", 1, true) then users = 2 end
      end
      gathers = gathers + seg.slice * 2 * users
      largest = math.max(largest, seg.padded)
    end
  end
  local recs = records(W, config(3, "bf16", { offload_optimizer = { device = "cpu" },
                                              offload_param = { device = "cpu" } }))
  local rec = recs[2]
  local dev = rec.dev_mem
  assert(dev.params == 2 * persistent,
         ("device params %d, want the persistent 2 x %d"):format(dev.params, persistent))
  assert(dev.grads == 0 and dev.optimizer == 0, cjson.encode(dev))
  -- Gathered modules and their staging live in comm buffers, bounded by
  -- the prefetch window (stage3_prefetch_bucket_size) and a module's gradients.
  assert(dev.comm <= (20000 + 2 * largest) * 2 + (20000 + largest) * 4,
         ("device comm %d beyond the live modules"):format(dev.comm))
  -- h2d: every gathered slice (bf16) each time it is gathered, and the
  -- batch; d2h: the reduced gradient slices (fp32) and the losses.
  local want_h2d = 2 * gathers + BATCH_H2D
  assert(rec.h2d == want_h2d, ("h2d %d, want %d"):format(rec.h2d, want_h2d))
  assert(rec.d2h == 4 * S + BATCH_D2H, ("d2h %d, want 4 x %d + %d"):format(rec.d2h, S, BATCH_D2H))
  -- Parameters and states on NVMe: the same crossings, read from the swap files.
  local nv = records(W, config(3, "bf16", { offload_optimizer = { device = "nvme", nvme_path = nvme },
                                            offload_param = { device = "nvme", nvme_path = nvme,
                                                              buffer_size = 1000000 } }))[2]
  assert(nv.dev_mem.params == 2 * persistent, cjson.encode(nv.dev_mem))
  assert(nv.h2d == want_h2d and nv.d2h == rec.d2h, ("nvme: h2d %d, d2h %d"):format(nv.h2d, nv.d2h))
end

function T.without_offload_nothing_but_the_batch_crosses()
  local rec = records(2, config(2, "bf16"))[2]
  assert(rec.h2d == BATCH_H2D and rec.d2h == BATCH_D2H,
         ("h2d %d, d2h %d: only the batch (%d, %d) may cross"):format(rec.h2d, rec.d2h, BATCH_H2D,
                                                                  BATCH_D2H))
  assert(rec.mem.offload == 0 and rec.mem.params == 0 and rec.mem.grads == 0 and
         rec.mem.optimizer == 0, "model states in host memory: " .. cjson.encode(rec.mem))
  assert(rec.dev_mem.params > 0 and rec.dev_mem.grads > 0 and rec.dev_mem.optimizer > 0,
         cjson.encode(rec.dev_mem))
end

function T.states_that_do_not_fit_the_device_fail_at_stage_0_and_train_offloaded()
  local small = "LZ_SIM_MEMORY=2560KiB"
  local top = { train_micro_batch_size_per_gpu = 4 }
  local out, status = train(1, ("--steps 1 --device sim --config %s")
                               :format(config(0, "bf16", nil, top)), small)
  assert(status == 2, ("exit %s:\n%s"):format(tostring(status), out))
  local line = out:match("train: ([^\n]*out of device memory[^\n]*)")
  assert(line, out)
  assert(line:find("ZeRO stage 0 with bf16 wants [%d.]+ MiB of device memory per rank"), line)
  assert(line:find("more than the device's 2.5 MiB", 1, true), line)
  assert(line:find("fits", 1, true), line)
  local _, sum = ok_train(1, ("--steps 2 --device sim --config %s")
                             :format(config(3, "bf16", { offload_optimizer = { device = "cpu" },
                                                         offload_param = { device = "cpu" } },
                                            top)), small .. " " .. JITTER)
  assert(sum:match("^%x+$"), sum)
end

------------------------------------------------------------ REPL helpers

-- shards, norms, gather and mem on an engine whose buffers are on sim:
-- the same numbers as on the cpu (host copies where they read memory).
function T.repl_helpers_read_a_sim_engine_as_a_cpu_one()
  local zero = require("luazero.zero")
  local data = require("luazero.data")
  local inspect = require("luazero.ui.inspect")
  local text = lz.read_file(corpus)
  local loaded = data.load(corpus)
  local out = {}
  for _, device in ipairs({ "cpu", "sim" }) do
    local cfg = { train_micro_batch_size_per_gpu = B, bf16 = { enabled = true },
                  zero_optimization = { stage = 3, stage3_param_persistence_threshold = THRESHOLD,
                                        offload_optimizer = { device = "cpu" } },
                  optimizer = { type = "AdamW", params = { lr = 1e-3 } } }
    local model = gpt2.new(gpt2.config("gpt2-nano", MODEL))
    local engine = zero.initialize{ model = model, config = cfg, seed = 3, batch = { B, SEQ },
                                    device = device }
    local loader = data.loader(loaded, { B = B, T = SEQ, seed = 1, vocab = 256 })
    engine:train_batch(loader)
    local g = inspect.gather(engine, "h.0.attn.c_attn.weight")
    local r = { norms = inspect.norms(engine), gather = g:totable(), shards = tostring(inspect.shards(engine)),
                mem = tostring(inspect.mem()), checksum = engine:params_checksum() }
    g:free()
    engine:free()
    loader:free()
    out[device] = r
  end
  assert(#text > 0)
  local c, s = out.cpu, out.sim
  assert(c.checksum == s.checksum, c.checksum .. " vs " .. s.checksum)
  assert(#c.gather == #s.gather and #c.gather > 0)
  for i = 1, #c.gather do assert(c.gather[i] == s.gather[i], "gather differs at " .. i) end
  for i, p in ipairs(c.norms.params) do
    assert(p.norm == s.norms.params[i].norm, p.name .. ": norm differs on sim")
  end
  assert(c.shards == s.shards, "shards differ:\n" .. c.shards .. "\n" .. s.shards)
  assert(s.mem:find("device memory:", 1, true), s.mem)
  loaded.tokens:free()
end

-- shards() reports the engine's own bytes (its plan's, all tiers): another
-- engine and stray tensors alive in the process do not change them.
function T.shards_reports_the_engine_s_own_bytes_whatever_else_is_alive()
  local zero = require("luazero.zero")
  local inspect = require("luazero.ui.inspect")
  local function engine_of(device)
    local cfg = { train_micro_batch_size_per_gpu = B, bf16 = { enabled = true },
                  zero_optimization = { stage = 3, stage3_param_persistence_threshold = THRESHOLD,
                                        offload_optimizer = { device = "cpu" } },
                  optimizer = { type = "AdamW", params = { lr = 1e-3 } } }
    return zero.initialize{ model = gpt2.new(gpt2.config("gpt2-nano", MODEL)), config = cfg,
                            seed = 3, batch = { B, SEQ }, device = device }
  end
  local a = engine_of("cpu")
  local alone = inspect.shards(a).ranks[1].bytes
  local other = engine_of("sim")
  local stray = { lz.tensor({ 100000 }, "f32", "params"), lz.tensor({ 50000 }, "f32", "grads"),
                  lz.tensor({ 70000 }, "f32", "optimizer") }
  local crowded = inspect.shards(a).ranks[1].bytes
  local L, persistent = a.L, 0
  for _, seg in ipairs(L.segments) do
    if seg.persistent then persistent = persistent + seg.padded end
  end
  -- bf16 working shard + persistent, fp32 gradient shard, fp32 master + m + v.
  local want = { params = 2 * (L.shard_numel + persistent), grads = 4 * L.shard_numel,
                 optimizer = 12 * L.shard_numel }
  for cat, b in pairs(want) do
    assert(alone[cat] == b, ("%s: %d bytes alone, the plan says %d"):format(cat, alone[cat], b))
    assert(crowded[cat] == b, ("%s: %d bytes beside another engine, want %d"):format(cat, crowded[cat], b))
  end
  assert(inspect.shards(other).ranks[1].bytes.grads == want.grads)
  for _, t in ipairs(stray) do t:free() end
  other:free()
  a:free()
end

return T
