-- test_gemma.lua — models/gemma.lua and models/gemma2.lua: the named sizes'
-- parameter counts, their config.json fields and refusals, the parts they
-- build (GeGLU, 1 + weight norms, scaled embeddings, four norms a layer, a
-- soft-capped head), and a Gemma 2 shape end to end at world 2: stages 0-3
-- and activation checkpointing end with one params_checksum, fp32 and bf16.
local cjson = require("cjson")
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local models = require("models.registry")
local gemma2 = require("models.gemma2")

local T = {}
local q = support.quote
local write_file = support.scratch()
local eq = support.eq

-- Hugging Face's counts: gemma-2b 2,506,172,416; gemma-7b 8,537,680,896;
-- gemma-2-2b 2,614,341,888; gemma-2-9b 9,241,705,984; gemma-3-1b 999,885,952.
function T.named_sizes_have_hugging_faces_parameter_counts()
  for name, n in pairs({ ["gemma-2b"] = 2506172416, ["gemma-7b"] = 8537680896,
                         ["gemma-2-2b"] = 2614341888, ["gemma-2-9b"] = 9241705984,
                         ["gemma-3-1b"] = 999885952 }) do
    local m = models.new(models.config(name))
    eq(m:count_params(), n, name)
    m:free()
  end
  local n = models.new(models.config("gemma-100m")):count_params()
  assert(n > 95e6 and n < 105e6, "gemma-100m has " .. n .. " parameters")
end

-- The norms start at 0 (a factor of 1) and the embedding's scale is
-- sqrt(hidden); Gemma 2's layer holds four norms in the order they run.
function T.the_parts_are_gemmas()
  local m = models.new(models.config("gemma-tiny"))
  local names = {}
  for _, e in ipairs(m.param_table) do names[#names + 1] = e.name end
  local norm = m.layers.blocks[1].attn_norm
  eq(norm.offset, 1, "norm offset")
  eq(norm.params[1].init.kind, "zeros", "norm weight starts at 0")
  eq(m.embedding.scale, 8, "embedding scale sqrt(64)")
  assert(not m.untied_head, "gemma ties its head")
  eq(m.layers.blocks[1].mlp.forward_op, "geglu_forward", "GeGLU")
  local path = write_file("g2.json", cjson.encode({
    architectures = { "Gemma2ForCausalLM" }, hidden_size = 64, intermediate_size = 128,
    num_hidden_layers = 2, num_attention_heads = 4, num_key_value_heads = 2, head_dim = 32,
    max_position_embeddings = 32, vocab_size = 256, query_pre_attn_scalar = 32,
    sliding_window = cjson.null, attn_logit_softcapping = cjson.null,
    final_logit_softcapping = 2.5 }))
  local g = models.new(models.from_hf_config(path))
  local layer = {}
  for _, e in ipairs(g.param_table) do
    local rest = e.name:match("^model%.layers%.0%.(.*)%.weight$")
    if rest and rest:find("norm") then layer[#layer + 1] = rest end
  end
  eq(table.concat(layer, ","), "input_layernorm,post_attention_layernorm," ..
     "pre_feedforward_layernorm,post_feedforward_layernorm", "four norms")
  eq(g.final_softcap, 2.5, "final soft-cap")
  eq(table.concat(g.cfg.layer_types, ","), "sliding_attention,full_attention", "layer types")
end

-- A window the context fits in and the default scale change nothing: absent.
function T.attention_options_are_absent_where_they_change_nothing()
  local cfg = gemma2.finish({ n_layer = 2, n_head = 4, n_kv_head = 2, n_embd = 64,
                              head_dim = 32, n_hidden = 128, context = 64, vocab = 256,
                              window = 8, attn_softcap = 20, query_pre_attn_scalar = 24 })
  local o1, o2 = gemma2.attention_opts(cfg, 1), gemma2.attention_opts(cfg, 2)
  eq(o1.window, 8, "layer 1 slides")
  eq(o2.window, nil, "layer 2 is full")
  eq(o1.softcap, 20, "attention soft-cap")
  eq(o1.scale, 24 ^ -0.5, "query_pre_attn_scalar")
  cfg.window, cfg.query_pre_attn_scalar, cfg.attn_softcap = 64, 32, nil
  assert(next(gemma2.attention_opts(cfg, 1)) == nil, "no options")
end

-- hidden_act "gelu" is the tanh GELU (as transformers reads it); an exact
-- hidden_activation is refused in one line naming the field.
function T.config_json_fields_and_refusals()
  local base = { architectures = { "GemmaForCausalLM" }, hidden_size = 64,
                 intermediate_size = 128, num_hidden_layers = 2, num_attention_heads = 4,
                 num_key_value_heads = 1, head_dim = 32, max_position_embeddings = 32,
                 vocab_size = 256, hidden_act = "gelu" }
  local cfg = models.from_hf_config(write_file("g1.json", cjson.encode(base)))
  eq(cfg.family, "gemma", "family")
  eq(cfg.tie, true, "tied by default")
  base.hidden_activation = "gelu"
  local path = write_file("g1bad.json", cjson.encode(base))
  support.expect_error(function() models.from_hf_config(path) end,
                       "field hidden_activation is \"gelu\"; luazero's Gemma has the tanh GELU")
  base.hidden_activation = nil
  base.rope_parameters = { rope_type = "default", rope_theta = 5000 }
  eq(models.from_hf_config(write_file("g15.json", cjson.encode(base))).rope_theta, 5000,
     "rope_parameters.rope_theta (transformers 5)")
  local j = { architectures = { "Gemma2ForCausalLM" }, hidden_size = 64,
              intermediate_size = 128, num_hidden_layers = 2, num_attention_heads = 4,
              max_position_embeddings = 32, vocab_size = 256,
              layer_types = { "sliding_attention", "chunked_attention" } }
  path = write_file("g2bad.json", cjson.encode(j))
  support.expect_error(function() models.from_hf_config(path) end,
                       "field layer_types[1] is \"chunked_attention\"")
  -- transformers' values where the file leaves the keys out (Gemma 2: a
  -- window of 4096, caps 50 and 30; Gemma 3: a window of 4096), none where
  -- it says null; Gemma 3's attention cap is not applied, as in
  -- transformers 5.23; bidirectional attention is refused.
  j.layer_types = nil
  cfg = models.from_hf_config(write_file("g2min.json", cjson.encode(j)))
  eq(cfg.window, 4096, "Gemma 2's window where absent")
  eq(cfg.attn_softcap, 50, "attention cap where absent")
  eq(cfg.final_softcap, 30, "final cap where absent")
  j.sliding_window, j.attn_logit_softcapping = cjson.null, cjson.null
  j.final_logit_softcapping = cjson.null
  cfg = models.from_hf_config(write_file("g2null.json", cjson.encode(j)))
  assert(cfg.window == nil and cfg.attn_softcap == nil and cfg.final_softcap == nil,
         "null is none")
  j.sliding_window, j.attn_logit_softcapping, j.final_logit_softcapping = nil, nil, nil
  j.architectures = { "Gemma3ForCausalLM" }
  cfg = models.from_hf_config(write_file("g3min.json", cjson.encode(j)))
  assert(cfg.window == 4096 and cfg.attn_softcap == nil and cfg.final_softcap == nil,
         "Gemma 3's defaults")
  j.attn_logit_softcapping, j.final_logit_softcapping = 30, 15
  cfg = models.from_hf_config(write_file("g3cap.json", cjson.encode(j)))
  assert(cfg.attn_softcap == nil and cfg.final_softcap == 15, "Gemma 3 caps the logits only")
  for _, arch in ipairs({ "Gemma2ForCausalLM", "Gemma3ForCausalLM" }) do
    j.architectures, j.use_bidirectional_attention = { arch }, true
    path = write_file("gbidi.json", cjson.encode(j))
    support.expect_error(function() models.from_hf_config(path) end,
                         "field use_bidirectional_attention is true; luazero's Gemma is a " ..
                         "causal language model")
  end
end

-- Gemma 3's config.json as transformers 4.x writes it (rope_theta,
-- rope_local_base_freq, sliding_window_pattern) and as 5.x does (layer_types,
-- rope_parameters per layer type) give one config; the local layers turn by
-- their own base; the QK-norm's weights act as 1 + w.
function T.gemma3_reads_4x_and_5x_configs()
  local common = { hidden_size = 64, intermediate_size = 128, num_hidden_layers = 6,
                   num_attention_heads = 4, num_key_value_heads = 1, head_dim = 32,
                   max_position_embeddings = 64, vocab_size = 256, query_pre_attn_scalar = 32,
                   sliding_window = 512 }
  local j4 = { architectures = { "Gemma3ForCausalLM" }, rope_theta = 500000,
               rope_local_base_freq = 20000, sliding_window_pattern = 3 }
  local j5 = { architectures = { "Gemma3ForCausalLM" },
               layer_types = { "sliding_attention", "sliding_attention", "full_attention",
                               "sliding_attention", "sliding_attention", "full_attention" },
               rope_parameters = {
                 full_attention = { rope_type = "default", rope_theta = 500000 },
                 sliding_attention = { rope_type = "default", rope_theta = 20000 } } }
  local cfgs = {}
  for i, j in ipairs({ j4, j5 }) do
    for k, v in pairs(common) do j[k] = v end
    cfgs[i] = models.from_hf_config(write_file(("g3_%d.json"):format(i), cjson.encode(j)))
    eq(cfgs[i].family, "gemma3", "family")
    eq(cfgs[i].rope_theta, 500000, "global base")
    eq(cfgs[i].rope_local, 20000, "local base")
  end
  eq(table.concat(cfgs[1].layer_types, ","), table.concat(j5.layer_types, ","), "layer types")
  local m = models.new(cfgs[2])
  local blocks = m.layers.blocks
  assert(blocks[1].attn.rope == m.shared.rope_local and blocks[3].attn.rope == m.shared.rope,
         "local layers turn by the local base")
  eq(blocks[1].attn.qk_norm.offset, 1, "QK-norm scales by 1 + w")
  -- the full layers' linear scaling (Gemma 3 4B and up), a factor needed;
  -- another scaling, or one on the local layers, refused
  j5.rope_parameters.full_attention.rope_type = "linear"
  local path = write_file("g3bad.json", cjson.encode(j5))
  support.expect_error(function() models.from_hf_config(path) end,
                       "model config " .. path .. ": field rope_parameters.full_attention." ..
                       "factor must be a number > 0 (got null)")
  j5.rope_parameters.full_attention.factor = 8
  local lin = models.from_hf_config(write_file("g3lin.json", cjson.encode(j5)))
  eq(lin.rope_scaling.rope_type .. " " .. lin.rope_scaling.factor, "linear 8", "linear scaling")
  j5.rope_parameters.full_attention.rope_type = "yarn"
  path = write_file("g3yarn.json", cjson.encode(j5))
  support.expect_error(function() models.from_hf_config(path) end,
                       "field rope_parameters.full_attention.rope_type is \"yarn\"; only " ..
                       "\"default\" or \"linear\" is implemented")
  j5.rope_parameters.full_attention.rope_type = "default"
  j5.rope_parameters.sliding_attention.rope_type = "linear"
  path = write_file("g3loc.json", cjson.encode(j5))
  support.expect_error(function() models.from_hf_config(path) end,
                       "field rope_parameters.sliding_attention.rope_type is \"linear\"; only " ..
                       "\"default\" is implemented")
end

---------------------------------------------------------- end to end

local corpus = write_file("corpus.txt", ("Shall I compare thee to a summer's day?\n" ..
                                         "Thou art more lovely and more temperate:\n"):rep(60))
local g2 = write_file("gemma2.json", cjson.encode({
  architectures = { "Gemma2ForCausalLM" }, hidden_size = 64, intermediate_size = 128,
  num_hidden_layers = 2, num_attention_heads = 4, num_key_value_heads = 2, head_dim = 32,
  max_position_embeddings = 32, vocab_size = 256, query_pre_attn_scalar = 32,
  sliding_window = cjson.null, attn_logit_softcapping = cjson.null,
  final_logit_softcapping = 2.0 }))
local RUN = "--seq-len 16 --sample 0 --eval-batches 1 --seed 5 --data " .. q(corpus)
local _, capped_train = support.trainer(("--model-config %s %s"):format(q(g2), RUN))
-- gemma2-tiny: attention scores capped at 20, logits at 10, a window of 8 on
-- the first layer, query_pre_attn_scalar 24
local _, tiny_train = support.trainer("--model gemma2-tiny " .. RUN)

function T.soft_capped_gemma2_stages_0_to_3_agree_bitwise_at_world_2()
  local runs = { { "final cap", capped_train, "fp32" }, { "final cap", capped_train, "bf16" },
                 { "gemma2-tiny", tiny_train, "fp32" } }
  for _, run in ipairs(runs) do
    local what, ok_train, dtype = run[1], run[2], run[3]
    local sums = {}
    for stage = 0, 3 do
      local _, sum = ok_train(2, ("--steps 4 --stage %d --dtype %s --micro-batch 2")
                                 :format(stage, dtype))
      sums[#sums + 1] = sum
    end
    local _, ck = ok_train(2, ("--steps 4 --stage 3 --dtype %s --micro-batch 2 " ..
                               "--checkpoint-activations"):format(dtype))
    sums[#sums + 1] = ck
    print(("    gemma2 (%s) world 2 %s stages 0-3, checkpointing: %s"):format(what, dtype,
          table.concat(sums, " ")))
    for i = 2, #sums do eq(sums[i], sums[1], dtype .. " run " .. i) end
  end
end

return T
