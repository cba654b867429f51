-- test_zero_grads.lua — one pass per parameter: the first micro-step of an
-- accumulation writes the Linear gradients instead of adding them into
-- zeroed buffers (linear_backward_write), and the reductions copy it
-- instead of adding it: whatever those buffers held, the gradients are bit
-- for bit those of an add into zeros; gradients no backward writes read
-- zero; zero_grad's own zeros cover only the rest; the norm's partials come
-- from the last reduction's add (add_sq_norm) with sq_norm's bits.
local ffi = require("ffi")
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local T = {}

local write_file = support.scratch()
local corpus = write_file("corpus.txt", ("the engine writes its gradients once\n"):rep(80))

local B, SEQ = 2, 8

-- model: a tiny GPT-2 unless given
local function engine_and_loader(stage, accum, model)
  local zero = require("luazero.zero")
  local data = require("luazero.data")
  local gpt2 = require("models.gpt2")
  local cfg = { train_micro_batch_size_per_gpu = B, zero_optimization = { stage = stage },
                gradient_accumulation_steps = accum or 1,
                optimizer = { type = "AdamW", params = { lr = 1e-3 } } }
  model = model or gpt2.new(gpt2.config("gpt2-nano", { n_layer = 1, n_embd = 32, n_head = 2,
                                                       context = 16 }))
  local engine = zero.initialize{ model = model, config = cfg, seed = 3, batch = { B, SEQ } }
  local loaded = data.load(corpus)
  return engine, data.loader(loaded, { B = B, T = SEQ, seed = 1, vocab = 256 }), loaded
end

local function bytes_of(t)
  return ffi.string(t.data, t:numel() * 4)
end

-- Each step's grad norm of one run (a, the way under test) the bits of the
-- other's (b, sq_norm's own pass), and not zero.
local function same_norms(a, b, how)
  for i = 1, #b do
    assert(a[i] == b[i] and a[i] > 0, ("step %d: grad norm %.17g %s, %.17g from sq_norm")
                                      :format(i, a[i], how, b[i]))
  end
end

-- After a step, the segments a Linear writes are left unzeroed (fresh):
-- garbage there (NaN) changes nothing, and the same backward over a buffer
-- zeroed whole gives the same bits.
function T.first_micro_step_writes_linear_gradients_over_whatever_was_there()
  local engines = {}
  for k = 1, 2 do
    local e, loader, loaded = engine_and_loader(0)
    e:train_batch(loader)
    local fresh = 0
    for _, seg in ipairs(e.L.segments) do
      if seg.writes then
        fresh = fresh + 1
        assert(e.reducer.fresh[seg], "a segment a Linear writes was zeroed by zero_grad")
        if k == 1 then e.grads:view(seg.full_offset, { seg.numel }):fill(0 / 0) end
      else
        assert(not e.reducer.fresh[seg])
      end
    end
    assert(fresh >= 4, "expected the block's Linear segments to be written, got " .. fresh)
    if k == 2 then -- the add path everywhere: zeros, nothing fresh
      e.grads:zero()
      e.reducer.fresh = {}
    end
    local x, y = loader:next_batch()
    e:backward(e:forward(x, y))
    assert(next(e.reducer.fresh) == nil, "every fresh segment was written or zeroed")
    engines[k] = { e = e, loader = loader, loaded = loaded }
  end
  local a, b = engines[1].e.grads, engines[2].e.grads
  assert(bytes_of(a) == bytes_of(b), "written gradients differ from added ones")
  assert(a:sq_norm() > 0 and a:sq_norm() < math.huge)
  for _, r in ipairs(engines) do r.e:free(); r.loader:free(); r.loaded.tokens:free() end
end

-- A MoE block's experts gathered whole are one segment their backward
-- writes (the grouped GEMMs' dW written, zeros for an expert no row
-- reached): garbage there changes nothing against the add into zeros
-- (tests/test_moe.c holds the kernel to it in bf16 and at moe-100m's shapes).
function T.moe_experts_write_their_gradients_over_whatever_was_there()
  local mixtral = require("models.mixtral")
  local function tiny() return mixtral.new(mixtral.config("mixtral-tiny", { vocab = 256 })) end
  local a, b
  for k = 1, 2 do
    local e, loader, loaded = engine_and_loader(0, 1, tiny())
    e:train_batch(loader)
    local experts = 0
    for _, seg in ipairs(e.L.segments) do
      if seg.module.is_moe_experts then
        assert(seg.writes and e.reducer.fresh[seg], "the experts' segment is not written")
        experts = experts + 1
        if k == 1 then e.grads:view(seg.full_offset, { seg.numel }):fill(0 / 0) end
      end
    end
    assert(experts == 2, "expected 2 blocks' experts written, got " .. experts)
    if k == 2 then e.grads:zero(); e.reducer.fresh = {} end
    local x, y = loader:next_batch()
    e:backward(e:forward(x, y))
    local g = e.grads
    if k == 1 then a = bytes_of(g) else b = bytes_of(g) end
    assert(g:sq_norm() > 0 and g:sq_norm() < math.huge)
    e:free(); loader:free(); loaded.tokens:free()
  end
  assert(a == b, "written expert gradients differ from added ones")
end

-- A fresh segment no backward reached reads zero: at the accumulation's
-- end (wait_all) and whenever the REPL reads the buffers (settle_grads).
function T.unwritten_fresh_segments_read_zero()
  local e, loader, loaded = engine_and_loader(1)
  e:train_batch(loader)
  local seg
  for _, s in ipairs(e.L.segments) do if s.writes then seg = s end end
  local g = e.grads:view(seg.full_offset, { seg.padded })
  g:fill(1)
  e:settle_grads()
  assert(g:sq_norm() == 0, "settle_grads left a fresh segment unzeroed")
  assert(next(e.reducer.fresh) == nil)
  -- Fresh again after a step; the module skipped: wait_all at the boundary zeros it.
  e:train_batch(loader)
  assert(e.reducer.fresh[seg])
  g:fill(1)
  e.micro = e.micro + 1 -- (a backward that reached nothing)
  e.reducer:wait_all()
  assert(g:sq_norm() == 0, "wait_all at the boundary left a fresh segment unzeroed")
  g:free()
  e:free(); loader:free(); loaded.tokens:free()
end

-- The profile counts zero_grad's bytes: fewer than a whole gradient
-- buffer's once the Linears write theirs.
function T.zero_grad_zeros_only_what_no_backward_writes()
  local e, loader, loaded = engine_and_loader(0)
  local profile = require("luazero.profile")
  local p = profile.attach(e)
  for _ = 1, 3 do e:train_batch(loader) end
  local rep = p:report()
  p:detach()
  local pb = assert(rep.param_bytes, "the profile has a bytes-per-parameter line")
  local zero_part
  for _, pt in ipairs(pb.parts) do if pt.name:find("zero", 1, true) then zero_part = pt end end
  local written = 0
  for _, seg in ipairs(e.L.segments) do if seg.writes then written = written + seg.padded end end
  local want = 4 * (e.L.full_numel - written) / e.L.full_numel
  assert(zero_part and math.abs(zero_part.per_param - want) < 1e-9,
         ("zero gradients: %s bytes per parameter, want %.4f")
         :format(zero_part and zero_part.per_param or "none", want))
  assert(want < 4)
  e:free(); loader:free(); loaded.tokens:free()
end

-- Reductions add each micro-step's gradients into the optimizer's (stage 2,
-- accumulation): the first micro-step copies instead, so whatever those
-- held after the last step changes nothing.
function T.first_reduction_copies_over_whatever_was_there()
  local sums = {}
  for k = 1, 2 do
    local e, loader, loaded = engine_and_loader(2, 2)
    assert(e:plan().reduce.buffered)
    e:train_batch(loader)
    if k == 1 then e.rgrads:fill(0 / 0) end
    for _ = 1, 2 do e:train_batch(loader) end
    sums[k] = e:params_checksum()
    e:free(); loader:free(); loaded.tokens:free()
  end
  assert(sums[1] == sums[2], "garbage in the reduced gradients changed the run: " ..
         sums[1] .. " vs " .. sums[2])
end

-- The last micro-step's reduction adds into the slice the norm reads: its
-- partial comes from that add (add_sq_norm), the norm's own pass reads
-- nothing, and the norm is the one sq_norm gives, bit for bit.
function T.grad_norm_comes_from_the_last_reduction()
  local norms, passes = {}, {}
  for k = 1, 2 do
    local e, loader, loaded = engine_and_loader(2, 2)
    if k == 2 then e.reducer.norm_slice = nil end -- (every partial its own sq_norm)
    local profile = require("luazero.profile")
    local p = profile.attach(e)
    local recs = {}
    for i = 1, 3 do recs[i] = e:train_batch(loader).grad_norm end
    local rep = p:report()
    p:detach()
    norms[k] = recs
    local parts = {}
    for _, pt in ipairs(rep.param_bytes.parts) do parts[pt.name] = pt end
    passes[k] = parts["sq_norm (grad norm)"] and parts["sq_norm (grad norm)"].passes or 0
    e:free(); loader:free(); loaded.tokens:free()
  end
  same_norms(norms[1], norms[2], "from the reduction")
  assert(passes[1] == 0, "the norm still read the gradients: " .. passes[1] .. " pass")
  assert(passes[2] > 0.99, "sq_norm's pass: " .. passes[2])
end

-- At one rank the weight gradients' products take the norm's block
-- partials of what they write, in cache (zero/reduce.lua's
-- norm_blocks_for): the experts' grouped dW and the Linears' dW. The norm
-- reads the rest, and every step's norm and the run's checksum are those
-- of sq_norm's own pass, bit for bit. (Without accumulation: with it the
-- gradients are staged and the last reduction's add gives the partials,
-- above. An expert's part of 128 x 64 is two blocks, 48 x 64 none; GPT-2
-- at width 128 has Linears of 4 to 16 blocks.)
local function partials_against_the_pass(model_of)
  local norms, sums, passes, given = {}, {}, {}, 0
  for k = 1, 2 do
    local e, loader, loaded = engine_and_loader(0, 1, model_of())
    assert(not e:plan().reduce.buffered)
    if k == 2 then e.reducer.norm_blocks_for = function() return nil end end
    local read = e.reducer.slice_sq_norm
    e.reducer.slice_sq_norm = function(r, i, g) -- (count the partials the dW took)
      local nb = r.norm_blocks[i]
      for b = 0, nb and nb.count - 1 or -1 do
        if nb.blocks[b] == nb.blocks[b] then given = given + 1 end
      end
      return read(r, i, g)
    end
    local profile = require("luazero.profile")
    local p = profile.attach(e)
    norms[k] = {}
    for i = 1, 3 do norms[k][i] = e:train_batch(loader).grad_norm end
    local rep = p:report()
    p:detach()
    for _, pt in ipairs(rep.param_bytes.parts) do
      if pt.name == "sq_norm (grad norm)" then passes[k] = pt.passes end
    end
    sums[k] = e:params_checksum()
    e:free(); loader:free(); loaded.tokens:free()
  end
  assert(given > 0, "no block partial was taken by a dW")
  same_norms(norms[1], norms[2], "with the dW's partials")
  assert(sums[1] == sums[2], "checksums differ: " .. sums[1] .. " vs " .. sums[2])
  assert(passes[2] > 0.99 and passes[1] < 0.5,
         ("the norm's pass read %.3f of the gradients with the partials, %.3f without")
         :format(passes[1], passes[2]))
  return passes[1]
end

function T.grad_norm_takes_the_experts_block_partials()
  local mixtral = require("models.mixtral")
  partials_against_the_pass(function()
    return mixtral.new(mixtral.config("mixtral-tiny", { vocab = 256, n_hidden = 128 }))
  end)
end

function T.grad_norm_takes_the_linears_block_partials()
  local gpt2 = require("models.gpt2")
  partials_against_the_pass(function()
    return gpt2.new(gpt2.config("gpt2-nano", { n_layer = 2, n_embd = 128, n_head = 2,
                                               context = 16 }))
  end)
end

-- Off the blocks (a width of 40: tasks end inside blocks, and an expert
-- with no rows gives its blocks +0 that its 128-row tasks would not take
-- when it has rows) and with two backwards before a step (the public API
-- allows it: both add into the gradients), the partials of the first are
-- forgotten, not mixed with the second's: the same norms as sq_norm's pass.
function T.grad_norm_partials_of_a_backward_before_the_last_are_forgotten()
  local mixtral = require("models.mixtral")
  local norms = {}
  for k = 1, 2 do
    local e, loader, loaded = engine_and_loader(0, 1, mixtral.new(mixtral.config(
      "mixtral-tiny", { vocab = 256, n_embd = 40, n_hidden = 200 })))
    if k == 2 then e.reducer.norm_blocks_for = function() return nil end end
    norms[k] = {}
    for i = 1, 6 do
      for _ = 1, 2 do
        local x, y = loader:next_batch()
        e:backward(e:forward(x, y))
      end
      norms[k][i] = e:step().grad_norm
    end
    e:free(); loader:free(); loaded.tokens:free()
  end
  same_norms(norms[1], norms[2], "with the dW's partials")
end

-- A Linear's backward given a wrapper's weight and gradient (Linear:backward's
-- w, dw) on a first micro-step: its own weight gradient reads zero, its bias
-- gradient is added into zeros.
function T.a_wrapper_s_weight_leaves_the_own_gradients_as_zeros_would()
  local e, loader, loaded = engine_and_loader(0)
  e:train_batch(loader)
  local x, y = loader:next_batch()
  e:forward(x, y)
  local seg
  for _, sg in ipairs(e.L.segments) do
    if sg.writes and sg.module.has_bias then seg = sg; break end
  end
  local m = seg.module
  e.grads:view(seg.full_offset, { seg.numel }):fill(0 / 0)
  local rows = m.input:numel() / m.n_in
  local dy = lz.tensor({ m.input:dim(1), m.input:dim(2), m.n_out }, "f32"):fill(0.5)
  local dw = lz.tensor({ m.n_out, m.n_in }, "f32"):zero()
  local arena, saved = lz.arena(1048576, "workspace"), m.ctx.scratch
  m.ctx.scratch = arena -- (dx goes here: the forward's arenas are full)
  m.grads_write = true
  m:backward(dy, m:weight(), dw)
  m.ctx.scratch = saved
  arena:free()
  assert(m.grads_write == nil)
  assert(m.g.weight:sq_norm() == 0, "the own weight gradient is not zero")
  local want = m.n_out * (rows * 0.5) ^ 2
  assert(m.g.bias:sq_norm() == want, ("bias gradient %.17g, want %.17g")
                                     :format(m.g.bias:sq_norm(), want))
  assert(dw:sq_norm() > 0 and dw:sq_norm() < math.huge)
  dy:free(); dw:free()
  e:free(); loader:free(); loaded.tokens:free()
end

return T
