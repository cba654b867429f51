-- test_muon.lua — Muon (optim/muon.lua) and its whole-matrix placement
-- (zero/matrices.lua): torch's defaults and the config's checks; an exact
-- orthogonalisation of a small matrix; which parameters are Muon's (the
-- hidden 2-D weights, not the embeddings, head, norms or biases) and who
-- owns each; one checksum over stages 0-3, world sizes, a cpu-tier
-- optimizer, gradient accumulation and clipping; a resume continues
-- bitwise; NVMe states are refused naming the fix. (Against torch itself:
-- tests/ref/test5_muon.py.)
local cjson = require("cjson")
local lz = require("luazero")
local optim = require("luazero.optim")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local T = {}

local expect_error, q = support.expect_error, support.quote

function T.defaults_are_torchs_and_the_config_is_checked()
  local o = optim.new({ type = "muon" })
  assert(getmetatable(o) == optim.Muon and o.type == "Muon")
  assert(o.lr == 1e-3 and o.momentum == 0.95 and o.nesterov == true and o.ns_steps == 5)
  assert(o.eps == 1e-7 and o.weight_decay == 0.1 and o.adjust_lr_fn == "original")
  assert(o.beta1 == 0.9 and o.beta2 == 0.95 and o.adam_eps == 1e-8 and o.ns_dtype == "float32")
  local config = require("luazero.config")
  local function cfg(params)
    return config.load({ train_micro_batch_size_per_gpu = 1,
                         optimizer = { type = "Muon", params = params } })
  end
  assert(cfg({ adjust_lr_fn = "match_rms_adamw" }).optimizer.params.adjust_lr_fn == "match_rms_adamw")
  expect_error(function() cfg({ adjust_lr_fn = "moonlight" }) end,
               'config: optimizer.params.adjust_lr_fn must be one of "original", ' ..
               '"match_rms_adamw", "spectral_unclamped" (got "moonlight")')
  assert(cfg({ ns_dtype = "bfloat16" }).optimizer.params.ns_dtype == "bfloat16")
  -- (with or without "torch.", as momentum_dtype takes torch's names)
  assert(cfg({ ns_dtype = "torch.bfloat16" }).optimizer.params.ns_dtype == "bfloat16")
  -- optim.new holds a table it is handed to the same rules (it failed at
  -- the first step)
  expect_error(function()
    require("luazero.optim").new({ type = "Muon", params = { ns_dtype = "fp16" } })
  end, 'optimizer.params.ns_dtype must be one of "float32", "bfloat16" (got "fp16")')
  expect_error(function() cfg({ ns_dtype = "bf16" }) end,
               'config: optimizer.params.ns_dtype must be one of "float32", "bfloat16" (got "bf16")')
  expect_error(function() cfg({ ns_steps = 2.5 }) end,
               "config: optimizer.params.ns_steps must be a whole number in [1, 100) (got 2.5)")
  expect_error(function() cfg({ momentum = 1 }) end,
               "config: optimizer.params.momentum must be a number in [0, 1) (got 1)")
end

-- One step on a 2 x 2 matrix whose U is a multiple of the identity: after
-- the normalisation (U / |U|, singular values 1/sqrt(2)) each Newton-Schulz
-- step maps a singular value x to a x + b x^3 + c x^5, so O is that scalar
-- recurrence times I.
function T.one_step_on_an_orthogonal_matrix()
  local o = optim.new({ type = "Muon", params = { lr = 0.5, weight_decay = 0, nesterov = false,
                                                   momentum = 0 } })
  local p = lz.from_table({ 1, 1, 1, 1 })
  local g = lz.from_table({ 3, 0, 0, 3 })
  local m, v = lz.tensor({ 4 }, "f32"), lz.tensor({ 4 }, "f32")
  local c = { p = p, g = g, s = { m, v }, decay = true, matrix = { 2, 2 } }
  o:prepare(c, 1, 1)
  o:orthogonalize(v:view(0, { 2, 2 }), 2, 2)
  o:update(c, 1, 0.5, 1)
  -- x: the singular value, 1/sqrt(2) after the normalisation.
  local x = 1 / math.sqrt(2)
  for _ = 1, 5 do x = 3.4445 * x - 4.7750 * x ^ 3 + 2.0315 * x ^ 5 end
  local want = { 1 - 0.5 * x, 1, 1, 1 - 0.5 * x }
  for i = 0, 3 do
    assert(math.abs(p:get(i) - want[i + 1]) < 1e-6, ("p[%d] = %.8g, expected %.8g")
           :format(i, p:get(i), want[i + 1]))
  end
  for _, t in ipairs({ p, g, m, v }) do t:free() end
end

-- ns_dtype "bfloat16": the same matrix through torch's bf16 iteration. O is
-- a bf16 value (its fp32 bits end in 16 zeros), the scalar recurrence with
-- x rounded to bf16 after every step (b x^2 + c x^4, then a x + that x, each
-- rounded as torch's bf16 addmm rounds), and not the fp32 one's.
function T.bf16_newton_schulz_rounds_where_torch_does()
  local ffi = require("ffi")
  local o = optim.new({ type = "Muon", params = { ns_dtype = "bfloat16" } })
  local v = lz.from_table({ 3, 0, 0, 3 })
  o:orthogonalize(v:view(0, { 2, 2 }), 2, 2)
  local bits = ffi.new("union { float f; uint32_t u; }")
  local function bf16(y) -- to nearest, ties to even
    bits.f = y
    local u = bits.u
    bits.u = bit.band(u + 0x7fff + bit.band(bit.rshift(u, 16), 1), 0xffff0000)
    return bits.f
  end
  local x, x32 = bf16(bf16(3) / bf16(math.sqrt(18))), 3 / math.sqrt(18)
  for _ = 1, 5 do
    local g = bf16(x * x)
    local poly = bf16(-4.7750 * g + 2.0315 * g * g)
    x = bf16(3.4445 * x + poly * x)
    x32 = 3.4445 * x32 - 4.7750 * x32 ^ 3 + 2.0315 * x32 ^ 5
  end
  for i = 0, 3 do
    local want = (i == 0 or i == 3) and x or 0
    assert(v:get(i) == want, ("O[%d] = %.9g, expected %.9g"):format(i, v:get(i), want))
  end
  assert(math.abs(x - x32) > 1e-6, "bf16 and fp32 recurrences agree: the test tells nothing")
  v:free()
end

-- The hidden 2-D weights are Muon's; each has one owner, balanced.
function T.the_placement_takes_hidden_matrices_and_balances_them()
  local Matrices = require("luazero.zero.matrices")
  local layout = require("luazero.zero.layout")
  local gpt2 = require("models.gpt2")
  local model = gpt2.new(gpt2.config("gpt2-nano", { n_layer = 3, n_embd = 64, n_head = 4,
                                                    context = 32 }))
  local pt = model.param_table
  local L = layout.new(pt, 2)
  local mx = Matrices.new({ L = L, P = { optimizer = { extent = "shard" } }, rank = 1, world = 2,
                            ring = {}, model = model, optimizer = optim.new({ type = "Muon" }) })
  assert(#mx.list == 12, #mx.list) -- 4 per block: qkv, attention out, fc, projection
  for _, m in ipairs(mx.list) do
    assert(#m.entry.shape == 2 and m.entry.name:find("%.h%.%d"), m.entry.name)
  end
  for _, e in ipairs(pt) do
    if #e.shape ~= 2 or not e.name:find("%.h%.%d") then assert(mx.matrix_of(e) == nil, e.name) end
  end
  assert(mx.load[0] == mx.load[1], ("%d vs %d"):format(mx.load[0], mx.load[1]))
  assert(mx:describe("Muon"):find("12 whole matrices", 1, true))
  assert(Matrices.new({ optimizer = optim.new({ type = "AdamW" }) }) == nil)
end

local write_file, tmp = support.scratch()
local lines = {}
for i = 1, 80 do lines[i] = ("line %d of the corpus: %d\n"):format(i, i * 7919 % 1000) end
local corpus = write_file("corpus.txt", table.concat(lines))
local train, ok_train = support.trainer("--model gpt2-nano --n-layer 2 --n-embd 64 --n-head 4 " ..
  "--context 32 --seq-len 16 --sample 0 --eval-batches 1 --seed 7 --micro-batch 2 --data " .. q(corpus))

local function config(extra)
  local c = { train_micro_batch_size_per_gpu = 2, gradient_clipping = 0.5,
              optimizer = { type = "Muon", params = { lr = 0.01, adjust_lr_fn = "match_rms_adamw" } } }
  for k, v in pairs(extra or {}) do c[k] = v end
  return write_file(("muon%d.json"):format(math.random(1e9)), cjson.encode(c))
end

function T.every_stage_and_tier_gives_one_checksum()
  local plain = q(config())
  local cpu = q(config({ zero_optimization = { stage = 2, offload_optimizer = { device = "cpu" } } }))
  local out, want = ok_train(2, "--steps 3 --stage 0 --grad-accum 2 --config " .. plain)
  assert(out:find("Muon: 8 whole matrices (98304 elements), every rank orthogonalises all", 1, true),
         out)
  for _, flags in ipairs({ "--stage 1", "--stage 3", "--stage 2" }) do
    local o, got = ok_train(2, "--steps 3 --grad-accum 2 --config " .. plain .. " " .. flags)
    assert(got == want, ("%s: %s, stage 0: %s"):format(flags, got, want))
    if flags == "--stage 3" then
      assert(o:find("each owned whole by one rank (this rank: 4, 49152 elements)", 1, true), o)
    end
  end
  local _, got = ok_train(2, "--steps 3 --grad-accum 2 --config " .. cpu)
  assert(got == want, ("cpu tier: %s, stage 0: %s"):format(got, want))
  -- U gathered one segment at a time (a small allgather_bucket_size).
  local small = q(config({ zero_optimization = { stage = 3, allgather_bucket_size = 1000 } }))
  _, got = ok_train(2, "--steps 3 --grad-accum 2 --config " .. small)
  assert(got == want, ("small gathers: %s, stage 0: %s"):format(got, want))
  -- bf16 working copies: stage 0 and 3 again agree.
  local _, b0 = ok_train(2, "--steps 3 --dtype bf16 --stage 0 --config " .. plain)
  local _, b3 = ok_train(2, "--steps 3 --dtype bf16 --stage 3 --config " .. plain)
  assert(b0 == b3 and b0 ~= want, ("bf16: %s, %s"):format(b0, b3))
end

function T.a_resume_continues_bitwise()
  local cfg, dir = q(config()), tmp .. "/ck"
  local _, straight = ok_train(2, "--steps 4 --stage 3 --dtype bf16 --save-every 2 --save " ..
                                  q(dir) .. " --config " .. cfg)
  local _, resumed = ok_train(2, "--steps 4 --stage 3 --dtype bf16 --resume " ..
                                 q(dir .. "/step-000002") .. " --config " .. cfg)
  assert(resumed == straight, ("resumed %s, straight %s"):format(resumed, straight))
end

function T.nvme_states_are_refused_naming_the_fix()
  local cfg = config({ zero_optimization = { stage = 3, offload_optimizer = {
    device = "nvme", nvme_path = tmp } } })
  local out, st = train(1, "--steps 1 --config " .. q(cfg))
  assert(st ~= 0 and out:find("Muon orthogonalises whole matrices from states held in memory; " ..
                              "offload_optimizer.device nvme is not supported with it (use cpu " ..
                              "or none)", 1, true), out)
end

return T
