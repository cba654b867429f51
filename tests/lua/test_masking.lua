-- test_masking.lua — masked loss and packed documents in the models: the
-- loss is the mean over targets >= 0 (Hugging Face's ignore_index=-100), a
-- micro-batch with none gives 0 and no gradient, and a packed batch (extra.pos,
-- extra.seg) gives the loss and gradients of its documents run one by one,
-- for GPT-2 (learned positions) and Llama (rotary), with and without
-- activation checkpointing and on the sim device.
local ffi = require("ffi")
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local models = require("models.registry")

local T = {}

local families = {
  gpt2 = function() return models.config("gpt2-nano", { n_layer = 2, n_embd = 32, n_head = 2,
                                                        context = 32 }) end,
  llama = function() return models.config("llama-tiny", { n_layer = 2 }) end,
}

local function new_model(family, device)
  local m = models.new(families[family]())
  if device then m.ctx.device = device end
  return m:allocate():init_weights(3)
end

local function ids(rows, B, S)
  local t = lz.tensor({ B, S }, "i32")
  for b = 1, B do
    for s = 1, S do t:set((b - 1) * S + s - 1, rows[b][s]) end
  end
  return t
end

local function grads(m)
  local g = m.grads_flat:device_name() ~= "cpu" and m.grads_flat:to("cpu") or m.grads_flat
  local n = g:numel()
  local out = ffi.new("float[?]", n)
  ffi.copy(out, g.data, n * 4)
  if g ~= m.grads_flat then g:free() end
  return out, n
end

local function worst(a, b, n)
  local scale, w = 0, 0
  for i = 0, n - 1 do scale = math.max(scale, math.abs(b[i])) end
  for i = 0, n - 1 do w = math.max(w, math.abs(a[i] - b[i])) end
  return w / scale
end

-- Two rows of S = 16 tokens: row 1 packs documents of 5, 7 and 4 tokens,
-- row 2 one of 3 and one of 13. Each document predicts its own next tokens
-- (its last token has target -1: no prediction across documents); its first
-- two targets are a "prompt" (-100).
local S = 16
local docs = { { 5, 7, 4 }, { 3, 13 } }

local function make_docs(vocab)
  local out, r = {}, 12345
  for b, lens in ipairs(docs) do
    for _, L in ipairs(lens) do
      local d = { row = b, tokens = {}, targets = {} }
      for i = 1, L do
        r = (r * 1103515245 + 12345) % 2147483648
        d.tokens[i] = r % vocab
      end
      for i = 1, L do
        d.targets[i] = i < L and d.tokens[i + 1] or -1
        if i <= 2 and L > 3 then d.targets[i] = -100 end
      end
      out[#out + 1] = d
    end
  end
  return out
end

local function packed(list)
  local x, y, pos, seg = {}, {}, {}, {}
  for b = 1, #docs do x[b], y[b], pos[b], seg[b] = {}, {}, {}, {} end
  local id = 0
  for _, d in ipairs(list) do
    local b = d.row
    id = id + 1
    for i = 1, #d.tokens do
      local k = #x[b] + 1
      x[b][k], y[b][k], pos[b][k], seg[b][k] = d.tokens[i], d.targets[i], i - 1, id
    end
  end
  local B = #docs
  return ids(x, B, S), ids(y, B, S), { pos = ids(pos, B, S), seg = ids(seg, B, S) }
end

local function counted(d)
  local n = 0
  for _, t in ipairs(d.targets) do if t >= 0 then n = n + 1 end end
  return n
end

-- Loss and gradients of the packed batch; of each document alone, weighted
-- by its counted targets.
local function packed_vs_alone(family, opts)
  opts = opts or {}
  local m = new_model(family, opts.device)
  if opts.checkpointing then m:checkpoint_activations(true) end
  m:prepare(#docs, S)
  local list = make_docs(m.cfg.vocab)
  local x, y, extra = packed(list)
  m:zero_grad()
  local loss = m:forward(x, y, extra)
  m:backward(1)
  local g_packed, n = grads(m)

  local total = 0
  for _, d in ipairs(list) do total = total + counted(d) end
  m:zero_grad()
  local sum = 0
  for _, d in ipairs(list) do
    local L = #d.tokens
    local xd, yd = ids({ d.tokens }, 1, L), ids({ d.targets }, 1, L)
    local c = counted(d)
    sum = sum + m:forward(xd, yd) * c
    m:backward(c / total)
    xd:free(); yd:free()
  end
  local g_alone = grads(m)
  x:free(); y:free(); extra.pos:free(); extra.seg:free()
  m:free()
  return loss, sum / total, g_packed, g_alone, n
end

local function check_family(family, opts)
  local loss, want, gp, ga, n = packed_vs_alone(family, opts)
  local what = family .. (opts and opts.checkpointing and " (checkpointing)" or "") ..
               (opts and opts.device and (" on " .. opts.device) or "")
  assert(math.abs(loss - want) <= 1e-5 * want, ("%s: packed loss %.9g, documents alone %.9g")
         :format(what, loss, want))
  local err = worst(gp, ga, n)
  if os.getenv("LZ_TEST_VERBOSE") then
    print(("    %s: loss %.9g vs %.9g, gradients %.3g"):format(what, loss, want, err))
  end
  assert(err <= 1e-5, ("%s: gradients %.3g apart (relative to the largest)"):format(what, err))
  return loss, gp, n
end

function T.packed_gpt2_batch_is_its_documents_alone()
  check_family("gpt2")
end

function T.packed_llama_batch_is_its_documents_alone()
  check_family("llama")
end

-- Replays under activation checkpointing see the same documents: bitwise
-- the same loss and gradients.
function T.checkpointing_replays_see_the_documents()
  for _, family in ipairs({ "gpt2", "llama" }) do
    local l0, g0, n = check_family(family)
    local l1, g1 = check_family(family, { checkpointing = true })
    assert(l0 == l1, family .. ": loss changed under checkpointing")
    assert(ffi.string(g0, n * 4) == ffi.string(g1, n * 4), family .. ": gradients changed")
  end
end

-- The sim device runs the cpu kernels on device memory: the packed inputs
-- are copied there, and the results are bitwise the cpu's.
function T.packed_batch_on_sim_is_bitwise_the_cpu()
  lz.device_init("sim")
  for _, family in ipairs({ "gpt2", "llama" }) do
    local l0, g0, n = check_family(family)
    local l1, g1 = check_family(family, { device = "sim" })
    assert(l0 == l1, family .. ": loss differs on sim")
    assert(ffi.string(g0, n * 4) == ffi.string(g1, n * 4), family .. ": gradients differ on sim")
  end
end

-- Positions 0..T-1 and one document per row take the paths of a plain batch:
-- bitwise the same loss and gradients as no extra at all.
function T.one_document_per_row_is_bitwise_plain()
  for _, family in ipairs({ "gpt2", "llama" }) do
    local m = new_model(family)
    m:prepare(2, S)
    local x, y = lz.tensor({ 2, S }, "i32"), lz.tensor({ 2, S }, "i32")
    local pos, seg = lz.tensor({ 2, S }, "i32"), lz.tensor({ 2, S }, "i32")
    for i = 0, 2 * S - 1 do
      x:set(i, (i * 37) % m.cfg.vocab); y:set(i, (i * 11 + 5) % m.cfg.vocab)
      pos:set(i, i % S); seg:set(i, math.floor(i / S) * 9)
    end
    local out = {}
    for k, extra in ipairs({ false, { pos = pos, seg = seg } }) do
      m:zero_grad()
      local loss = m:forward(x, y, extra or nil)
      m:backward(0.5)
      local g, n = grads(m)
      out[k] = { loss = loss, g = ffi.string(g, n * 4) }
    end
    assert(out[1].loss == out[2].loss, family .. ": loss changed")
    assert(out[1].g == out[2].g, family .. ": gradients changed")
    x:free(); y:free(); pos:free(); seg:free()
    m:free()
  end
end

-- The mean is over the targets >= 0 only: a batch with half its targets
-- masked has the loss of the unmasked positions' mean.
function T.loss_is_the_mean_over_unmasked_targets()
  local m = new_model("gpt2")
  m:prepare(1, 8)
  local x, y, y2 = lz.tensor({ 1, 8 }, "i32"), lz.tensor({ 1, 8 }, "i32"), lz.tensor({ 1, 8 }, "i32")
  for i = 0, 7 do
    x:set(i, i * 3); y:set(i, i * 5 + 1); y2:set(i, i % 2 == 0 and i * 5 + 1 or -100)
  end
  m:forward(x, y)
  local per = lz.tensor({ 1, 8 }, "f32") -- losses of every position, recomputed
  lz.ops.cross_entropy_forward(per, m.logits, y, m.cfg.vocab)
  local want = 0
  for i = 0, 7, 2 do want = want + per:get(i) end
  want = want / 4
  local loss = m:forward(x, y2)
  assert(math.abs(loss - want) <= 1e-6 * want, ("loss %.9g, want %.9g"):format(loss, want))
  x:free(); y:free(); y2:free(); per:free()
  m:free()
end

-- No target counted: loss 0, zero gradients, no NaN.
function T.all_masked_micro_batch_gives_zero_loss_and_gradient()
  for _, family in ipairs({ "gpt2", "llama" }) do
    local m = new_model(family)
    m:prepare(2, 8)
    local x, y = lz.tensor({ 2, 8 }, "i32"), lz.tensor({ 2, 8 }, "i32")
    for i = 0, 15 do x:set(i, i); y:set(i, i % 3 == 0 and -1 or -100) end
    m:zero_grad()
    local loss = m:forward(x, y)
    assert(loss == 0, family .. ": loss " .. tostring(loss))
    m:backward(1)
    assert(m.grads_flat:sq_norm() == 0, family .. ": a gradient is not zero")
    x:free(); y:free()
    m:free()
  end
end

-- Through a ZeRO-3 engine (parameters gathered around each module): a
-- loader's third value reaches the model in train_batch, and the step's
-- loss is the packed batch's, as the bare model computes it.
function T.engine_passes_a_batchs_extra_to_the_model()
  local zero = require("luazero.zero")
  for _, family in ipairs({ "gpt2", "llama" }) do
    local m = new_model(family)
    m:prepare(#docs, S)
    local x, y, extra = packed(make_docs(m.cfg.vocab))
    local want = m:forward(x, y, extra)
    local plain = m:forward(x, y)
    m:free()
    assert(math.abs(plain - want) > 1e-4 * want, family .. ": packing changed nothing")
    local engine = zero.initialize({
      model = models.new(families[family]()), seed = 3, batch = { #docs, S },
      comm = require("luazero.comm").init("local"),
      config = { train_micro_batch_size_per_gpu = #docs, zero_optimization = { stage = 3 } } })
    local calls = 0
    local batches = { next_batch = function() calls = calls + 1; return x, y, extra end }
    local rec = engine:train_batch(batches)
    engine:free()
    assert(calls == 1 and rec.loss == want,
           ("%s: the engine's loss %.9g, the model's %.9g"):format(family, rec.loss, want))
    x:free(); y:free(); extra.pos:free(); extra.seg:free()
  end
end

function T.bad_extra_is_a_one_line_error()
  local m = new_model("gpt2")
  m:prepare(2, 8)
  local x, bad = lz.tensor({ 2, 8 }, "i32"), lz.tensor({ 8, 2 }, "i32")
  support.expect_error(function() m:forward(x, x, { pos = bad }) end,
                       "model: extra.pos must be an i32 tensor [2, 8] like the tokens")
  local f = lz.tensor({ 2, 8 }, "f32")
  support.expect_error(function() m:forward(x, x, { seg = f }) end, "extra.seg must be an i32")
  local far = lz.tensor({ 2, 8 }, "i32")
  far:set(3, 999)
  support.expect_error(function() m:forward(x, x, { pos = far }) end, "pos[0, 3] is 999")
  x:free(); bad:free(); f:free(); far:free()
  m:free()
end

return T
