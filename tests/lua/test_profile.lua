-- test_profile.lua — luazero.profile and train.lua --profile: a profiled run
-- ends with the same parameters bit for bit (fp32 and bf16, LoRA, ZeRO-3 on
-- two ranks, the sim device); the rows add up to the step's time measured outside; the
-- GEMM rows carry their module, part, dtype, shape and GFLOP/s; a bf16 run
-- names the kernels of its GEMMs and attention; detach puts
-- every wrapped function back; --profile-json writes the report.
local cjson = require("cjson")
local lz = require("luazero")
local clock = require("luazero.clock")
local data = require("luazero.data")
local profile = require("luazero.profile")
local registry = require("models.registry")
local zero = require("luazero.zero")
local support = dofile(lz.root .. "/tests/lua/support.lua")

local T = {}
local q, eq = support.quote, support.eq
local write_file, tmp = support.scratch()
local corpus = write_file("corpus.txt", ("It was the best of times, it was the worst of times; "):rep(80))

local function engine_of(name, dtype, stage)
  local model = registry.new(registry.config(name))
  local engine = zero.initialize{ model = model, seed = 3, batch = { 2, 16 },
    config = { train_micro_batch_size_per_gpu = 2, gradient_clipping = 1.0,
               bf16 = { enabled = dtype == "bf16" }, zero_optimization = { stage = stage or 0 },
               optimizer = { type = "AdamW", params = { lr = 1e-3 } } } }
  local c = data.load(corpus)
  return engine, data.loader(c, { B = 2, T = 16, seed = 1, vocab = 256 }), c
end

function T.train_gives_the_same_checksum_with_and_without_profile()
  local cases = {
    { "gpt2-nano", "--n-layer 2 --n-embd 32 --n-head 2 --context 32 --dtype fp32", 1 },
    { "llama-tiny", "--dtype bf16 --lora-r 2 --seq-len 32", 1 },
    { "gpt2-nano", "--n-layer 2 --n-embd 32 --n-head 2 --context 32 --dtype bf16 --stage 3", 2 },
    { "gpt2-nano", "--n-layer 2 --n-embd 32 --n-head 2 --context 32 --device sim", 1 },
  }
  for _, c in ipairs(cases) do
    local _, ok_train = support.trainer(("--model %s %s --sample 0 --eval-batches 1 --data %s")
                                        :format(c[1], c[2], q(corpus)))
    local _, plain = ok_train(c[3], "--steps 3")
    local out, profiled = ok_train(c[3], "--steps 3 --profile")
    eq(profiled, plain, c[1] .. " " .. c[2] .. " params_checksum under --profile")
    assert(out:find("GEMMs [%d.]+%% of the step at [%d.]+ GFLOP/s, everything else [%d.]+%%"),
           "no summary line in:\n" .. out)
    assert(out:find("profile: 2 steps after the warm-up", 1, true), out)
    -- a bf16 run names the kernels its GEMMs and attention ran on
    local bf16 = c[2]:find("--dtype bf16", 1, true) ~= nil
    eq(out:find("bf16 kernels: matmul " .. lz.bf16_matmul() .. "; attention "
                .. lz.bf16_attention(), 1, true) ~= nil, bf16, c[1] .. " " .. c[2] .. " kernels line")
  end
end

function T.rows_add_up_to_the_step_measured_outside()
  local engine, loader, c = engine_of("gpt2-nano", "fp32")
  local p = profile.attach(engine)
  local total = 0
  for i = 1, 4 do
    local t0 = clock.now()
    engine:train_batch(loader)
    if i > 1 then total = total + (clock.now() - t0) end
  end
  local rep = p:report()
  p:detach()
  eq(rep.steps, 3, "steps after the warm-up")
  local outside = total / 3 * 1000
  local sum = 0
  for _, r in ipairs(rep.rows) do sum = sum + r.ms end
  assert(math.abs(sum - outside) <= 0.03 * outside,
         ("the rows add up to %.2f ms, the step measured outside took %.2f ms"):format(sum, outside))
  local by = {}
  for _, r in ipairs(rep.rows) do by[r.name] = r end
  -- gpt2-nano: 4 blocks of qkv, proj, fc and fc-proj linears, the tied head
  local fwd = assert(by["GEMM attn.c_attn fwd f32 32x384x128"], "no qkv forward GEMM row")
  eq(fwd.calls, 4, "qkv forwards per step")
  assert(fwd.gflops > 0, "the qkv GEMM's GFLOP/s")
  assert(by["GEMM attn.c_attn dW f32 384x128x32"], "no qkv dW row")
  assert(by["GEMM lm_head dX f32 32x128x256"], "no head dX row")
  eq(by.adamw_step.calls > 0, true, "adamw_step calls")
  eq(by[profile.DATA].calls, 1, "data loading calls per step")
  local norm = assert(by["tensor sq_norm (grad norm)"], "no grad-norm row")
  assert(norm.gbs > 0 and not norm.gflops, "the grad norm's GB/s")
  assert(rep.gemm_pct > 0 and rep.gemm_pct < 100, "GEMM share " .. rep.gemm_pct)
  engine:free(); loader:free(); data.free(c)
end

-- The bytes each parameter moves per step outside forward and backward:
-- AdamW over an fp32 master reads and writes the master and both moments
-- and reads the gradient (28 bytes), plus the bf16 working copy it writes
-- (2); zeroing writes 4 bytes for each gradient no Linear writes in
-- backward (the embedding's, the norms'), a share of a pass the line
-- prints, and their norm reads the same share (the Linears' weight
-- gradients give it their partials as they are written).
function T.parameter_bytes_per_step_are_counted()
  for _, c in ipairs({ { "fp32", 28 }, { "bf16", 30 } }) do
    local engine, loader, corpus_ = engine_of("llama-tiny", c[1])
    local p = profile.attach(engine)
    for _ = 1, 3 do engine:train_batch(loader) end
    local pb = assert(p:report().param_bytes, "no parameter bytes in the report")
    local text = p:format()
    p:detach()
    eq(pb.minimum, c[2], c[1] .. " optimizer bytes per parameter")
    local parts = {}
    for _, pt in ipairs(pb.parts) do parts[pt.name] = pt.per_param end
    -- the gradient buffer may hold a few padding elements more than the optimizer updates
    local zeroed = 0
    for _, seg in ipairs(engine.L.segments) do
      if not seg.writes then zeroed = zeroed + seg.padded end
    end
    local share = zeroed / engine.L.full_numel
    assert(share > 0.05 and share < 0.9, c[1] .. " share of the gradients zeroed " .. share)
    assert(math.abs(parts["zero (zero gradients)"] - 4 * share) < 0.1,
           c[1] .. " zeroing bytes " .. parts["zero (zero gradients)"] .. ", want " .. 4 * share)
    -- (the norm reads what no weight gradient's product took, here the
    -- segments no Linear writes: zero/reduce.lua's norm_blocks_for)
    local norm = parts["sq_norm (grad norm)"]
    assert(math.abs(norm - 4 * share) < 0.1,
           c[1] .. " grad-norm bytes " .. norm .. ", want " .. 4 * share)
    assert(math.abs(pb.per_param - (c[2] + norm + 4 * share)) < 0.2,
           c[1] .. " bytes per parameter " .. pb.per_param)
    assert(text:find(("zero %%(zero gradients%%) [%%d.]+ in %.2f pass"):format(share)),
           "no share of a pass in:\n" .. text)
    assert(text:find(("bytes per parameter per step: [%%d.]+ %%(.*%%); minimum %d%%.0"):format(c[2])),
           "no bytes line in:\n" .. text)
    engine:free(); loader:free(); data.free(corpus_)
  end
end

-- Steps run before attach let the JIT compile the engine's calls of tensor
-- methods (the grad norm's sq_norm); attach must still see every call.
function T.tensor_calls_are_counted_after_the_jit_compiled_their_callers()
  local engine, loader, c = engine_of("gpt2-nano", "fp32")
  for _ = 1, 60 do engine:train_batch(loader) end
  local p = profile.attach(engine)
  for _ = 1, 3 do engine:train_batch(loader) end
  local rep = p:report()
  p:detach()
  local norm
  for _, r in ipairs(rep.rows) do
    if r.name == "tensor sq_norm (grad norm)" then norm = r end
  end
  assert(norm and norm.calls > 0, "no grad-norm row after 60 steps without the profiler")
  engine:free(); loader:free(); data.free(c)
end

function T.detach_puts_everything_back()
  local engine, loader, c = engine_of("llama-tiny", "bf16", 3)
  local matmul, copy, train_batch = lz.ops.matmul, lz.Tensor.copy, engine.train_batch
  local before = engine:params_checksum()
  local p = profile.attach(engine)
  assert(lz.ops.matmul ~= matmul, "attach wraps lz.ops")
  support.expect_error(function() profile.attach(engine) end, "a profiler is attached already")
  engine:train_batch(loader)
  p:detach()
  eq(lz.ops.matmul, matmul, "lz.ops.matmul after detach")
  eq(lz.Tensor.copy, copy, "lz.Tensor.copy after detach")
  eq(engine.train_batch, train_batch, "engine.train_batch after detach")
  eq(rawget(engine, "train_batch"), nil, "engine's own train_batch field")
  eq(rawget(engine.model, "forward"), nil, "the model's own forward field")
  eq(profile.attached(), nil, "attached profiler")
  assert(p:format():find("no step after the warm-up", 1, true), "a warm-up only profile says so")
  assert(engine:params_checksum() ~= before, "the step trained")
  engine:free(); loader:free(); data.free(c)
end

function T.profile_json_is_written()
  local _, ok_train = support.trainer(("--model gpt2-nano --n-layer 1 --n-embd 32 --n-head 2 " ..
                                       "--context 32 --sample 0 --eval-batches 1 --data %s")
                                      :format(q(corpus)))
  local path = tmp .. "/profile.json"
  ok_train(1, "--steps 3 --profile-json " .. q(path))
  local f = assert(io.open(path))
  local rep = cjson.decode(f:read("*a"))
  f:close()
  eq(rep.steps, 2, "steps in the JSON report")
  assert(#rep.rows > 5 and rep.step_ms > 0 and rep.gemm_gflops > 0, "the JSON report's rows")
  -- an unwritable path stops the run before its first step
  local train = support.trainer(("--model gpt2-nano --n-layer 1 --n-embd 32 --n-head 2 " ..
                                 "--context 32 --sample 0 --data %s"):format(q(corpus)))
  local out, st = train(1, "--steps 2 --profile-json " .. q(tmp .. "/no/such/dir/p.json"))
  eq(st, 2, "exit status of an unwritable --profile-json")
  assert(out:find("--profile-json: cannot write", 1, true) and not out:find("step     1", 1, true),
         out)
  -- nor may it name the run's own input, which opening it would empty
  local before = lz.read_file(corpus)
  out, st = train(1, "--steps 2 --profile-json " .. q(corpus))
  eq(st, 2, "exit status of --profile-json naming --data")
  assert(out:find("--profile-json " .. corpus .. " is", 1, true), out)
  assert(lz.read_file(corpus) == before, "the corpus is intact")
end

return T
