-- test_qwen.lua — models/qwen2.lua and models/qwen3.lua: the named sizes'
-- parameter counts (Hugging Face's), config.json as transformers 4.x and 5.x
-- write it, which layers get a sliding window, the one-line refusals (other
-- rotary scalings, Qwen3's attention biases, unknown layer types), the
-- parameter names; then qwen2-tiny (q, k, v biases), qwen3-tiny (QK-norm,
-- head_dim apart from hidden / heads) and a windowed Qwen2 end to end at world
-- 2: ZeRO stages 0 and 3 end with one params_checksum, fp32 and bf16.
-- (tests/ref/test_qwen2.py and test5_qwen3.py hold them to transformers.)
local cjson = require("cjson")
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local models = require("models.registry")

local T = {}
local q = support.quote
local eq = support.eq
local write_file = support.scratch()

-- Hugging Face's counts (the safetensors' totals; tied heads counted once).
function T.named_sizes_have_hugging_faces_parameter_counts()
  local want = { ["qwen2.5-0.5b"] = 494032768, ["qwen2.5-1.5b"] = 1543714304,
                 ["qwen2.5-7b"] = 7615616512, ["qwen3-0.6b"] = 596049920,
                 ["qwen3-8b"] = 8190735360 }
  for name, n in pairs(want) do
    eq(models.new(models.config(name)):count_params(), n, name)
  end
  for _, name in ipairs({ "qwen2-100m", "qwen3-100m" }) do
    local n = models.new(models.config(name)):count_params()
    assert(n > 95e6 and n < 105e6, name .. " has " .. n .. " parameters")
  end
end

function T.parameter_names_are_hugging_faces()
  local names = {}
  for _, e in ipairs(models.new(models.config("qwen2-tiny")).param_table) do
    names[e.name] = table.concat(e.shape, "x")
  end
  eq(names["model.layers.0.self_attn.q_proj.bias"], "64", "qwen2 q_proj.bias")
  eq(names["model.layers.1.self_attn.k_proj.bias"], "32", "qwen2 k_proj.bias")
  eq(names["model.layers.1.self_attn.v_proj.bias"], "32", "qwen2 v_proj.bias")
  eq(names["model.layers.0.self_attn.o_proj.bias"], nil, "qwen2 o_proj has no bias")
  eq(names["lm_head.weight"], nil, "qwen2-tiny is tied")
  names = {}
  for _, e in ipairs(models.new(models.config("qwen3-tiny")).param_table) do
    names[e.name] = table.concat(e.shape, "x")
  end
  eq(names["model.layers.0.self_attn.q_norm.weight"], "32", "qwen3 q_norm.weight [head_dim]")
  eq(names["model.layers.1.self_attn.k_norm.weight"], "32", "qwen3 k_norm.weight [head_dim]")
  eq(names["model.layers.0.self_attn.q_proj.weight"], "128x64", "qwen3 q_proj: 4 heads of 32")
  eq(names["model.layers.0.self_attn.q_proj.bias"], nil, "qwen3 has no q_proj bias")
end

--------------------------------------------------------- config.json

-- Qwen/Qwen2.5-0.5B's config.json (transformers 4.x: rope_theta, torch_dtype).
local qwen25_json = {
  architectures = { "Qwen2ForCausalLM" }, attention_dropout = 0.0, bos_token_id = 151643,
  eos_token_id = 151643, hidden_act = "silu", hidden_size = 896, initializer_range = 0.02,
  intermediate_size = 4864, max_position_embeddings = 32768, max_window_layers = 24,
  model_type = "qwen2", num_attention_heads = 14, num_hidden_layers = 24,
  num_key_value_heads = 2, rms_norm_eps = 1e-06, rope_theta = 1000000.0,
  sliding_window = 32768, tie_word_embeddings = true, torch_dtype = "bfloat16",
  use_cache = true, use_mrope = false, use_sliding_window = false, vocab_size = 151936,
}

-- Qwen/Qwen3-0.6B's config.json.
local qwen3_json = {
  architectures = { "Qwen3ForCausalLM" }, attention_bias = false, attention_dropout = 0.0,
  bos_token_id = 151643, eos_token_id = 151645, head_dim = 128, hidden_act = "silu",
  hidden_size = 1024, initializer_range = 0.02, intermediate_size = 3072,
  max_position_embeddings = 40960, max_window_layers = 28, model_type = "qwen3",
  num_attention_heads = 16, num_hidden_layers = 28, num_key_value_heads = 8,
  rms_norm_eps = 1e-06, rope_scaling = cjson.null, rope_theta = 1000000,
  sliding_window = cjson.null, tie_word_embeddings = true, torch_dtype = "bfloat16",
  use_cache = true, use_sliding_window = false, vocab_size = 151936,
}

local function copy(t, changes)
  local c = {}
  for k, v in pairs(t) do c[k] = v end
  for k, v in pairs(changes or {}) do c[k] = v end
  return c
end

-- As transformers 5.x writes a config: rope_parameters, dtype, layer_types.
local function as_5x(j)
  local types = {}
  for i = 1, j.num_hidden_layers do types[i] = "full_attention" end
  return copy(j, { rope_theta = cjson.null, torch_dtype = cjson.null, dtype = "bfloat16",
                   layer_types = types,
                   rope_parameters = { rope_type = "default", rope_theta = j.rope_theta } })
end

local KEYS = { "n_layer", "n_head", "n_kv_head", "n_embd", "n_hidden", "context", "vocab", "eps",
               "rope_theta", "tie", "head_dim", "family" }

function T.config_json_of_transformers_4_and_5_gives_the_named_shape()
  for _, c in ipairs({ { qwen25_json, "qwen2.5-0.5b" }, { qwen3_json, "qwen3-0.6b" } }) do
    local named = models.config(c[2])
    for form, j in pairs({ ["4.x"] = c[1], ["5.x"] = as_5x(c[1]) }) do
      local cfg = models.from_hf_config(write_file(c[2] .. form .. ".json", cjson.encode(j)))
      for _, k in ipairs(KEYS) do
        eq(cfg[k], named[k], ("%s config.json (%s) %s"):format(c[2], form, k))
      end
    end
  end
  -- a Qwen3 config.json without head_dim: Qwen3Config's 128, not 1024 / 16
  local cfg = models.from_hf_config(write_file("nohd.json",
                                               cjson.encode(copy(qwen3_json, { head_dim = cjson.null }))))
  eq(cfg.head_dim, 128, "qwen3 head_dim default")
end

-- Transformers 5.x's layers: with use_sliding_window, those layer_types names
-- sliding_attention, else those from max_window_layers (0-based) on.
function T.sliding_windows_fall_on_the_layers_transformers_gives_them()
  local qwen2 = require("models.qwen2")
  local function windows(j)
    local cfg = models.from_hf_config(write_file("w.json", cjson.encode(j)))
    local out = {}
    for i = 1, cfg.n_layer do out[i] = tostring(qwen2.window_of(cfg, i) or 0) end
    return table.concat(out, ",")
  end
  local small = copy(qwen25_json, { num_hidden_layers = 4, sliding_window = 8 })
  eq(windows(small), "0,0,0,0", "use_sliding_window false")
  eq(windows(copy(small, { use_sliding_window = true, max_window_layers = 1 })), "0,8,8,8",
     "max_window_layers 1")
  eq(windows(copy(small, { use_sliding_window = true, max_window_layers = 1,
                           layer_types = { "sliding_attention", "full_attention",
                                           "sliding_attention", "full_attention" } })),
     "8,0,8,0", "layer_types")
  eq(windows(copy(small, { use_sliding_window = true, sliding_window = cjson.null })),
     "0,0,0,0", "sliding_window null")
  local q3 = copy(qwen3_json, { num_hidden_layers = 2, use_sliding_window = true,
                                sliding_window = 5, max_window_layers = 0 })
  local cfg = models.from_hf_config(write_file("q3w.json", cjson.encode(q3)))
  eq(models.new(cfg).layers.blocks[2].attn.window, 5, "qwen3's second layer's window")
end

function T.what_is_not_implemented_is_refused_in_one_line_exit_2()
  local types = {}
  for i = 1, 24 do types[i] = i == 4 and "linear_attention" or "full_attention" end
  local cases = {
    { copy(as_5x(qwen25_json), { layer_types = types }),
      "field layer_types[3] is \"linear_attention\"; expected \"full_attention\" or " ..
      "\"sliding_attention\"" },
    { copy(as_5x(qwen3_json), { rope_parameters = { rope_type = "yarn", factor = 4,
                                                    rope_theta = 1e6 } }),
      "field rope_parameters.rope_type is \"yarn\"; only \"default\" is implemented for qwen3" },
    { copy(qwen25_json, { rope_scaling = { type = "yarn", factor = 4 } }),
      "field rope_scaling.type is \"yarn\"; only \"default\" is implemented for qwen2" },
    { copy(qwen3_json, { attention_bias = true }),
      "field attention_bias is true; luazero's Qwen3 has no attention biases" },
  }
  local corpus = write_file("c.txt", ("abc "):rep(100))
  for i, c in ipairs(cases) do
    local path = write_file(("bad%d.json"):format(i), cjson.encode(c[1]))
    local out, st = support.sh(("cd %s && %s scripts/train.lua --model-config %s --data %s")
                               :format(q(lz.root), q(lz.executable()), q(path), q(corpus)))
    eq(st, 2, "exit status for " .. c[2])
    assert(out:find("model config " .. path .. ": " .. c[2], 1, true), out)
    local _, lines = out:gsub("\n", "")
    assert(lines <= 1, "one line:\n" .. out)
  end
end

---------------------------------------------------------- end to end

local corpus = write_file("corpus.txt", ("Shall I compare thee to a summer's day?\n" ..
                                         "Thou art more lovely and more temperate:\n"):rep(60))
local plain = write_file("zero.json", cjson.encode({
  train_batch_size = 4, gradient_clipping = 1.0,
  optimizer = { type = "AdamW", params = { lr = 3e-3, weight_decay = 0.1 } },
  zero_optimization = { stage3_param_persistence_threshold = 16, reduce_bucket_size = 20000,
                        stage3_prefetch_bucket_size = 20000 },
}))

-- qwen2-tiny's shape with a window of 5 on its second layer
local windowed = write_file("windowed.json", cjson.encode({
  architectures = { "Qwen2ForCausalLM" }, hidden_size = 64, intermediate_size = 176,
  num_hidden_layers = 2, num_attention_heads = 4, num_key_value_heads = 2,
  max_position_embeddings = 32, vocab_size = 256, rope_theta = 1000000, tie_word_embeddings = true,
  use_sliding_window = true, sliding_window = 5, max_window_layers = 1,
}))

function T.stages_0_and_3_agree_bitwise_at_world_2()
  local runs = { "--model qwen2-tiny --context 32", "--model qwen3-tiny --context 32",
                 "--model-config " .. q(windowed) }
  local plain_fp32
  for _, name in ipairs(runs) do
    local _, ok_train = support.trainer(name .. " --seq-len 16 --sample 0 --eval-batches 1 " ..
                                        "--seed 5 --data " .. q(corpus))
    for _, dtype in ipairs({ "fp32", "bf16" }) do
      local sums = {}
      for _, stage in ipairs({ 0, 3 }) do
        local _, sum = ok_train(2, ("--steps 6 --stage %d --dtype %s --config %s")
                                   :format(stage, dtype, q(plain)))
        sums[#sums + 1] = sum
      end
      print(("    %s world 2 %s stages 0, 3: %s"):format(name, dtype, table.concat(sums, " ")))
      eq(sums[2], sums[1], name .. " " .. dtype .. " stage 3")
      if dtype == "fp32" and name == runs[1] then plain_fp32 = sums[1] end
      if dtype == "fp32" and name == runs[3] then
        assert(sums[1] ~= plain_fp32, "the window changes the run")
      end
    end
  end
end

return T
