-- test_moe.lua — the MoE block (nn/moe.lua, nn/moe_experts.lua) and its
-- families (models/mixtral.lua, qwen2_moe.lua, qwen3_moe.lua, olmoe.lua): the named
-- shapes' parameter counts (transformers' own), the checkpoint's names,
-- which layers are sparse, config.json's routing fields and refusals, an
-- expert no token reached gets exactly zero gradient, the jitter is keyed
-- by the run's seed and each block's layer and a checkpoint keeps its
-- generators (a resumed run ends on the straight run's bits),
-- the load-balancing loss joins the loss only where output_router_logits
-- says; and no hang by construction: under the launcher at world 1-4 with
-- adversarial routing (tests/lua/moe_check.lua: each rank's tokens all to
-- its own expert, most experts routed nowhere), the experts gathered whole
-- per block and one by one, every ZeRO stage finishes on the stage-0
-- checksum; with the same global batch at world sizes 1, 2 and 4 the first
-- step's language-model loss agrees within 1e-6 relative (the load-balancing
-- loss is per rank). (tests/ref/test5_moe.py holds them to transformers.)
local cjson = require("cjson")
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local models = require("models.registry")

local T = {}
local q, eq = support.quote, support.eq
local write_file = support.scratch()

-- transformers 5.23's counts of the same configs (built on the meta device).
function T.named_shapes_have_transformers_parameter_counts()
  local want = { ["mixtral-8x7b"] = 46702792704, ["qwen1.5-moe-a2.7b"] = 14315784192,
                 ["qwen3-30b-a3b"] = 30532122624, ["olmoe-1b-7b"] = 6919161856 }
  for name, n in pairs(want) do eq(models.new(models.config(name)):count_params(), n, name) end
end

-- moe-100m: llama-100m with 8 experts of its MLP's width a layer, 2 a token.
function T.active_parameters_count_top_k_experts()
  local moe, llama = models.new(models.config("moe-100m")), models.new(models.config("llama-100m"))
  local mlp = 12 * 3 * 768 * 2048
  eq(moe:count_params(), llama:count_params() - mlp + 8 * mlp + 12 * 8 * 768, "moe-100m")
  eq(moe:count_active_params(), llama:count_params() - mlp + 2 * mlp + 12 * 8 * 768,
     "moe-100m active")
  eq(llama:count_active_params(), llama:count_params(), "a dense model's active parameters")
end

local function names_of(name, overrides)
  local out = {}
  for _, e in ipairs(models.new(models.config(name, overrides)).param_table) do
    out[e.name] = table.concat(e.shape, "x")
  end
  return out
end

function T.parameter_names_are_the_checkpoints()
  local m = names_of("mixtral-tiny")
  eq(m["model.layers.0.block_sparse_moe.gate.weight"], "8x64", "mixtral router")
  eq(m["model.layers.1.block_sparse_moe.experts.7.w1.weight"], "48x64", "mixtral w1")
  eq(m["model.layers.1.block_sparse_moe.experts.7.w3.weight"], "48x64", "mixtral w3")
  eq(m["model.layers.1.block_sparse_moe.experts.7.w2.weight"], "64x48", "mixtral w2")
  local q2 = names_of("qwen2-moe-tiny")
  eq(q2["model.layers.0.mlp.experts.3.gate_proj.weight"], "32x64", "qwen2_moe expert")
  eq(q2["model.layers.0.mlp.shared_expert.down_proj.weight"], "64x64", "shared expert")
  eq(q2["model.layers.0.mlp.shared_expert_gate.weight"], "1x64", "shared expert gate")
  eq(q2["model.layers.0.self_attn.q_proj.bias"], "64", "qkv bias")
  -- mlp_only_layers {1}: layer 1 is dense, of intermediate_size
  eq(q2["model.layers.1.mlp.gate_proj.weight"], "176x64", "dense layer")
  eq(q2["model.layers.1.mlp.gate.weight"], nil, "no router on a dense layer")
  local q3 = names_of("qwen3-moe-tiny", { sparse_step = 2 })
  eq(q3["model.layers.0.mlp.gate_proj.weight"], "176x64", "decoder_sparse_step 2: layer 0 dense")
  eq(q3["model.layers.1.mlp.experts.0.up_proj.weight"], "32x64", "layer 1 sparse")
  eq(q3["model.layers.1.self_attn.q_norm.weight"], "32", "QK-norm")
  local o = names_of("olmoe-tiny", { n_kv_head = 2 })
  eq(o["model.layers.0.self_attn.q_norm.weight"], "64", "OLMoE's q_norm spans the projection")
  eq(o["model.layers.0.self_attn.k_norm.weight"], "32", "OLMoE's k_norm spans the projection")
  eq(o["model.layers.1.mlp.experts.7.down_proj.weight"], "64x32", "OLMoE expert")
end

local function folder_with(j)
  local dir = write_file("x", "")
  dir = dir:gsub("/x$", "") .. "/" .. tostring(math.random(1e9))
  os.execute("mkdir -p " .. q(dir))
  support.write(dir .. "/config.json", cjson.encode(j))
  return dir .. "/config.json"
end

function T.config_json_routing_fields_are_read_not_assumed()
  local base = { architectures = { "Qwen3MoeForCausalLM" }, hidden_size = 64,
                 intermediate_size = 96, num_hidden_layers = 2, num_attention_heads = 4,
                 num_key_value_heads = 2, head_dim = 16, vocab_size = 256,
                 max_position_embeddings = 64, moe_intermediate_size = 32,
                 num_experts_per_tok = 2, num_local_experts = 6 }
  local cfg = models.from_hf_config(folder_with(base))
  eq(cfg.n_experts, 6, "transformers 5.x's num_local_experts")
  eq(cfg.norm_topk_prob, false, "norm_topk_prob defaults to transformers' false")
  eq(cfg.router_logits, false, "output_router_logits defaults to false")
  base.num_experts, base.norm_topk_prob, base.output_router_logits = 4, true, true
  base.router_aux_loss_coef, base.mlp_only_layers = 0.25, { 0 }
  cfg = models.from_hf_config(folder_with(base))
  eq(cfg.n_experts, 4, "num_experts first")
  eq(cfg.norm_topk_prob, true, "norm_topk_prob")
  eq(cfg.aux_coef, 0.25, "router_aux_loss_coef")
  eq(cfg.mlp_only_layers[1], 0, "mlp_only_layers")
  base.num_experts_per_tok = 5
  support.expect_error(function() models.from_hf_config(folder_with(base)) end,
                       "top_k 5 is more than the 4 experts (n_experts); set top_k to at most 4")
  base.num_experts_per_tok, base.use_sliding_window = 2, true
  support.expect_error(function() models.from_hf_config(folder_with(base)) end,
                       "use_sliding_window is not implemented for qwen3_moe")
end

-- A config.json without num_experts_per_tok or router_aux_loss_coef takes
-- each family's transformers config class defaults (MixtralConfig 2 and
-- 0.001, Qwen2MoeConfig 4 and 0.001, Qwen3MoeConfig 8 and 0.001,
-- OlmoeConfig 8 and 0.01).
function T.routing_defaults_are_each_familys_transformers_defaults()
  local common = { hidden_size = 64, intermediate_size = 96, num_hidden_layers = 2,
                   num_attention_heads = 4, num_key_value_heads = 2, vocab_size = 256,
                   max_position_embeddings = 64 }
  local cases = {
    { "MixtralForCausalLM", { num_local_experts = 8 }, 2, 0.001 },
    { "Qwen2MoeForCausalLM", { num_experts = 8, moe_intermediate_size = 32,
                               shared_expert_intermediate_size = 32 }, 4, 0.001 },
    { "Qwen3MoeForCausalLM", { num_experts = 8, moe_intermediate_size = 32, head_dim = 16 }, 8,
      0.001 },
    { "OlmoeForCausalLM", { num_experts = 8 }, 8, 0.01 },
  }
  for _, c in ipairs(cases) do
    local j = { architectures = { c[1] } }
    for k, v in pairs(common) do j[k] = v end
    for k, v in pairs(c[2]) do j[k] = v end
    local cfg = models.from_hf_config(folder_with(j))
    eq(cfg.top_k, c[3], c[1] .. "'s num_experts_per_tok")
    eq(cfg.aux_coef, c[4], c[1] .. "'s router_aux_loss_coef")
  end
end

-- A model on one batch: its loss, the model.
-- before(model), when given, runs before the forward.
local function one_batch(name, overrides, seed, before)
  local model = models.new(models.config(name, overrides))
  model:allocate():init_weights(seed or 1):prepare(2, 16)
  if before then before(model) end
  local x, y = lz.tensor({ 2, 16 }, "i32", "workspace"), lz.tensor({ 2, 16 }, "i32", "workspace")
  for i = 0, 31 do x:set(i, (i * 37) % 256); y:set(i, (i * 37 + 11) % 256) end
  local loss = model:forward(x, y)
  model:zero_grad()
  model:backward(1)
  x:free(); y:free()
  return loss, model
end

-- Every expert's gradient: zero exactly where the expert got no row.
function T.an_unrouted_expert_gets_zero_gradient()
  -- the first block's router all zeros: every token's probabilities tie,
  -- and top-2 picks experts 0 and 1 for all of them
  local _, model = one_batch("mixtral-tiny", nil, 1,
                             function(m) m.routers[1].gate.p.weight:fill(0) end)
  local block = model.routers[1]
  local idle, busy = 0, 0
  for e = 0, block.n_experts - 1 do
    local u = block.experts.units[e + 1]
    local g = u.module.g[u.keys[1]]
    local norm = g:sq_norm()
    if block.routing.count[e] == 0 then
      idle = idle + 1
      eq(norm, 0, "expert " .. e .. " (no rows) gradient")
    else
      busy = busy + 1
      assert(e < 2, "expert " .. e .. " got rows")
      assert(norm > 0, "expert " .. e .. " got rows but no gradient")
    end
  end
  eq(idle, 6, "experts without rows")
  model:free()
end

-- Under bf16 the cast arena holds the experts' rows cast for their GEMMs
-- (each expert's own rows, every copy kept to the end of the step; none
-- where the grouped GEMMs read rows written bf16): planned for the rows
-- there are, not for every row at every expert.
function T.bf16_expert_casts_are_planned_for_the_rows_there_are()
  for _, gather in ipairs({ "expert", "block" }) do
    local B, S = 2, 16
    local model = models.new(models.config("mixtral-tiny", { context = 32, moe_gather = gather }))
    local plan = model:arena_plan(B, S, "bf16")
    local engine = require("luazero.zero").initialize({
      model = model, seed = 1, comm = require("luazero.comm").init("local"),
      config = { train_micro_batch_size_per_gpu = B, bf16 = { enabled = true } } })
    engine:prepare(B, S)
    local x, y = lz.tensor({ B, S }, "i32", "workspace"), lz.tensor({ B, S }, "i32", "workspace")
    for i = 0, B * S - 1 do x:set(i, (i * 37) % 256); y:set(i, (i * 37 + 11) % 256) end
    engine:forward(x, y)
    engine:backward()
    local used = model.ctx.cast_arena:peak()
    x:free(); y:free(); engine:free(); model:free()
    assert(used <= plan.casts, ("gather %s: casts used %d > planned %d"):format(gather, used,
                                                                               plan.casts))
    -- (gather "expert" casts its rows: the plan within 10% of them; the
    -- grouped GEMMs' plan keeps room for that path, 3x their own casts)
    local slack = gather == "expert" and 1.1 or 3
    assert(plan.casts <= slack * used, ("gather %s: casts planned %d for %d used"):format(
      gather, plan.casts, used))
  end
end

function T.the_aux_loss_joins_only_with_output_router_logits()
  local with, m1 = one_batch("mixtral-tiny", { aux_coef = 0.5 })
  local without, m2 = one_batch("mixtral-tiny", { router_logits = false })
  local aux = m1.aux.loss
  assert(aux >= 1 and aux <= 8, "aux loss " .. aux .. " outside [1, E]")
  assert(math.abs(with - (without + 0.5 * aux)) < 1e-9 * with,
         ("loss %.12g is not %.12g + 0.5 * %.12g"):format(with, without, aux))
  eq(m2:router_metrics().aux_loss, nil, "no aux_loss logged without output_router_logits")
  m1:free(); m2:free()
end

-- The jitter's generator is keyed by the run's seed (ctx.seed, which the
-- engine sets) and the block's layer: the same seed draws the same noise,
-- another seed other noise, jitter 0 draws none, and the second block's
-- noise is not the first's shifted by one draw (as rng.new(layer, 11)
-- would give).
function T.router_jitter_is_keyed_by_the_runs_seed_and_layer()
  local function seeded(seed) return function(m) m.ctx.seed = seed end end
  local a, m1 = one_batch("mixtral-tiny", { jitter = 0.2 }, 1, seeded(5))
  local b, m2 = one_batch("mixtral-tiny", { jitter = 0.2 }, 1, seeded(5))
  local c, m3 = one_batch("mixtral-tiny", { jitter = 0.2 }, 1, seeded(6))
  local d, m4 = one_batch("mixtral-tiny", { jitter = 0 }, 1, seeded(5))
  local e, m5 = one_batch("mixtral-tiny", { jitter = 0 }, 1, seeded(6))
  eq(a, b, "the same seed, the same jitter")
  assert(a ~= c, ("seeds 5 and 6 drew the same jitter (loss %.17g)"):format(a))
  assert(a ~= d, "jitter 0.2 left the loss as it was")
  eq(d, e, "jitter 0: the loss under seeds 5 and 6")
  local first, second = m1.routers[1].noise, m1.routers[2].noise
  assert(first[0] ~= second[0] and first[1] ~= second[0],
         "the second block's jitter repeats the first block's")
  m1:free(); m2:free(); m3:free(); m4:free(); m5:free()
end

-- zero.initialize hands the run's seed to the model's generators.
function T.the_engine_keys_the_models_generators_by_its_seed()
  local zero = require("luazero.zero")
  local model = models.new(models.config("mixtral-tiny", { jitter = 0.2 }))
  local engine = zero.initialize({ model = model, seed = 9, batch = { 2, 16 },
                                   config = { train_micro_batch_size_per_gpu = 2 } })
  eq(model.ctx.seed, 9, "the model's ctx.seed")
  engine:free()
end

local corpus = write_file("corpus.txt", support.YORK:rep(60))

-- The metrics log: aux_loss beside the loss, the rows each expert got per
-- block (B x T x top-k a micro-step, over the step's micro-steps).
function T.the_metrics_log_has_aux_loss_and_tokens_per_expert()
  local log = write_file("moe.jsonl", "")
  local cmd = ("cd %s && %s scripts/train.lua --model mixtral-tiny --seq-len 16 --micro-batch 2 " ..
               "--grad-accum 2 --steps 2 --sample 0 --eval-batches 1 --data %s --log %s 2>&1")
              :format(q(lz.root), q(lz.executable()), q(corpus), q(log))
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  local recs = support.records(log)
  assert(#recs >= 2, out)
  for step = 1, 2 do
    local r = recs[step]
    assert(type(r.aux_loss) == "number" and r.aux_loss >= 1 and r.aux_loss <= 8,
           "aux_loss " .. tostring(r.aux_loss))
    eq(#r.expert_tokens, 2, "one list per MoE block")
    for _, counts in ipairs(r.expert_tokens) do
      local sum = 0
      for _, c in ipairs(counts) do sum = sum + c end
      eq(sum, 2 * 16 * 2 * 2, "rows of a step (B x T x top-k x micro-steps)")
    end
  end
end

-- LoRA on an MoE family: its default targets (each family file's
-- lora_default: q_proj and v_proj) on every layer's attention; the routers,
-- the shared expert's gate and the experts frozen, and no target reaches them.
function T.lora_adapts_attention_and_leaves_routers_and_experts_frozen()
  local lora = require("models.lora")
  for _, name in ipairs({ "mixtral-tiny", "qwen2-moe-tiny", "qwen3-moe-tiny", "olmoe-tiny" }) do
    local cfg = models.config(name)
    local model = models.new(cfg)
    eq(table.concat(lora.default_targets(model), ","), "q_proj,v_proj", name .. " default targets")
    eq(lora.apply(model, { r = 2 }), 2 * cfg.n_layer, name .. " adapted weights")
    local trained, routers = 0, 0
    for _, e in ipairs(model.param_table) do
      if not e.frozen then
        trained = trained + 1
        assert(e.name:find("%.self_attn%.[qv]_proj%.lora_[AB]%.weight$"), name .. ": " .. e.name ..
               " trains")
      elseif e.name:find("%.gate%.weight$") or e.name:find("experts%.") then
        routers = routers + 1
      end
    end
    eq(trained, 4 * cfg.n_layer, name .. " adapter tensors")
    assert(routers > 0, name .. ": no router or expert weight found frozen")
    for _, t in ipairs({ "gate", "experts", "w1", "gate_proj" }) do
      support.expect_error(function() lora.apply(models.new(cfg), { r = 2, targets = { t } }) end,
                           "no module named " .. t .. " to adapt")
    end
  end
end

-- LoRA on the experts (nn/lora_experts.lua): each expert's gate_up_proj and
-- down_proj adapters, gathered whole per block or per expert, get the
-- gradient a central difference of the loss gives (the last MoE block's, so
-- no routing downstream flips), and train with the router frozen.
local function expert_lora_gradients(gather)
  local lora = require("models.lora")
  local model = models.new(models.config("mixtral-tiny", { moe_gather = gather }))
  eq(lora.apply(model, { r = 2, alpha = 16, targets = { "experts.gate_up_proj",
                                                          "mlp.experts.down_proj" } }),
     2 * 2 * 8, "expert units adapted (2 blocks, 2 kinds, 8 experts)")
  model:allocate():init_weights(1):prepare(2, 16)
  for _, e in ipairs(model.param_table) do
    local adapter = e.name:find("experts%.%d+%.[%w_]+_proj%.lora_[AB]%.weight$") ~= nil
    assert((e.frozen == true) ~= adapter, e.name .. (adapter and " is frozen" or " trains"))
    if not e.frozen and e.name:find("lora_B") then -- B starts at zero
      local t = e.module.p[e.key]
      for i = 0, e.numel - 1 do t:set(i, 0.02 * math.sin(i + e.offset)) end
    end
  end
  local x, y = lz.tensor({ 2, 16 }, "i32", "workspace"), lz.tensor({ 2, 16 }, "i32", "workspace")
  for i = 0, 31 do x:set(i, (i * 37) % 256); y:set(i, (i * 37 + 11) % 256) end
  model:forward(x, y)
  model:zero_grad()
  model:backward(1)
  local checked = 0
  for _, e in ipairs(model.param_table) do
    if not e.frozen and e.name:find("^model%.layers%.1%.") then
      local t, g = e.module.p[e.key], e.module.g[e.key]
      local best, at = 0, 0
      for i = 0, e.numel - 1 do
        if math.abs(g:get(i)) > best then best, at = math.abs(g:get(i)), i end
      end
      if best > 0 then
        local v, h = t:get(at), 2e-3
        t:set(at, v + h)
        local lp = model:forward(x, y)
        t:set(at, v - h)
        local lm = model:forward(x, y)
        t:set(at, v)
        local fd = (lp - lm) / (2 * h)
        -- (5e-5: the central difference's rounding, fp32 losses over 2h)
        assert(math.abs(fd - g:get(at)) <= 1e-2 * best + 5e-5,
               ("%s[%d]: gradient %.6g, central difference %.6g"):format(e.name, at, g:get(at), fd))
        checked = checked + 1
      end
    end
  end
  assert(checked >= 16, "adapters with a gradient checked: " .. checked)
  x:free(); y:free()
  model:free()
end

function T.expert_lora_gradients_match_central_differences()
  expert_lora_gradients("block")
  expert_lora_gradients("expert")
end

function T.expert_lora_trains_to_one_checksum_at_stages_0_and_3()
  local try, train = support.trainer(("--model mixtral-tiny --seq-len 16 --sample 0 " ..
                                    "--eval-batches 1 --seed 7 --micro-batch 2 --data %s " ..
                                    "--lora-r 4 --lr 1e-2 --steps 3 --lora-targets " ..
                                    "q_proj,experts.gate_up_proj,experts.down_proj")
                                   :format(q(corpus)))
  local out, s0 = train(2, "--stage 0")
  assert(out:find("on 34 weights", 1, true), out)
  local ck = write_file("ck", ""):gsub("ck$", "expert-lora-ck")
  local _, s3 = train(2, "--stage 3 --save " .. q(ck))
  eq(s3, s0, "stage 3's checksum")
  -- Gathered per expert, each expert's adapters sit after its own weights in
  -- the table, not after all experts' (so the checksum, over the table in
  -- its order, is another), and draw the same numbers (keyed by their
  -- names): every step's loss, auxiliary loss and gradient norm are the
  -- same numbers.
  local logs = {}
  for _, g in ipairs({ "block", "expert" }) do
    local cfg = write_file("gather-" .. g .. ".json", ('{"moe": {"gather": "%s"}}'):format(g))
    local log = cfg:gsub("%.json$", ".jsonl")
    train(2, ("--stage 3 --config %s --log %s"):format(q(cfg), q(log)))
    logs[g] = support.records(log)
  end
  -- a checkpoint of one gathering resumes under it only (its table's
  -- order): the refusal names the config key
  local per = write_file("gather-expert.json", '{"moe": {"gather": "expert"}}')
  local out2, st2 = try(2, ("--stage 3 --config %s --resume %s"):format(q(per), q(ck)))
  assert(st2 == 2 and out2:find('holds a different model: ', 1, true) and
         out2:find(', and the config\'s "moe": {"gather": "block"}', 1, true), out2)
  eq(#logs.expert, #logs.block, "records")
  for i, r in ipairs(logs.block) do
    for _, k in ipairs({ "loss", "aux_loss", "grad_norm" }) do
      eq(logs.expert[i][k], r[k], ("step %s's %s, gathered per expert"):format(r.step, k))
    end
  end
end

-- --merge-lora folds the experts' adapters into the base: expert e's gate
-- and up weights gain s B_e[0:H] A_e and s B_e[H:2H] A_e (gate_up_proj's),
-- its down weight s B_e A_e (down_proj's), each checked against the PEFT
-- export's fused tensors for every expert of a block; the merged model's
-- loss is the adapted model's to fp32 rounding.
function T.merge_lora_folds_the_experts_adapters_into_the_base()
  local st_open = require("luazero.checkpoint.safetensors").open
  local dir = select(2, support.scratch())
  local flags = ("--seq-len 16 --sample 0 --eval-batches 1 --seed 7 --micro-batch 2 --data %s")
                :format(q(corpus))
  local _, ok_train = support.trainer(flags)
  local function ckpt(...)
    local out, st = support.sh(("cd %s && %s tools/ckpt.lua export %s"):format(
      q(lz.root), q(lz.executable()), table.concat({ ... }, " ")))
    assert(st == 0, out)
    return out
  end
  ok_train(1, ("--model mixtral-tiny --steps 1 --save %s/base"):format(dir))
  ckpt(dir .. "/base", dir .. "/hf")
  local lora = ("--init %s/hf --lora-r 4 --lora-alpha 8 --lr 2e-2 --stage 3 --lora-targets " ..
                "q_proj,experts.gate_up_proj,experts.down_proj"):format(dir)
  ok_train(2, ("--steps 3 %s --save %s/ft"):format(lora, dir))
  local out = ok_train(2, ("--steps 3 %s --resume %s/ft"):format(lora, dir))
  local v1 = tonumber((assert(out:match("val_loss (%S+)"), out)))
  local said = ckpt(dir .. "/ft", dir .. "/merged", "--merge-lora")
  -- q_proj on 2 layers, 3 projections of 8 experts on 2 blocks
  assert(said:find("50 with adapters folded in", 1, true), said)
  ckpt(dir .. "/ft", dir .. "/peft")
  local base, merged = st_open(dir .. "/hf/model.safetensors"), st_open(dir .. "/merged/model.safetensors")
  local peft = st_open(dir .. "/peft/adapter_model.safetensors")
  local function read(f, name)
    local t = assert(f.tensors[name], name)
    local buf = require("ffi").new("float[?]", t.numel)
    f:read(t, 0, t.numel, buf)
    return buf, t.shape
  end
  local pre = "base_model.model.model.layers.1.mlp.experts."
  local A1, a1s = read(peft, pre .. "base_layer.lora_A.weight") -- gate_up: [E r, C]
  local B1, b1s = read(peft, pre .. "base_layer.lora_B.weight") -- [2H, r E]
  local A2 = read(peft, pre .. "lora_A.weight")                   -- down: [E r, H]
  local B2 = read(peft, pre .. "lora_B.weight")                   -- [C, r E]
  local E, r, H2 = 8, 4, b1s[1]
  local H, s, worst, moved = H2 / 2, 8 / 4, 0, 0
  for e = 0, E - 1 do
    for k, name in ipairs({ "w1", "w3", "w2" }) do
      local n = ("model.layers.1.block_sparse_moe.experts.%d.%s.weight"):format(e, name)
      local w, shape = read(base, n)
      local m = read(merged, n)
      local A, B, row = A1, B1, (k - 1) * H
      if k == 3 then A, B, row = A2, B2, 0 end
      for i = 0, shape[1] - 1 do
        for j = 0, shape[2] - 1 do
          local d = 0
          for t = 0, r - 1 do d = d + B[(row + i) * r * E + t * E + e] * A[(e * r + t) * shape[2] + j] end
          local want = w[i * shape[2] + j] + s * d
          worst = math.max(worst, math.abs(m[i * shape[2] + j] - want))
          moved = math.max(moved, math.abs(s * d))
        end
      end
    end
  end
  base:close(); merged:close(); peft:close()
  assert(moved > 1e-3, "the adapters trained: " .. moved)
  assert(worst <= 1e-6, ("merged experts differ from W + s B A by %g"):format(worst))
  -- (at world 2, as the LoRA run: the same validation rows on each rank)
  out = ok_train(2, ("--steps 0 --init %s/merged"):format(dir))
  local v2 = tonumber((assert(out:match("val_loss (%S+)"), out)))
  assert(math.abs(v1 - v2) <= 1e-5 * math.abs(v1),
         ("merged model's val_loss %s, the LoRA model's %s"):format(v2, v1))
  print(("    16 experts x 3 weights within %g of W + s B A (largest change %g); val_loss %s " ..
         "and %s"):format(worst, moved, v1, v2))
end

-- Mixtral's router jitter draws from one generator per block; a checkpoint
-- keeps where each stands (the manifest's generators), so a run resumed at
-- step 2 draws the noise the uninterrupted run drew and ends on its bits.
function T.a_resumed_run_with_router_jitter_ends_on_the_straight_runs_checksum()
  local mixtral = require("models.mixtral")
  local function trainer(jitter)
    local mcfg = write_file(("jitter-%g.json"):format(jitter), cjson.encode(
      mixtral.hf.config_json(models.config("mixtral-tiny", { jitter = jitter }))))
    local _, train = support.trainer(("--model-config %s --seq-len 16 --sample 0 " ..
                                      "--eval-batches 1 --seed 7 --micro-batch 2 --stage 3 " ..
                                      "--data %s"):format(q(mcfg), q(corpus)))
    return train
  end
  local train = trainer(0.1)
  local ck = write_file("ck", ""):gsub("ck$", "jitter-ck")
  local _, straight = train(2, "--steps 4")
  local _, saved = train(2, "--steps 4 --save-every 2 --save " .. q(ck))
  local _, resumed = train(2, "--steps 4 --resume " .. q(ck .. "/step-000002"))
  eq(saved, straight, "the run that saved")
  eq(resumed, straight, "resumed at step 2")
  local f = assert(io.open(ck .. "/step-000002/manifest.json"))
  local m = cjson.decode(f:read("*a"))
  f:close()
  local n = 0
  for path, state in pairs(m.generators or {}) do
    assert(path:find("block_sparse_moe$") and #state == 16, path .. " " .. tostring(state))
    n = n + 1
  end
  eq(n, 2, "generators saved (one per MoE block)")
  local _, without = trainer(0)(2, "--steps 4")
  assert(without ~= straight, "jitter 0.1 left the run's checksum as it was")
end

-- The routing options the MoE families declare as run settings (their
-- run_fields: the jitter, the load-balancing loss and its weight) may change
-- on a resume; the architecture (top_k here) may not, and the refusal names it.
function T.a_resume_may_change_the_routers_run_settings_not_its_top_k()
  local mixtral = require("models.mixtral")
  local function trainer(over)
    local mcfg = write_file("run-fields.json", cjson.encode(
      mixtral.hf.config_json(models.config("mixtral-tiny", over))))
    return support.trainer(("--model-config %s --seq-len 16 --sample 0 --eval-batches 1 " ..
                            "--seed 7 --micro-batch 2 --data %s"):format(q(mcfg), q(corpus)))
  end
  local ck = write_file("ck", ""):gsub("ck$", "run-fields-ck")
  local _, train = trainer({ jitter = 0.1, aux_coef = 0.02, router_logits = true })
  train(1, "--steps 1 --save " .. q(ck))
  _, train = trainer({ jitter = 0, aux_coef = 0.5, router_logits = false })
  train(1, "--steps 2 --resume " .. q(ck))
  local try = trainer({ jitter = 0.1, aux_coef = 0.02, router_logits = true, top_k = 1 })
  local out, st = try(1, "--steps 2 --resume " .. q(ck))
  assert(st == 2 and out:find("holds a different model: its top_k is 2, this model's 1", 1, true),
         out)
end

-- The same global batch at world sizes 1, 2 and 4 (tests/lua/moe_world_check.lua):
-- the first step's language-model loss (the loss less the coefficient times
-- the ranks' mean load-balancing loss) agrees within 1e-6 relative for each
-- family at stages 0 and 3, while the loss itself does not: the
-- load-balancing loss is each rank's own, over its own tokens.
function T.the_first_steps_language_model_loss_agrees_across_world_sizes()
  local lm, total = {}, {}
  for _, n in ipairs({ 1, 2, 4 }) do
    local cmd = ("cd %s && timeout 600 %s %s tests/lua/moe_world_check.lua %s 2>&1")
                :format(q(lz.root), q(lz.executable()), n > 1 and ("-n " .. n) or "", q(corpus))
    local p = io.popen(cmd)
    local out = p:read("*a")
    p:close()
    assert(out:find("\ndone", 1, true), out)
    local aux = {}
    for key, r, a in out:gmatch("(%S+ %d) rank (%d) aux (%S+)") do
      aux[key] = aux[key] or {}
      aux[key][tonumber(r) + 1] = tonumber(a)
    end
    for key, loss, coef in out:gmatch("(%S+ %d) loss (%S+) coef (%S+)") do
      local a = aux[key] or {}
      eq(#a, n, key .. ": ranks that printed their aux loss at world " .. n)
      local sum = 0
      for _, v in ipairs(a) do sum = sum + v end
      lm[key] = lm[key] or {}
      lm[key][n] = tonumber(loss) - tonumber(coef) * sum / n
      total[key] = total[key] or {}
      total[key][n] = tonumber(loss)
    end
  end
  local seen = 0
  for key, by in pairs(lm) do
    seen = seen + 1
    for _, n in ipairs({ 2, 4 }) do
      local rel = math.abs(by[n] - by[1]) / math.abs(by[1])
      assert(rel <= 1e-6, ("%s: language-model loss %.12g at world %d, %.12g at world 1 " ..
                           "(relative %.1e)"):format(key, by[n], n, by[1], rel))
    end
    local rel = math.abs(total[key][4] - total[key][1]) / total[key][1]
    assert(rel > 1e-5, ("%s: the loss with the per-rank aux loss is the same at world 4 and 1 " ..
                        "(%.12g): the check would not see the aux loss"):format(key, total[key][1]))
  end
  eq(seen, 8, "families x stages checked")
end
-- moe_check.lua at world n in a mode (block, expert, routed) and ACCUM:
-- its lines { stage, sum, rows, read, full } and describe line.
local function moe_check(n, mode, accum)
  local cmd = ("cd %s && timeout 600 %s %s tests/lua/moe_check.lua %s %s %s 2>&1")
              :format(q(lz.root), q(lz.executable()), n > 1 and ("-n " .. n) or "", q(corpus),
                      mode, accum or "")
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  assert(out:find("\ndone", 1, true), out)
  local runs = {}
  for stage, sum, rows, read, full in out:gmatch("stage (%d) (%x+) ([%d,]+) bytes (%d+) (%d+)") do
    runs[#runs + 1] = { stage = tonumber(stage), sum = sum, rows = rows, read = tonumber(read),
                        full = tonumber(full) }
  end
  eq(#runs, 4, "stages run (" .. mode .. ")")
  return runs, out
end

local lines = { block = "whole block", expert = "per expert", routed = "per expert, routed only" }

-- No hang by construction: stages 0-3 at each world size, the experts
-- gathered whole per block, one by one, and only those some rank routed to
-- (the bitmask), end on one checksum. At stage 3 the routed-only gathers
-- read n of the 8 experts' bytes (rank r's tokens all go to expert r).
local function adversarial(n)
  local sums = {}
  for _, mode in ipairs({ "block", "expert", "routed" }) do
    local runs, out = moe_check(n, mode)
    for _, r in ipairs(runs) do
      sums[#sums + 1] = r.sum
      eq(r.rows, "32,0,0,0,0,0,0,0", ("rank 0's tokens all at expert 0 (stage %d, %s)")
                                     :format(r.stage, mode))
    end
    local r3 = runs[4]
    if mode == "routed" then
      eq(r3.read * 8, r3.full * n, "stage 3 reads the bytes of the " .. n .. " routed experts")
    else
      eq(r3.read, r3.full, "stage 3 gathering every expert reads them all (" .. mode .. ")")
      assert(r3.read > 0, "stage 3 gathers experts")
    end
    assert(out:find("moe gather: " .. lines[mode] .. " (2 blocks of 8 experts)", 1, true), out)
  end
  for i = 2, #sums do eq(sums[i], sums[1], "run " .. i .. " checksum") end
  print(("    world %d: stages 0-3, gathered whole, per expert and routed only, end on %s")
        :format(n, sums[1]))
end

for n = 1, 4 do
  T[("adversarial_routing_finishes_on_one_checksum_at_world_%d"):format(n)] =
    function() adversarial(n) end
end

-- With 2 micro-steps a step and activation checkpointing, rank r routing to
-- expert r, then r + 2: an expert routed in the first micro-step and not in
-- the second still has its (zero) second reduction; the routed-only runs
-- end on the gather-all runs' checksum at every stage.
local function accumulated(n)
  local sums = {}
  for _, mode in ipairs({ "expert", "routed" }) do
    local runs = moe_check(n, mode, "accum")
    for _, r in ipairs(runs) do sums[#sums + 1] = r.sum end
    if mode == "routed" then
      -- (each micro-step routes to n experts of 8, whichever they are)
      eq(runs[4].read * 8, runs[4].full * n, "stage 3 reads n of 8 experts a micro-step")
    end
  end
  for i = 2, #sums do eq(sums[i], sums[1], "run " .. i .. " checksum") end
  print(("    world %d, 2 micro-steps, checkpointed: per expert and routed only end on %s")
        :format(n, sums[1]))
end

for _, n in ipairs({ 2, 4 }) do
  T[("routed_only_with_accumulation_and_checkpointing_ends_on_one_checksum_at_world_%d")
    :format(n)] = function() accumulated(n) end
end

return T
