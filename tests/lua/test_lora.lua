-- test_lora.lua — frozen parameters (model:freeze) and LoRA adapters
-- (models/lora.lua, --lora-r): only what trains gets gradients, optimizer
-- states and communication; frozen weights stay bitwise as they were; the
-- ZeRO stages agree bitwise; the sim device gives the cpu's numbers.
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local zero = require("luazero.zero")
local data = require("luazero.data")
local registry = require("models.registry")
local lora = require("models.lora")

local T = {}

local write_file = support.scratch()
local corpus_path = write_file("corpus.txt", ("Now is the winter of our discontent\n" ..
                                              "Made glorious summer by this sun of York;\n"):rep(60))

local function frozen_hash(engine) return engine:frozen_checksum() end

-- llama-tiny with adapters on q_proj, v_proj and the MLP's down_proj,
-- trained `steps` steps at stage `stage` on `device`; returns the losses,
-- the engine and whether the frozen weights stayed as they were.
local function lora_run(stage, device, steps, offload_param)
  local model = registry.new(registry.config("llama-tiny"))
  local adapted = lora.apply(model, { r = 4, alpha = 8, targets = { "q_proj", "v_proj", "down_proj" } })
  assert(adapted == 3 * 2, "adapted " .. adapted)
  local cfg = { train_micro_batch_size_per_gpu = 2, bf16 = { enabled = true },
                zero_optimization = { stage = stage, offload_param = offload_param,
                                      stage3_param_persistence_threshold = 64 },
                optimizer = { type = "AdamW", params = { lr = 1e-2, weight_decay = 0.0 } } }
  support.settle()
  local before = lz.mem()
  local engine = zero.initialize{ model = model, config = cfg, seed = 5, batch = { 2, 16 },
                                  device = device }
  local base = frozen_hash(engine)
  local corpus = data.load(corpus_path)
  local loader = data.loader(corpus, { B = 2, T = 16, seed = 1, vocab = 256 })
  local losses = {}
  for i = 1, steps do losses[i] = engine:train_batch(loader).loss end
  local after = lz.mem()
  local r = { losses = losses, unchanged = frozen_hash(engine) == base, engine = engine,
              optimizer = after.optimizer - before.optimizer, grads = after.grads - before.grads,
              checksum = engine:params_checksum() }
  loader:free()
  corpus.tokens:free()
  return r, model
end

function T.lora_trains_the_adapters_alone_and_the_base_stays_bitwise()
  local r, model = lora_run(2, "cpu", 12)
  assert(r.unchanged, "a frozen weight changed")
  assert(r.losses[#r.losses] < r.losses[1] - 0.05,
         ("loss did not fall: %g -> %g"):format(r.losses[1], r.losses[#r.losses]))
  -- What trains is the adapters: r (in + out) elements per adapted weight.
  local cfg, adapters = model.cfg, 0
  for _, e in ipairs(model.param_table) do
    if not e.frozen then
      assert(e.name:find("lora_[AB]%.weight$"), e.name .. " trains")
      -- 2-D weights: decayed, as DeepSpeed and the Trainer decay adapters
      assert(e.decay == true, e.name .. " is not decayed")
      adapters = adapters + e.numel
    end
  end
  local hd = cfg.n_embd / cfg.n_head
  local want = cfg.n_layer * 4 * ((cfg.n_embd + cfg.n_head * hd) + (cfg.n_embd + cfg.n_kv_head * hd) +
                                  (cfg.n_hidden + cfg.n_embd))
  assert(adapters == want, ("%d adapter elements, want %d"):format(adapters, want))
  -- The ledger: the optimizer's bytes are those of the adapters' fp32
  -- master, m and v (padded layout), and the gradients theirs.
  local L = r.engine.L
  assert(L.numel == adapters)
  assert(r.optimizer == 12 * L.full_numel,
         ("optimizer bytes %d, want 12 x %d (the adapters' master, m, v)"):format(r.optimizer,
                                                                                L.full_numel))
  assert(r.grads == 4 * L.full_numel, ("gradient bytes %d, want 4 x %d"):format(r.grads,
                                                                              L.full_numel))
  r.engine:free()
end

function T.lora_on_sim_and_every_stage_give_the_same_weights()
  local first = lora_run(0, "cpu", 3)
  local want = first.checksum
  first.engine:free()
  for _, c in ipairs({ { 1, "cpu" }, { 3, "cpu" }, { 0, "sim" }, { 3, "sim" } }) do
    local r = lora_run(c[1], c[2], 3)
    assert(r.unchanged, "a frozen weight changed")
    assert(r.checksum == want, ("stage %d on %s: %s, stage 0 on cpu: %s"):format(c[1], c[2],
                                                                               r.checksum, want))
    r.engine:free()
  end
end

-- At stage 3 the frozen base is partitioned and gathered per module like
-- the trained weights, also from host memory and from NVMe
-- (offload_param): the same adapters as stage 0, the base unchanged, and
-- no frozen weight left whole in memory but the small persistent ones.
function T.frozen_weights_are_partitioned_and_offloaded_at_stage_3()
  local first = lora_run(0, "cpu", 3)
  local want, base = first.checksum, first.engine:frozen_checksum()
  local whole = first.engine:frozen_bytes()
  first.engine:free()
  local nvme = support.scratch_dir and support.scratch_dir() or os.tmpname() .. ".d"
  os.execute("mkdir -p " .. support.quote(nvme))
  for _, c in ipairs({ { "none" }, { "cpu" }, { "nvme", nvme }, { "none", nil, "sim" } }) do
    local r = lora_run(3, c[3] or "cpu", 3, { device = c[1], nvme_path = c[2] })
    local what = ("stage 3, offload_param %s on %s"):format(c[1], c[3] or "cpu")
    assert(r.unchanged, what .. ": a frozen weight changed")
    assert(r.engine:frozen_checksum() == base, what .. ": a different frozen base")
    assert(r.checksum == want, ("%s: %s, stage 0: %s"):format(what, r.checksum, want))
    assert(r.engine.frozen.LF and not r.engine.frozen.whole, what .. ": frozen weights not partitioned")
    local held = r.engine:frozen_bytes()
    if c[1] == "nvme" then
      assert(held < whole / 4, ("%s: %d of %d frozen bytes in memory"):format(what, held, whole))
    end
    print(("    %s: %s, %d of %d frozen bytes in memory"):format(what, r.checksum, held, whole))
    r.engine:free()
  end
  os.execute("rm -rf " .. support.quote(nvme))
end

-- GPT-2 with its token table (tied to the LM head) and LayerNorms frozen:
-- stages agree, the frozen weights stay, the ledger holds the rest only.
function T.frozen_gpt2_parameters_stay_and_the_stages_agree()
  local gpt2 = require("models.gpt2")
  local sums
  for _, stage in ipairs({ 0, 3 }) do
    local model = gpt2.new(gpt2.config("gpt2-nano", { n_layer = 2, n_embd = 64, n_head = 4,
                                                      context = 32 }))
    local n = model:freeze("^transformer%.wte") + model:freeze("ln_")
    assert(n == 1 + 2 * 2 * 2 + 2, "froze " .. n)
    local cfg = { train_micro_batch_size_per_gpu = 2, zero_optimization = { stage = stage,
                  stage3_param_persistence_threshold = 128 },
                  optimizer = { type = "AdamW", params = { lr = 1e-2 } } }
    support.settle()
    local before = lz.mem()
    local engine = zero.initialize{ model = model, config = cfg, seed = 2, batch = { 2, 16 } }
    local base = frozen_hash(engine)
    local corpus = data.load(corpus_path)
    local loader = data.loader(corpus, { B = 2, T = 16, seed = 1, vocab = 256 })
    for _ = 1, 3 do engine:train_batch(loader) end
    assert(frozen_hash(engine) == base, "a frozen weight changed at stage " .. stage)
    local trainable = 0
    for _, e in ipairs(model.param_table) do
      if not e.frozen then trainable = trainable + e.numel end
    end
    assert(engine.L.numel == trainable)
    assert(lz.mem().optimizer - before.optimizer == 8 * engine.L.full_numel,
           "optimizer bytes beyond the trainable parameters'")
    local sum = engine:params_checksum()
    sums = sums or sum
    assert(sum == sums, ("stage %d: %s, stage 0: %s"):format(stage, sum, sums))
    engine:free(); loader:free(); corpus.tokens:free()
  end
end

local train, ok_train = support.trainer(("--model llama-tiny --seq-len 16 --sample 0 " ..
                                         "--eval-batches 1 --data %s"):format(
                                         support.quote(corpus_path)))

-- Frozen weights from no --init (drawn from the seed) are not saved: their
-- hash is, and a resume whose frozen weights differ (another seed) is
-- refused; the same seed resumes, at another stage and world size too.
function T.a_resume_checks_the_frozen_weights_it_does_not_hold()
  local _, dir = support.scratch()
  local flags = "--lora-r 2 --steps 3 --save-every 2 --save " .. support.quote(dir .. "/ck")
  ok_train(1, flags)
  local out, st = train(1, "--lora-r 2 --steps 3 --seed 5 --resume " .. support.quote(dir .. "/ck"))
  assert(st == 2 and out:find("was saved with frozen weights hashing to xxh64", 1, true) and
         out:find("make them as that run did (its seed, 1337", 1, true), out)
  ok_train(2, "--lora-r 2 --steps 3 --stage 3 --resume " .. support.quote(dir .. "/ck"))
end

-- GPT-2's adapters exported for its Conv1D layers, stored [in, out]: PEFT's
-- fan_in_fan_out true (false warned in PEFT, which set it itself).
function T.gpt2_adapters_export_fan_in_fan_out()
  local _, dir = support.scratch()
  local q = support.quote
  local out, st = support.sh(("cd %s && %s scripts/train.lua --model gpt2-nano --n-layer 1 " ..
    "--lora-r 2 --steps 1 --sample 0 --eval-batches 0 --seq-len 16 --micro-batch 2 --data %s " ..
    "--save %s/g && %s tools/ckpt.lua export %s/g %s/p"):format(q(lz.root), q(lz.executable()),
    q(corpus_path), dir, q(lz.executable()), dir, dir))
  assert(st == 0, out)
  local cfg = require("cjson").decode(lz.read_file(dir .. "/p/adapter_config.json"))
  assert(cfg.fan_in_fan_out == true, lz.read_file(dir .. "/p/adapter_config.json"))
end

function T.lora_flags_train_at_world_2_with_the_same_checksum_at_every_stage()
  local sums = {}
  for stage = 0, 3 do
    local out
    out, sums[stage] = ok_train(2, ("--steps 3 --stage %d --dtype bf16 --lora-r 4 " ..
                                   "--lora-targets q_proj,v_proj,o_proj"):format(stage))
    assert(out:find("lora: rank 4", 1, true), out)
    assert(sums[stage] == sums[0], ("stage %d: %s, stage 0: %s"):format(stage, sums[stage],
                                                                       sums[0]))
  end
end

-- Two ranks at stage 3 hold half the frozen base each (the log's ledger
-- figures, rank 0) and end with the stage-0 run's adapters.
function T.two_ranks_at_stage_3_hold_half_the_frozen_base_each()
  local got = {}
  for _, stage in ipairs({ 0, 3 }) do
    local log = write_file(("lora_w2_s%d.jsonl"):format(stage), "")
    -- (small modules are kept whole at stage 3: a low threshold partitions
    -- every matrix of this tiny model)
    local cfg = write_file(("lora_w2_s%d.json"):format(stage),
      ('{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": %d, ' ..
       '"stage3_param_persistence_threshold": 64}}'):format(stage))
    local out, sum = ok_train(2, ("--steps 2 --dtype bf16 --lora-r 4 --config %s --log %s")
                                 :format(support.quote(cfg), support.quote(log)))
    local recs = support.records(log)
    got[stage] = { sum = sum, params = recs[#recs - 1].mem.params }
    assert(out:find("lora: rank 4", 1, true), out)
  end
  print(("    params per rank: stage 0 %d bytes, stage 3 %d bytes"):format(got[0].params,
                                                                        got[3].params))
  assert(got[3].sum == got[0].sum, ("stage 3: %s, stage 0: %s"):format(got[3].sum, got[0].sum))
  assert(got[3].params < 0.6 * got[0].params and got[3].params > 0.4 * got[0].params,
         ("stage 3 holds %d parameter bytes per rank, stage 0 %d"):format(got[3].params,
                                                                         got[0].params))
end

-- The fine-tuning path: a tiny Llama trained, exported with Hugging Face
-- names, imported into a model with LoRA adapters, fine-tuned on another
-- text: the loss falls, the imported base stays bitwise, and the
-- optimizer's ledger bytes are the adapters' alone.
function T.fine_tuning_an_exported_llama_with_lora()
  local dir = select(2, support.scratch())
  local _, _ = ok_train(1, ("--steps 20 --save %s/ck"):format(dir))
  local out, st = support.sh(("cd %s && %s tools/ckpt.lua export %s/ck %s/hf"):format(
    support.quote(lz.root), support.quote(lz.executable()), dir, dir))
  assert(st == 0, out)
  local other = write_file("other.txt", ("It was the best of times, it was the worst of times, " ..
                                         "it was the age of wisdom.\n"):rep(80))
  local model = registry.new(registry.from_hf_config(dir .. "/hf/config.json"))
  lora.apply(model, { r = 4, alpha = 8, targets = { "q_proj", "v_proj" } })
  local cfg = { train_micro_batch_size_per_gpu = 4, zero_optimization = { stage = 2 },
                optimizer = { type = "AdamW", params = { lr = 1e-2 } } }
  support.settle()
  local before = lz.mem()
  local engine = zero.initialize{ model = model, config = cfg, seed = 9, batch = { 4, 16 } }
  require("luazero.hf").load_into(engine, dir .. "/hf")
  local base = frozen_hash(engine)
  local corpus = data.load(other)
  local loader = data.loader(corpus, { B = 4, T = 16, seed = 1, vocab = 256 })
  local first, last
  for i = 1, 25 do
    local loss = engine:train_batch(loader).loss
    if i == 1 then first = loss end
    last = loss
  end
  assert(last < first - 0.1, ("fine-tuning loss %g -> %g"):format(first, last))
  assert(frozen_hash(engine) == base, "an imported base weight changed")
  -- fp32: the adapters are their own master; m and v, 8 bytes each.
  local adapters = engine.L.numel
  assert(adapters == 2 * 4 * ((64 + 64) + (64 + 32)), "adapters " .. adapters) -- q, v per layer
  assert(lz.mem().optimizer - before.optimizer == 8 * engine.L.full_numel,
         "optimizer bytes beyond the adapters'")
  engine:free(); loader:free(); corpus.tokens:free()
end

-- Exports of a LoRA run: PEFT's adapter folder, and the adapters folded into
-- the base (--merge-lora), whose loss is the LoRA model's to the last bit.
function T.lora_exports_peft_adapters_and_a_merged_model_with_the_same_loss()
  local dir = select(2, support.scratch())
  local function ckpt(...)
    local out, st = support.sh(("cd %s && %s tools/ckpt.lua export %s"):format(
      support.quote(lz.root), support.quote(lz.executable()), table.concat({ ... }, " ")))
    return out, st
  end
  ok_train(1, ("--steps 5 --save %s/base"):format(dir))
  assert(select(2, ckpt(dir .. "/base", dir .. "/hf")) == 0)
  local lora_flags = ("--init %s/hf --lora-r 4 --lora-alpha 8 --lora-targets " ..
                      "q_proj,v_proj,down_proj"):format(dir)
  ok_train(1, ("--steps 4 %s --save %s/ft"):format(lora_flags, dir))
  local out = ok_train(1, ("--steps 4 %s --resume %s/ft"):format(lora_flags, dir))
  local v1 = assert(out:match("val_loss (%S+)"), out)
  -- PEFT's folder: every adapter under base_model.model., the settings.
  local o, st = ckpt(dir .. "/ft", dir .. "/peft")
  assert(st == 0, o)
  -- (a folder, never one .safetensors file: that name is refused, nothing made)
  o, st = ckpt(dir .. "/ft", dir .. "/one.safetensors")
  assert(st == 2 and o:find("a LoRA checkpoint exports a folder", 1, true) and
         not io.open(dir .. "/one.safetensors"), o)
  local cfg = require("cjson").decode(lz.read_file(dir .. "/peft/adapter_config.json"))
  assert(cfg.peft_type == "LORA" and cfg.r == 4 and cfg.lora_alpha == 8 and
         #cfg.target_modules == 3 and cfg.fan_in_fan_out == false,
         lz.read_file(dir .. "/peft/adapter_config.json"))
  local st_file = require("luazero.checkpoint.safetensors").open(dir .. "/peft/adapter_model.safetensors")
  assert(#st_file.names == 2 * 3 * 2, #st_file.names .. " adapter tensors")
  for _, n in ipairs(st_file.names) do
    assert(n:find("^base_model%.model%.model%.layers%.%d+%..*lora_[AB]%.weight$"), n)
  end
  st_file:close()
  -- Merged: a plain model whose loss is the adapted one's, to fp32
  -- rounding (the adapted model adds x A^T B^T to x W^T; the merged one
  -- multiplies by W + B A).
  o, st = ckpt(dir .. "/ft", dir .. "/merged", "--merge-lora")
  assert(st == 0, o)
  out = ok_train(1, ("--steps 0 --init %s/merged"):format(dir))
  local v2 = assert(out:match("val_loss (%S+)"), out)
  assert(math.abs(v1 - v2) <= 1e-6 * math.abs(v1),
         ("merged model's val_loss %s, the LoRA model's %s"):format(v2, v1))
  o, st = ckpt(dir .. "/base", dir .. "/nope", "--merge-lora")
  assert(st == 2 and o:find("is not a LoRA run's checkpoint", 1, true), o)
  -- A base that is not the one trained on is refused, as --resume refuses it.
  o, st = ckpt(dir .. "/ft", dir .. "/merged2", "--merge-lora --base " .. dir .. "/merged")
  assert(st == 2 and o:find("--base " .. dir .. "/merged: its weights hash to xxh64", 1, true), o)
  assert(select(2, ckpt(dir .. "/base", dir .. "/hf", "--dtype bf16")) == 0)
  o, st = ckpt(dir .. "/ft", dir .. "/merged2", "--merge-lora")
  assert(st == 2 and o:find("the run's --init " .. dir .. "/hf: its weights hash", 1, true), o)
  assert(not io.open(dir .. "/merged2"), "a refused merge left its folder")
end

-- Where adapters go is the family's table (models/llama.lua's
-- description.lora_targets): without its gate_proj entry, gate_proj is
-- unknown; that one entry back, q_proj, v_proj and gate_proj train. The
-- gate_proj adapters are LoRA wrappers around the MLP's Linear, get
-- gradients (B at once, A once B has moved) and change; the base stays.
function T.a_new_lora_target_is_one_entry_in_the_table()
  local llama = require("models.llama")
  local nn = require("luazero.nn")
  local where = {}
  for k, v in pairs(llama.description.lora_targets) do where[k] = v end
  where.gate_proj = nil
  local targets = { "q_proj", "v_proj", "gate_proj" }
  local model = registry.new(registry.config("llama-tiny"))
  support.expect_error(function()
    lora.apply(model, { r = 4, targets = targets, where = where })
  end, "lora: no module named gate_proj to adapt")
  where.gate_proj = { "mlp.gate_proj" }
  assert(lora.apply(model, { r = 4, alpha = 8, targets = targets, where = where }) ==
         3 * model.cfg.n_layer)
  local gate = {}
  for l = 0, model.cfg.n_layer - 1 do
    local mlp = model.model.layers[tostring(l)].mlp
    assert(getmetatable(mlp.gate_proj) == nn.LoRA and getmetatable(mlp.gate_proj.base) == nn.Linear,
           "gate_proj is a LoRA around the Linear")
    for _, ab in ipairs({ "A", "B" }) do
      gate[#gate + 1] = ("model.layers.%d.mlp.gate_proj.lora_%s.weight"):format(l, ab)
    end
  end
  local cfg = { train_micro_batch_size_per_gpu = 2, zero_optimization = { stage = 0 },
                optimizer = { type = "AdamW", params = { lr = 1e-2, weight_decay = 0.0 } } }
  local engine = zero.initialize{ model = model, config = cfg, seed = 5, batch = { 2, 16 } }
  local at = {}
  for _, seg in ipairs(engine.L.segments) do
    for _, e in ipairs(seg.entries) do at[e.entry.name] = { seg = seg, e = e } end
  end
  for _, name in ipairs(gate) do assert(at[name], name .. " trains") end
  -- A parameter in master_params (canonical order), or in the engine's
  -- full gradient buffer (padded segments).
  local function slice(buf, name, full)
    local x = at[name]
    local off = full and x.seg.full_offset + x.e.seg_offset or x.e.offset
    return buf:view(off, { x.e.numel })
  end
  local function norms(buf, full)
    local out = {}
    for i, name in ipairs(gate) do out[i] = slice(buf, name, full):sq_norm() end
    return out
  end
  local function hash(t) return lz.xxh64(t.data, t:bytes()) end
  local base = frozen_hash(engine)
  local p0 = engine:master_params()
  local before = norms(p0)
  local corpus = data.load(corpus_path)
  local loader = data.loader(corpus, { B = 2, T = 16, seed = 1, vocab = 256 })
  for _ = 1, 3 do engine:train_batch(loader) end
  -- One more forward and backward: every gate_proj adapter has a gradient.
  local x, y = loader:next_batch()
  engine:backward(engine:forward(x, y))
  local grads = norms(engine.grads, true)
  local p1 = engine:master_params()
  for i, name in ipairs(gate) do
    assert(grads[i] > 0, name .. " got no gradient")
    assert(hash(slice(p1, name)) ~= hash(slice(p0, name)), name .. " did not change")
  end
  assert(before[2] == 0, "lora_B starts at zero")
  assert(frozen_hash(engine) == base, "a frozen weight changed")
  p0:free(); p1:free()
  engine:free(); loader:free(); corpus.tokens:free()
end

function T.freezing_nothing_or_adapting_nothing_is_an_error()
  local model = registry.new(registry.config("llama-tiny"))
  support.expect_error(function() model:freeze("no_such_weight") end,
                       'freeze: no parameter name matches "no_such_weight"')
  -- (refused before the run writes anything: no --log file)
  local log = write_file("refused.jsonl", "")
  os.remove(log)
  local out, st = train(1, "--steps 1 --lora-r 4 --lora-targets qq_proj --log " ..
                           support.quote(log))
  assert(st == 2 and out:find("lora: no module named qq_proj to adapt", 1, true), out)
  out, st = train(1, "--steps 1 --lora-r 0 --log " .. support.quote(log))
  assert(st == 2 and out:find("lora: r must be", 1, true), out)
  assert(not io.open(log), "a refused LoRA run left its --log file")
end

-- A dotted target adapts the modules whose full name ends with it, as
-- PEFT's target_modules match: self_attn.q_proj every layer's q_proj,
-- layers.1.mlp.down_proj one layer's down_proj.
function T.dotted_targets_match_the_end_of_the_path()
  local model = registry.new(registry.config("llama-tiny"))
  local n = lora.apply(model, { r = 2, targets = { "self_attn.q_proj", "layers.1.mlp.down_proj" } })
  local names = {}
  for _, e in ipairs(model.param_table) do
    if e.name:find("lora_A") then names[#names + 1] = e.name end
  end
  support.eq(n, model.cfg.n_layer + 1, "adapted: " .. table.concat(names, " "))
  for _, name in ipairs(names) do
    assert(name:find("self_attn%.q_proj%.lora_A") or name:find("layers%.1%.mlp%.down_proj"), name)
  end
  support.expect_error(function()
    lora.apply(registry.new(registry.config("llama-tiny")), { r = 2, targets = { "mlp.qq_proj" } })
  end, "lora: no module named mlp.qq_proj to adapt")
end

return T
