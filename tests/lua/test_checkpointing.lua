-- test_checkpointing.lua — activation checkpointing (models/gpt2.lua,
-- nn/checkpoint.lua, the engine's recompute hooks): bitwise the same
-- gradients and parameters as without it (every placement of the kept
-- inputs, stages 0 and 3, world 1 and 2, fp32 and bf16), the hooks a
-- replay calls, arenas sized to the byte, and the activation memory of
-- GPT-2 124M down by more than 3x.
local bit = require("bit")
local cjson = require("cjson")
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local gpt2 = require("models.gpt2")

local T = {}
local q = support.quote
local write_file, tmp = support.scratch()

local function grads_hash(m)
  return bit.tohex(lz.xxh64(m.grads_flat.data, m.grads_flat:bytes(), 0), 16)
end

local function batch(B, S, vocab)
  local x, y = lz.tensor({ B, S }, "i32", "workspace"), lz.tensor({ B, S }, "i32", "workspace")
  for i = 0, B * S - 1 do x:set(i, (i * 7919) % vocab); y:set(i, (i * 104729 + 1) % vocab) end
  return x, y
end

-- Two micro-steps of forward + backward (gradients accumulate); returns the
-- last loss, the gradients' hash and the model (still allocated).
local function two_steps(cfg, ck, B, S)
  local m = gpt2.new(cfg):allocate():init_weights(5)
  if ck ~= nil then m:checkpoint_activations(ck) end
  m:prepare(B, S)
  local x, y = batch(B, S, cfg.vocab)
  m:zero_grad()
  local loss
  for _ = 1, 2 do
    loss = m:forward(x, y)
    m:backward(0.5)
  end
  x:free(); y:free()
  return loss, grads_hash(m), m
end

local NANO = { n_layer = 3, n_embd = 64, n_head = 4, context = 32 }
local ALIGN = 64
local function aligned(n) return math.ceil(n / ALIGN) * ALIGN end

-------------------------------------------------- in one process, bitwise

function T.every_placement_gives_bitwise_the_same_gradients_and_arenas_fit()
  local cfg = gpt2.config("gpt2-nano", NANO)
  local B, S = 2, 24
  local loss0, hash0, m0 = two_steps(cfg, nil, B, S)
  m0:free()
  local kept = aligned(B * S * cfg.n_embd * 4) -- one block input, f32
  local variants = {
    { name = "default", opts = true, offload = 0 },
    { name = "cpu_checkpointing", opts = { cpu_checkpointing = true },
      offload = NANO.n_layer * kept },
    { name = "contiguous, 5 slots", offload = 0, buffer = 5 * kept,
      opts = { contiguous_memory_optimization = true, number_checkpoints = 5 } },
    { name = "contiguous + cpu", offload = NANO.n_layer * kept,
      opts = { contiguous_memory_optimization = true, cpu_checkpointing = true } },
  }
  for _, v in ipairs(variants) do
    support.settle()
    local before = lz.mem()
    local loss, hash, m = two_steps(cfg, v.opts, B, S)
    local mem = lz.mem()
    print(("    %-20s loss %.6f grads %s; offload %d bytes"):format(v.name, loss, hash,
          mem.offload - before.offload))
    assert(loss == loss0, ("%s: loss %.17g != %.17g"):format(v.name, loss, loss0))
    assert(hash == hash0, ("%s: gradients %s != %s without checkpointing"):format(v.name, hash,
           hash0))
    assert(mem.offload - before.offload == v.offload,
           ("%s: offload %d bytes, expected %d"):format(v.name, mem.offload - before.offload,
                                                        v.offload))
    local ck = m.ckpt
    if v.buffer then assert(ck.store.buffer:bytes() == v.buffer, "contiguous buffer size") end
    -- Sized to the byte: each arena's peak is its capacity.
    assert(m.ctx.arena:peak() == m.ctx.arena:capacity(), v.name .. ": model arena sized exactly")
    assert(ck.block:peak() == ck.block:capacity(), v.name .. ": block arena sized exactly")
    assert(ck.head:peak() == ck.head:capacity(), v.name .. ": head arena sized exactly")
    assert(m.ctx.scratches[1]:peak() == m.ctx.scratches[1]:capacity(), "scratch sized exactly")
    -- Forward alone (sampling) works on the same arenas.
    assert(#m:generate({ 1, 2, 3 }, 4, 1) == 7)
    m:free()
  end
  local ok, err = pcall(two_steps, cfg, { contiguous_memory_optimization = true,
                                           number_checkpoints = 2 }, B, S)
  assert(not ok and err == "activation_checkpointing.number_checkpoints is 2 but the model " ..
         "checkpoints 3 blocks; raise it to 3 or leave it null", tostring(err))
end

-- The replay runs no forward hook: the hooks see the same forward and
-- backward as without checkpointing (what the ZeRO-3 engine records its
-- prefetch order from), with pre_recompute/post_recompute around each
-- block's replay and backward.
function T.a_replay_calls_only_the_recompute_hooks()
  local cfg = gpt2.config("gpt2-nano", { n_layer = 2, n_embd = 32, n_head = 2, context = 16 })
  local logs = {}
  for _, ck in ipairs({ false, true }) do
    local m = gpt2.new(cfg):allocate():init_weights(1)
    m:checkpoint_activations(ck)
    m:prepare(1, 8)
    local log = {}
    for _, kind in ipairs({ "pre_forward", "post_forward", "pre_backward", "post_backward",
                            "pre_recompute", "post_recompute" }) do
      m:register_hook(kind, function(mod) log[#log + 1] = kind .. " " .. mod.path end)
    end
    local x, y = batch(1, 8, cfg.vocab)
    m:forward(x, y)
    m:backward(1)
    logs[ck] = log
    m:free()
  end
  local plain = {}
  for _, l in ipairs(logs[true]) do
    if not l:find("recompute", 1, true) then plain[#plain + 1] = l end
  end
  assert(table.concat(plain, "\n") == table.concat(logs[false], "\n"),
         "checkpointing changed the forward/backward hooks")
  local joined = table.concat(logs[true], "\n")
  assert(joined:find("pre_recompute transformer.h.1\npre_backward transformer.h.1\n", 1, true),
         joined)
  assert(joined:find("post_backward transformer.h.1\npost_recompute transformer.h.1\n" ..
                     "pre_recompute transformer.h.0\n", 1, true), joined)
  assert(#logs[true] == #logs[false] + 4)
end

------------------------------------------------ GPT-2 124M activation memory

-- The ledger's activations category once the arenas are allocated, without
-- and with checkpointing, at B = 4, T = 64: 12 blocks' activations, the
-- logits and two scratch arenas, against the kept inputs and one shared
-- region (logits, or one block's replay with the scratch arenas).
function T.gpt2_124m_activation_memory_drops_more_than_3x()
  local B, S = 4, 64
  local function prepared(ck)
    local m = gpt2.new(gpt2.config("gpt2"))
    m:checkpoint_activations(ck)
    support.settle()
    local a0 = lz.mem().activations
    m:prepare(B, S)
    local bytes = lz.mem().activations - a0
    m:free()
    return bytes
  end
  local off, on = prepared(false), prepared(true)
  print(("    gpt2 B=%d T=%d activations: %.1f MiB without, %.1f MiB with checkpointing: %.2fx")
        :format(B, S, off / 2 ^ 20, on / 2 ^ 20, off / on))
  assert(off / on >= 3, ("activations drop %.2fx, expected >= 3x"):format(off / on))
  -- The same layout at GPT-2's width and vocabulary, two blocks: one forward
  -- and backward stays inside the allocated arenas (the peak is what was
  -- allocated) and gives bitwise the same gradients.
  local cfg = gpt2.config("gpt2", { n_layer = 2 })
  local hashes = {}
  for _, ck in ipairs({ false, true }) do
    local m = gpt2.new(cfg):allocate():init_weights(3)
    m:checkpoint_activations(ck)
    support.settle()
    local a0 = lz.mem().activations
    m:prepare(B, S)
    local allocated = lz.mem().activations
    lz.C.lz_mem_reset_peak()
    local x, y = batch(B, S, cfg.vocab)
    m:zero_grad()
    m:forward(x, y)
    m:backward(1)
    local peak = tonumber(lz.C.lz_mem_peak(lz.C.LZ_MEM_ACTIVATIONS))
    assert(peak == allocated, ("%s: activations peak %d, %d allocated"):format(tostring(ck), peak,
           allocated))
    print(("    gpt2 width, 2 blocks, checkpointing %s: activations %.1f MiB")
          :format(tostring(ck), (allocated - a0) / 2 ^ 20))
    hashes[ck] = grads_hash(m)
    x:free(); y:free()
    m:free()
  end
  assert(hashes[true] == hashes[false], "gradients differ: " .. hashes[true] .. " " ..
         hashes[false])
end

------------------------------------------- end to end: train.lua, ZeRO

local text = ("To be, or not to be, that is the question:\n" ..
              "Whether 'tis nobler in the mind to suffer\n"):rep(60)
local corpus = write_file("corpus.txt", text)
local MODEL = { n_layer = 2, n_embd = 64, n_head = 4, context = 32 }
local model_flags = ("--model gpt2-nano --n-layer %d --n-embd %d --n-head %d --context %d " ..
                     "--seq-len 16 --sample 0 --eval-batches 1 --seed 7 --steps 4")
                    :format(MODEL.n_layer, MODEL.n_embd, MODEL.n_head, MODEL.context)

local function config_file(name, ac)
  return write_file(name, cjson.encode({
    train_batch_size = 4, gradient_clipping = 1.0,
    optimizer = { type = "AdamW", params = { lr = 3e-3, betas = { 0.9, 0.95 },
                                             weight_decay = 0.1 } },
    zero_optimization = { stage3_param_persistence_threshold = 128, overlap_comm = true,
                          reduce_bucket_size = 20000, stage3_prefetch_bucket_size = 20000 },
    activation_checkpointing = ac,
  }))
end

local configs = {
  plain = config_file("plain.json", nil),
  default = config_file("default.json", { partition_activations = true, profile = true }),
  cpu = config_file("cpu.json", { cpu_checkpointing = true }),
  contiguous = config_file("contiguous.json", { contiguous_memory_optimization = true,
                                                number_checkpoints = 4 }),
  both = config_file("both.json", { cpu_checkpointing = true,
                                    contiguous_memory_optimization = true }),
}

local n_runs = 0
local function train(n, stage, dtype, cfg, ckpt)
  n_runs = n_runs + 1
  local log = ("%s/run%d.jsonl"):format(tmp, n_runs)
  local cmd = ("cd %s && %s %s scripts/train.lua %s --data %s --config %s --stage %d --dtype %s " ..
               "--log %s %s 2>&1; echo \"EXIT:$?\"")
              :format(q(lz.root), q(lz.executable()), n > 1 and ("-n " .. n) or "", model_flags,
                      q(corpus), q(configs[cfg]), stage, dtype, q(log),
                      ckpt and "--checkpoint-activations" or "")
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  assert(tonumber(out:match("EXIT:(%d+)%s*$")) == 0, ("world %d stage %d %s %s failed:\n%s")
         :format(n, stage, dtype, cfg, out))
  local recs = support.records(log)
  return { out = out, recs = recs, checksum = recs[#recs].params_checksum }
end

function T.training_ends_with_the_same_checksum_at_stages_0_and_3_world_1_and_2()
  local base = {}
  for _, n in ipairs({ 1, 2 }) do
    for _, dtype in ipairs({ "fp32", "bf16" }) do
      base[n .. dtype] = train(n, 0, dtype, "plain", false)
    end
  end
  local cases = {
    { 1, 0, "fp32", "default" }, { 1, 3, "bf16", "cpu" },
    { 2, 0, "fp32", "contiguous" }, { 2, 3, "fp32", "default" },
    { 2, 0, "bf16", "both" }, { 2, 3, "bf16", "contiguous" },
  }
  local B = { 4, 2 } -- micro-batch per rank at world 1, 2
  for _, c in ipairs(cases) do
    local n, stage, dtype, cfg = c[1], c[2], c[3], c[4]
    local r = train(n, stage, dtype, cfg, true)
    local want = base[n .. dtype].checksum
    print(("    world %d stage %d %s %-10s %s (without: %s)"):format(n, stage, dtype, cfg,
          r.checksum, want))
    assert(r.checksum == want, ("world %d stage %d %s %s: checksum %s != %s without " ..
           "checkpointing"):format(n, stage, dtype, cfg, r.checksum, want))
    assert(r.out:find("activation checkpointing: 2 blocks keep their inputs", 1, true), r.out)
    -- cpu_checkpointing: the kept inputs are on the offload category.
    local kept = (cfg == "cpu" or cfg == "both") and 2 * aligned(B[n] * 16 * 64 * 4) or 0
    assert(r.recs[4].mem.offload == kept, ("offload %d bytes, expected %d")
           :format(r.recs[4].mem.offload, kept))
  end
  -- partition_activations is reported as having no effect; profile times
  -- the checkpointed blocks.
  local r = train(1, 0, "fp32", "default", true)
  assert(r.out:find("config: no effect here: [^\n]*activation_checkpointing%.partition_activations"),
         r.out)
  local prof = r.recs[1].checkpoint_ms
  assert(prof and prof.forward > 0 and prof.recompute > 0 and prof.backward > 0, r.out)
  -- Without the flag the block only configures: it says so.
  r = train(1, 0, "fp32", "default", false)
  assert(r.out:find("activation_checkpointing has no effect without --checkpoint-activations",
                    1, true), r.out)
  assert(r.recs[1].checkpoint_ms == nil)
  -- Stage 3: one gather serves a block's replay and backward, so the bytes
  -- gathered per step are those of a run without checkpointing.
  local a = train(2, 3, "fp32", "plain", false).recs[3].comm
  local b = train(2, 3, "fp32", "contiguous", true).recs[3].comm
  assert(a.all_gather == b.all_gather and a.reduce_scatter == b.reduce_scatter,
         ("stage 3 bytes: all_gather %d vs %d, reduce_scatter %d vs %d"):format(
           a.all_gather, b.all_gather, a.reduce_scatter, b.reduce_scatter))
end

function T.too_few_number_checkpoints_is_one_line_naming_the_key()
  local cfg = write_file("few.json", cjson.encode({
    train_batch_size = 4,
    activation_checkpointing = { contiguous_memory_optimization = true, number_checkpoints = 1 },
  }))
  local p = io.popen(("cd %s && %s scripts/train.lua %s --data %s --config %s " ..
                      "--checkpoint-activations 2>&1; echo \"EXIT:$?\"")
                     :format(q(lz.root), q(lz.executable()), model_flags, q(corpus), q(cfg)))
  local out = p:read("*a")
  p:close()
  assert(tonumber(out:match("EXIT:(%d+)%s*$")) == 2, out)
  assert(out:find("train: activation_checkpointing.number_checkpoints is 1 but the model " ..
                  "checkpoints 2 blocks; raise it to 2 or leave it null\n", 1, true), out)
end

return T
