-- test_nn_memory.lua — the bytes nn modules report (Module:memory) and the
-- arenas nn.Model sizes from them equal, to the byte, what one forward and
-- backward take from those arenas: every module alone, GPT-2 at two sizes
-- and Llama (untied and tied), with and without activation checkpointing, in
-- f32, bf16 and f16.
local bit = require("bit")
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local nn = require("luazero.nn")
local rng = require("luazero.rng")
local config = require("luazero.config")
local gpt2 = require("models.gpt2")
local llama = require("models.llama")

local T = {}

local eq = support.eq

-- Every dtype runs real kernels (bf16 GEMMs widen to f32 where the CPU has
-- no bf16 kernel).
local function with_dtype(_, fn) return fn() end

local DTYPES = { "f32", "bf16", "f16" }

------------------------------------------------------------ the binding

-- lz.arena_bytes rounds as the C arena does (LZ_ARENA_ALIGN).
function T.arena_bytes_is_what_the_arena_takes()
  local a = lz.arena(2 ^ 16)
  local want = 0
  for _, c in ipairs({ { 1, "f32" }, { 3, "bf16" }, { 16, "f32" }, { 17, "f32" }, { 33, "bf16" },
                       { 5, "i32" }, { 100, "f16" } }) do
    a:tensor({ c[1] }, c[2])
    want = want + lz.arena_bytes(c[1], c[2])
    eq(a:used(), want, ("%d x %s"):format(c[1], c[2]))
  end
  eq(lz.arena_bytes(17), 128, "17 f32 in 64-byte units")
  eq(lz.ARENA_ALIGN, 64, "LZ_ARENA_ALIGN")
  a:free()
end

-- checkpoint_activations(true) stands for DeepSpeed's defaults, which the
-- nn layer reads as a table with every key absent: each default is off.
function T.checkpointing_defaults_are_all_off()
  for k, v in pairs(config.activation_checkpointing_defaults) do
    assert(not v, ("activation_checkpointing_defaults.%s is %s: nn.Model reads true as " ..
                   "every setting off"):format(k, tostring(v)))
  end
end

---------------------------------------------------------------- modules

-- Binds a standalone module's parameters in `dtype` (the working copy the
-- engine would give it) and fp32 gradients; returns a free function.
local function bind(m, dtype)
  local entries, n = m:parameter_table()
  local master = lz.tensor({ math.max(n, 1) }, "f32", "workspace")
  rng.new(1, 1):fill_normal(lz.ffi.cast("float *", master.data), n, 0.02)
  local work = lz.tensor({ math.max(n, 1) }, dtype, "workspace"):copy(master)
  local grads = lz.tensor({ math.max(n, 1) }, "f32", "workspace"):zero()
  m:bind(entries, work, grads)
  return function() master:free(); work:free(); grads:free() end
end

local function input(B, S, shape_last, dtype)
  local t = lz.tensor({ B, S, shape_last }, dtype or "f32", "workspace")
  if dtype == "i32" then
    for i = 0, B * S - 1 do t:set(i, (i * 31) % shape_last) end
  else
    rng.new(2, 1):fill_normal(lz.ffi.cast("float *", t.data), B * S * shape_last, 1)
  end
  return t
end

-- One forward and backward of module m on x (of dtype x_dtype) in arenas of
-- its own, its parameters those of `root` (default m); the report must
-- equal each arena's high-water mark.
local function check_module(name, m, x, x_dtype, dy_width, dtype, B, S, root)
  local free = bind(root or m, dtype)
  local ctx = { arena = lz.arena(2 ^ 22), scratch = lz.arena(2 ^ 22), cast_dtype = dtype,
                cast_arena = dtype ~= "f32" and lz.arena(2 ^ 22) or nil }
  m:set_context(ctx)
  local r = m:memory(B, S, dtype)
  with_dtype(dtype, function()
    local y = m:forward(x)
    eq(y:dim(3), dy_width, name .. " output width")
    local dy = lz.tensor({ B, S, dy_width }, "f32", "workspace"):fill(0.01)
    m:backward(dy)
    dy:free()
  end)
  local what = ("%s %s B=%d T=%d"):format(name, dtype, B, S)
  eq(r.activations, ctx.arena:peak(), what .. ": activations")
  eq(r.scratch, ctx.scratch:peak(), what .. ": scratch")
  eq(r.casts, ctx.cast_arena and ctx.cast_arena:peak() or 0, what .. ": casts")
  eq(r.input, lz.arena_bytes(x:numel(), x_dtype), what .. ": input")
  ctx.arena:free(); ctx.scratch:free()
  if ctx.cast_arena then ctx.cast_arena:free() end
  free()
  return r
end

-- GPT-2's pre-norm block: LayerNorm, causal self-attention, the GELU MLP.
local function gpt2_block(C, H)
  return nn.Block.new({ attn_norm = { "ln_1", nn.LayerNorm.new(C) },
                        attn = { "attn", nn.CausalSelfAttention.new(C, H, 0.01) },
                        mlp_norm = { "ln_2", nn.LayerNorm.new(C) },
                        mlp = { "mlp", nn.MLP.new(C, 0.01) } })
end

-- At every dtype: each of cases ({ name, new(), input width, output width }),
-- then embedding ({ name, new() }: token ids in, no input gradient) and
-- tied_head ({ name, new(root) }: the LM head borrowing the table of an
-- embedding it adds to root, padded vocabulary 64).
local function check_modules(cases, embedding, tied_head, C, B, S)
  for _, dtype in ipairs(DTYPES) do
    for _, c in ipairs(cases) do
      local x = input(B, S, c[3])
      local r = check_module(c[1], c[2](), x, "f32", c[4], dtype, B, S)
      assert(r.activations > 0 and r.scratch > 0, c[1])
      x:free()
    end
    local tokens = lz.tensor({ B, S }, "i32", "workspace")
    for i = 0, B * S - 1 do tokens:set(i, (i * 7) % 48) end
    check_module(embedding[1], embedding[2](), tokens, "i32", C, dtype, B, S)
    tokens:free()
    local root = setmetatable({}, nn.Module):init()
    local head = tied_head[2](root)
    local x = input(B, S, C)
    local r = check_module(tied_head[1], head, x, "f32", 64, dtype, B, S, root)
    assert(dtype == "f32" or r.casts > 0, tied_head[1] .. " casts")
    x:free()
  end
end

function T.every_module_reports_the_bytes_its_forward_and_backward_take()
  local C, H, B, S = 32, 2, 2, 5
  local cases = {
    { "Linear", function() return nn.Linear.new(C, 3 * C) end, C, 3 * C },
    { "Linear without bias", function() return nn.Linear.new(C, 24, { bias = false }) end, C, 24 },
    { "PackedLinear", function()
        return nn.PackedLinear.new(C, { { "q_proj", 16 }, { "k_proj", 8 }, { "v_proj", 8 } })
      end, C, 32 },
    -- LoRA's workspaces lie outside the arenas: the wrapper adds no bytes.
    { "LoRA around a Linear", function()
        return nn.LoRA.new(nn.Linear.new(C, 24), { { "", 0, 24 } }, 4, 2)
      end, C, 24 },
    { "LayerNorm", function() return nn.LayerNorm.new(C) end, C, C },
    { "CausalSelfAttention", function() return nn.CausalSelfAttention.new(C, H, 0.01) end, C, C },
    { "MLP", function() return nn.MLP.new(C, 0.01) end, C, C },
    { "Block", function() return gpt2_block(C, H) end, C, C },
    { "Sequential", function()
        return nn.Sequential.new({ gpt2_block(C, H), gpt2_block(C, H) })
      end, C, C },
  }
  check_modules(cases, { "Embedding", function() return nn.Embedding.new(48, 8, C) end },
                { "LMHead", function(root)
                    return nn.TiedHead.new(root:add(false, nn.Embedding.new(64, 8, C)), "wte", "wte",
                                           64)
                  end }, C, B, S)
end

-- Llama's parts: RMSNorm, the SwiGLU MLP, grouped-query attention with its
-- rotary frequencies, the decoder layer, the token embedding, the tied head.
function T.every_llama_module_reports_the_bytes_its_forward_and_backward_take()
  local C, B, S = 32, 2, 5
  local rope = nn.Rope.new({ 1, 0.1, 0.01, 0.001 })
  local cases = {
    { "RMSNorm", function() return nn.RMSNorm.new(C, 1e-5) end, C, C },
    { "SwiGLUMLP", function() return nn.SwiGLUMLP.new(C, 48, 0.02) end, C, C },
    { "GQA", function() return nn.GQA.new(C, 4, 2, 8, rope, 0.02) end, C, C },
    { "Llama's Block", function()
        return nn.Block.new({ attn_norm = { "input_layernorm", nn.RMSNorm.new(C, 1e-5) },
                              attn = { "self_attn", nn.GQA.new(C, 4, 2, 8, rope, 0.02) },
                              mlp_norm = { "post_attention_layernorm", nn.RMSNorm.new(C, 1e-5) },
                              mlp = { "mlp", nn.SwiGLUMLP.new(C, 48, 0.02) } })
      end, C, C },
  }
  check_modules(cases, { "TokenEmbedding", function() return nn.TokenEmbedding.new(48, C) end },
                { "TiedHead", function(root)
                    return nn.TiedHead.new(root:add("embed_tokens", nn.TokenEmbedding.new(64, C)),
                                           "weight", "embed_tokens.weight", 64)
                  end }, C, B, S)
  rope:free()
end

------------------------------------------------------------------ GPT-2

local ENGINE_DTYPE = { f32 = "fp32", bf16 = "bf16", f16 = "fp16" }

-- One engine step's forward and backward at stage 0; every arena's high-water
-- mark is the plan's figure for it and the ledger holds the plan's total.
local function check_gpt2(cfg, B, S, dtype, ck, family)
  local comm = require("luazero.comm").init("local")
  local conf = { train_micro_batch_size_per_gpu = B, gradient_accumulation_steps = 1 }
  if dtype ~= "f32" then conf[ENGINE_DTYPE[dtype]] = { enabled = true } end
  local model = (family or gpt2).new(cfg)
  model:checkpoint_activations(ck)
  local plan = model:arena_plan(B, S, dtype)
  support.settle()
  local mem0 = lz.mem()
  local engine = require("luazero.zero").initialize({ model = model, seed = 1, comm = comm, config = conf })
  local a0, o0 = lz.mem().activations, lz.mem().offload
  engine:prepare(B, S)
  local x, y = lz.tensor({ B, S }, "i32", "workspace"), lz.tensor({ B, S }, "i32", "workspace")
  for i = 0, B * S - 1 do x:set(i, (i * 7919) % cfg.vocab); y:set(i, (i * 13 + 1) % cfg.vocab) end
  with_dtype(dtype, function()
    engine:forward(x, y)
    engine:backward()
  end)
  local what = ("%s L=%d C=%d %s B=%d T=%d checkpointing %s"):format(cfg.name, cfg.n_layer,
               cfg.n_embd,
               dtype, B, S, ck and "on" or "off")
  local ctx, k = model.ctx, model.ckpt
  local scratch = math.max(ctx.scratches[1]:peak(), ctx.scratches[2]:peak())
  eq(scratch, plan.scratch, what .. ": scratch")
  local report = model:memory(B, S, dtype)
  if k then
    eq(k.main:peak(), plan.main, what .. ": model arena")
    eq(k.block:peak(), plan.block, what .. ": block arena")
    eq(k.head:peak(), plan.logits, what .. ": logits")
    eq(k.casts and k.casts:peak() or 0, plan.casts, what .. ": casts")
    eq(k.block_casts and k.block_casts:peak() or 0, plan.block_casts, what .. ": block casts")
    local blocks = 0
    for _, b in ipairs(model.layers.blocks) do
      blocks = math.max(blocks, b:memory(B, S, dtype).activations)
    end
    eq(plan.block, blocks, what .. ": block arena is one block's report")
  else
    eq(ctx.arena:peak(), plan.arena, what .. ": arena")
    eq(ctx.cast_arena and ctx.cast_arena:peak() or 0, plan.casts, what .. ": casts")
    eq(plan.arena, report.activations, what .. ": the arena is the model's report")
    eq(plan.casts, dtype == "f32" and 0 or report.casts, what .. ": casts are the report's")
  end
  local mem = lz.mem()
  eq(mem.activations - a0, plan.activations, what .. ": ledger activations")
  eq(mem.offload - o0, plan.offload, what .. ": ledger offload")
  x:free(); y:free()
  engine:free()
  model:free()
  eq(lz.mem().activations, mem0.activations, what .. ": arenas released")
  return plan
end

function T.gpt2_arenas_are_the_modules_reports_to_the_byte()
  local sizes = {
    { gpt2.config("gpt2-nano", { n_layer = 2, n_embd = 32, n_head = 2, context = 16 }), 2, 16 },
    { gpt2.config("gpt2-nano", { n_layer = 3, n_embd = 64, n_head = 4, context = 32,
                                 vocab = 200 }), 3, 20 },
  }
  for _, s in ipairs(sizes) do
    for _, dtype in ipairs(DTYPES) do
      local off = check_gpt2(s[1], s[2], s[3], dtype, false)
      local on = check_gpt2(s[1], s[2], s[3], dtype, true)
      assert(on.activations < off.activations, "checkpointing keeps less")
    end
  end
  -- The kept inputs in a buffer of their own, on the offload category.
  local plan = check_gpt2(sizes[2][1], 3, 20, "f32", { cpu_checkpointing = true,
                          contiguous_memory_optimization = true, number_checkpoints = 4 })
  eq(plan.offload, 4 * lz.arena_bytes(3 * 20 * 64), "four slots of one block input")
end

function T.llama_arenas_are_the_modules_reports_to_the_byte()
  local sizes = {
    { llama.config("llama-tiny", { context = 16 }), 2, 16 },
    { llama.config("llama-tiny", { n_layer = 3, n_head = 4, n_kv_head = 1, vocab = 200,
                                   tie = true }), 3, 20 },
  }
  for _, s in ipairs(sizes) do
    for _, dtype in ipairs(DTYPES) do
      local off = check_gpt2(s[1], s[2], s[3], dtype, false, llama)
      local on = check_gpt2(s[1], s[2], s[3], dtype, true, llama)
      assert(on.activations < off.activations, "checkpointing keeps less")
    end
  end
end

-- A report is a function of B x T and the dtype only: doubling the batch
-- doubles every position-sized tensor, and the working dtype changes only
-- the casts.
function T.reports_scale_with_the_batch_and_only_casts_see_the_dtype()
  local m = gpt2.new(gpt2.config("gpt2-nano", { n_layer = 2, n_embd = 64, n_head = 4 }))
  local a, b = m:memory(2, 64, "f32"), m:memory(4, 64, "f32")
  eq(b.activations, 2 * a.activations, "activations per position")
  eq(b.scratch, 2 * a.scratch, "scratch per position")
  eq(a.casts, 0, "f32 casts nothing")
  local h = m:memory(2, 64, "bf16")
  eq(h.activations, a.activations, "bf16 activations")
  assert(h.casts > 0, "bf16 casts")
  eq(m:cast_arena_size(2, 64, "f16"), m:memory(2, 64, "f16").casts, "cast arena")
  eq(bit.band(a.activations, lz.ARENA_ALIGN - 1), 0, "whole arena units")
end

----------------------------------------------------------------- estimate

-- estimate.activations reads the model's plan: what model:prepare puts on
-- the ledger; tools/estimate prints it for a named model.
function T.estimate_activations_are_what_prepare_allocates()
  local estimate = require("luazero.estimate")
  for _, ck in ipairs({ false, true, { cpu_checkpointing = true } }) do
    local m = gpt2.new(gpt2.config("gpt2-nano", { n_layer = 2 }))
    m:checkpoint_activations(ck)
    local e = estimate.activations(m, 2, 32, "fp32")
    support.settle()
    local before = lz.mem()
    m:prepare(2, 32)
    local after = lz.mem()
    eq(after.activations - before.activations, e.device, "activations " .. tostring(ck))
    eq(after.offload - before.offload, e.offload, "offload " .. tostring(ck))
    m:free()
  end
  -- GPT-2 124M, B = 4, T = 64, fp32: 212.8 MiB, 61.9 MiB checkpointed
  -- (docs/training.md).
  for _, c in ipairs({ { 0, "223,153,152" }, { 1, "64,883,712" } }) do
    local p = io.popen(("cd '%s' && LUAZERO='%s' tools/estimate --model gpt2 --dtype fp32 " ..
                        "--budget 1GiB --micro-batch 4 --seq-len 64 --checkpoint-activations " ..
                        "%d 2>&1"):format(lz.root, lz.executable(), c[1]))
    local out = p:read("*a")
    p:close()
    assert(out:find("activations per rank for micro-batches of 4 x 64 tokens" ..
                    (c[1] == 1 and ", checkpointed" or "") .. ": " .. c[2] .. " bytes", 1, true),
           out)
  end
end

return T
