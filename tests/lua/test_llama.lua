-- test_llama.lua — models/llama.lua and its selection: the named sizes'
-- parameter counts, Hugging Face config.json files (Llama and GPT-2) and
-- their errors; then llama-tiny end to end through scripts/train.lua under
-- the launcher: stages 0-3 at world 2 end with one params_checksum (fp32 and
-- bf16, with gradient accumulation, activation checkpointing and every
-- offload tier), and a resumed run continues bitwise.
local cjson = require("cjson")
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local models = require("models.registry")
local llama = require("models.llama")

local T = {}
local q = support.quote
local write_file, tmp = support.scratch()

local eq = support.eq

-------------------------------------------------------------- sizes

-- Hugging Face's counts: TinyLlama 1,100,048,384; Llama 3 8B 8,030,261,248.
function T.named_sizes_have_hugging_faces_parameter_counts()
  local want = { ["tinyllama-1.1b"] = 1100048384, ["llama3-8b"] = 8030261248,
                 ["llama3.1-8b"] = 8030261248 }
  for name, n in pairs(want) do
    eq(models.new(models.config(name)):count_params(), n, name)
  end
  local m = models.new(models.config("llama-100m"))
  local n = m:count_params()
  assert(n > 95e6 and n < 105e6, "llama-100m has " .. n .. " parameters")
  eq(models.config("gpt2-nano").family, "gpt2", "gpt2-nano's family")
  local ok, err = pcall(models.config, "llama-huge")
  assert(not ok and err:find("unknown model 'llama-huge' (known: gpt2-nano", 1, true), err)
  assert(err:find("llama-tiny", 1, true), err)
end

-- Llama 3's frequencies: below 8192/4 positions of wavelength unchanged,
-- above 8192 divided by the factor 8, smoothly in between.
function T.llama3_scaled_frequencies_fall_in_three_bands()
  local plain = llama.inv_freq(llama.config("llama3-8b"))
  local scaled = llama.inv_freq(llama.config("llama3.1-8b"))
  local seen = { high = 0, low = 0, mid = 0 }
  for i = 1, #plain do
    local wavelen = 2 * math.pi / plain[i]
    if wavelen < 2048 then
      eq(scaled[i], plain[i], "high frequency " .. i); seen.high = seen.high + 1
    elseif wavelen > 8192 then
      assert(math.abs(scaled[i] - plain[i] / 8) <= 1e-7 * plain[i], "low frequency " .. i)
      seen.low = seen.low + 1
    else
      assert(scaled[i] < plain[i] and scaled[i] > plain[i] / 8, "medium " .. i)
      seen.mid = seen.mid + 1
    end
  end
  assert(seen.high > 0 and seen.low > 0 and seen.mid > 0, cjson.encode(seen))
end

--------------------------------------------------------- config.json

local tinyllama_json = {
  architectures = { "LlamaForCausalLM" }, hidden_act = "silu", hidden_size = 2048,
  initializer_range = 0.02, intermediate_size = 5632, max_position_embeddings = 2048,
  model_type = "llama", num_attention_heads = 32, num_hidden_layers = 22,
  num_key_value_heads = 4, rms_norm_eps = 1e-05, rope_scaling = cjson.null,
  tie_word_embeddings = false, torch_dtype = "float32", vocab_size = 32000,
}

function T.hugging_face_config_json_gives_the_named_shape()
  local cfg = models.from_hf_config(write_file("tinyllama.json", cjson.encode(tinyllama_json)))
  local named = models.config("tinyllama-1.1b")
  for _, k in ipairs({ "n_layer", "n_head", "n_kv_head", "n_embd", "n_hidden", "context", "vocab",
                       "eps", "rope_theta", "tie", "head_dim", "family" }) do
    eq(cfg[k], named[k], "tinyllama config.json " .. k)
  end
  eq(models.new(cfg):count_params(), 1100048384, "parameters")
  local l31 = {}
  for k, v in pairs(tinyllama_json) do l31[k] = v end
  l31.rope_scaling = { rope_type = "llama3", factor = 8.0, low_freq_factor = 1.0,
                       high_freq_factor = 4.0, original_max_position_embeddings = 8192 }
  l31.rope_theta = 500000
  local c31 = models.from_hf_config(write_file("l31.json", cjson.encode(l31)))
  eq(c31.rope_scaling.factor, 8, "rope_scaling.factor")
  local gpt2_json = { architectures = { "GPT2LMHeadModel" }, n_layer = 12, n_head = 12,
                      n_embd = 768, n_positions = 1024, vocab_size = 50257, model_type = "gpt2" }
  local g = models.from_hf_config(write_file("gpt2.json", cjson.encode(gpt2_json)))
  local named_g = models.config("gpt2")
  for _, k in ipairs({ "n_layer", "n_head", "n_embd", "context", "vocab", "family" }) do
    eq(g[k], named_g[k], "gpt2 config.json " .. k)
  end
  -- GPT-2's fields the model is built from (layer_norm_epsilon), and those
  -- it does not build, refused rather than ignored.
  gpt2_json.layer_norm_epsilon = 0.1
  eq(models.new(models.from_hf_config(write_file("gpt2e.json", cjson.encode(gpt2_json))))
     .transformer.ln_f.eps, 0.1, "layer_norm_epsilon")
  gpt2_json.n_inner = 3072
  models.from_hf_config(write_file("gpt2i.json", cjson.encode(gpt2_json)))
  for key, v in pairs({ activation_function = "relu", n_inner = 1024, scale_attn_weights = false,
                        scale_attn_by_inverse_layer_idx = true }) do
    local j = {}
    for k, x in pairs(gpt2_json) do j[k] = x end
    j[key] = v
    local path = write_file("gpt2bad.json", cjson.encode(j))
    support.expect_error(function() models.from_hf_config(path) end,
                         ("field %s is %s"):format(key, cjson.encode(v)))
  end
end

-- transformers 5.x writes the rope into rope_parameters (rope_theta and
-- Llama 3's scaling alike) and dtype for torch_dtype: the same configs.
function T.a_5x_config_json_reads_its_rope_parameters()
  local function as_5x(rope)
    local j = {}
    for k, v in pairs(tinyllama_json) do j[k] = v end
    j.rope_scaling, j.rope_theta, j.torch_dtype, j.dtype = nil, nil, nil, "float32"
    j.rope_parameters = rope
    return j
  end
  local plain = models.from_hf_config(write_file("l5.json", cjson.encode(as_5x(
    { rope_type = "default", rope_theta = 250000.0 }))))
  eq(plain.rope_theta, 250000, "rope_theta from rope_parameters")
  eq(plain.rope_scaling, nil, "the default rope: no scaling")
  local j31 = as_5x({ rope_type = "llama3", rope_theta = 500000.0, factor = 8.0,
                      low_freq_factor = 1.0, high_freq_factor = 4.0,
                      original_max_position_embeddings = 8192 })
  j31.hidden_size = 4096 -- Llama 3.1's head_dim of 128
  local l31 = models.from_hf_config(write_file("l31_5.json", cjson.encode(j31)))
  eq(l31.rope_theta, 500000, "Llama 3.1's rope_theta")
  local want, got = llama.inv_freq(models.config("llama3.1-8b")), llama.inv_freq(l31)
  eq(#got, #want, "frequencies")
  for i = 1, #want do eq(got[i], want[i], "scaled frequency " .. i) end
  local ok, why = pcall(models.from_hf_config, write_file("l5bad.json", cjson.encode(as_5x(
    { rope_type = "llama3", rope_theta = 500000.0, factor = 8.0 }))))
  assert(not ok and why:find("field rope_parameters.low_freq_factor is missing", 1, true), why)
end

function T.bad_config_json_is_one_line_naming_the_file_and_field_exit_2()
  local cases = {
    { { architectures = { "FalconForCausalLM" } },
      "field architectures[0] is \"FalconForCausalLM\": unknown architecture (known: " ..
      table.concat(require("luazero.families").architectures(), ", ") .. ")" },
    { { model_type = "llama", hidden_size = 64 }, "field num_hidden_layers is missing" },
    { { hidden_size = 64 }, "field architectures (or model_type) is missing" },
    { (function()
        local j = {}
        for k, v in pairs(tinyllama_json) do j[k] = v end
        j.num_key_value_heads = 5
        return j
      end)(), "num_attention_heads 32 is not a multiple of num_key_value_heads 5" },
    { (function()
        local j = {}
        for k, v in pairs(tinyllama_json) do j[k] = v end
        j.rope_scaling = { rope_type = "yarn", factor = 4 }
        return j
      end)(), "field rope_scaling.rope_type is \"yarn\"; only \"linear\", \"llama3\" or " ..
      "\"default\" is implemented for llama" },
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

-- tools/estimate takes the Llama names and config.json files.
function T.estimate_takes_llama_names_and_config_json()
  local json = write_file("tl.json", cjson.encode(tinyllama_json))
  for _, flag in ipairs({ "--model tinyllama-1.1b", "--model-config " .. q(json) }) do
    local out, st = support.sh(("cd %s && LUAZERO=%s tools/estimate %s --world 4 --budget 8GiB")
                               :format(q(lz.root), q(lz.executable()), flag))
    eq(st, 0, "tools/estimate " .. flag .. ":\n" .. out)
    assert(out:find("1,100,048,384 parameters", 1, true), out)
  end
  local out, st = support.sh(("cd %s && LUAZERO=%s tools/estimate --model llama-tiny " ..
                              "--micro-batch 2 --seq-len 64"):format(q(lz.root),
                                                                     q(lz.executable())))
  eq(st, 0, out)
  local m = models.new(models.config("llama-tiny"))
  local want = require("luazero.estimate").activations(m, 2, 64, "bf16").device
  assert(out:find(("activations per rank for micro-batches of 2 x 64 tokens: %s bytes")
                  :format(require("luazero.estimate").thousands(want)), 1, true), out)
end

---------------------------------------------------------- end to end

local corpus = write_file("corpus.txt", ("Shall I compare thee to a summer's day?\n" ..
                                         "Thou art more lovely and more temperate:\n"):rep(60))
local MODEL = "--model llama-tiny --context 32 --seq-len 16 --sample 0 --eval-batches 1 " ..
              "--seed 5 --data " .. q(corpus)
local _, ok_train = support.trainer(MODEL)
local swap_dir = tmp .. "/nvme"
os.execute("mkdir -p " .. q(swap_dir))

-- RMSNorm weights (64 elements) stay whole at stage 3; every other module's
-- parameters are partitioned.
local n_configs = 0
local function config(opt, param)
  n_configs = n_configs + 1
  local z = { stage3_param_persistence_threshold = 64, overlap_comm = true,
              reduce_bucket_size = 20000, stage3_prefetch_bucket_size = 20000,
              sub_group_size = 8192 }
  if opt then z.offload_optimizer = opt end
  if param then z.offload_param = param end
  return write_file(("cfg%d.json"):format(n_configs), cjson.encode({
    train_batch_size = 4, gradient_clipping = 1.0,
    optimizer = { type = "AdamW", params = { lr = 3e-3, weight_decay = 0.1 } },
    zero_optimization = z, aio = { block_size = 8192, queue_depth = 4 },
  }))
end
local plain = config()

local function checksum(stage, dtype, extra, cfg)
  local _, sum = ok_train(2, ("--steps 8 --stage %d --dtype %s --config %s %s")
                             :format(stage, dtype, q(cfg or plain), extra or ""))
  return sum
end

local function all_equal(what, sums)
  print(("    %s: %s"):format(what, table.concat(sums, " ")))
  for i = 2, #sums do
    assert(sums[i] == sums[1], ("%s: run %d's checksum %s != %s"):format(what, i, sums[i],
                                                                         sums[1]))
  end
end

function T.stages_0_to_3_agree_bitwise_at_world_2_with_accumulation_and_checkpointing()
  for _, dtype in ipairs({ "fp32", "bf16" }) do
    local sums, acc, ck = {}, {}, {}
    for stage = 0, 3 do
      sums[#sums + 1] = checksum(stage, dtype)
      acc[#acc + 1] = checksum(stage, dtype, "--grad-accum 2")
    end
    all_equal("llama-tiny world 2 " .. dtype .. " stages 0-3", sums)
    all_equal("llama-tiny world 2 " .. dtype .. " stages 0-3, accumulation 2", acc)
    -- checkpointed blocks replay the same kernels: the same bits as without
    ck = { sums[1], checksum(0, dtype, "--checkpoint-activations"),
           checksum(3, dtype, "--checkpoint-activations") }
    all_equal("llama-tiny world 2 " .. dtype .. " activation checkpointing, stages 0 and 3", ck)
  end
end

function T.offload_tiers_end_with_the_checksum_of_the_run_without()
  local nvme = { device = "nvme", nvme_path = swap_dir }
  for _, dtype in ipairs({ "fp32", "bf16" }) do
    local sums = {
      checksum(0, dtype),
      checksum(1, dtype, nil, config({ device = "cpu" })),
      checksum(2, dtype, nil, config(nvme)),
      checksum(3, dtype, nil, config({ device = "cpu" }, { device = "cpu" })),
      checksum(3, dtype, nil, config(nvme, nvme)),
    }
    all_equal("llama-tiny world 2 " .. dtype .. " offload: none, optimizer cpu (1), nvme (2), " ..
              "param+optimizer cpu (3), nvme (3)", sums)
  end
end

function T.resume_is_bitwise_at_world_2()
  for _, c in ipairs({ { 1, "fp32" }, { 3, "bf16" } }) do
    local dir = ("%s/resume%d"):format(tmp, c[1])
    local flags = ("--steps 12 --stage %d --dtype %s --config %s"):format(c[1], c[2], q(plain))
    local _, straight = ok_train(2, flags .. " --save " .. q(dir) .. " --save-every 6")
    local _, resumed = ok_train(2, flags .. " --resume " .. q(dir .. "/step-000006"))
    print(("    stage %d %s: %s straight, %s resumed"):format(c[1], c[2], straight, resumed))
    eq(resumed, straight, ("stage %d %s resumed"):format(c[1], c[2]))
  end
end

-- tools/ckpt export writes Hugging Face's Llama names and shapes, the token
-- tables without their padding rows (vocab 250 pads to 256).
function T.export_writes_hugging_faces_names_and_shapes()
  local dir, st = tmp .. "/export", tmp .. "/llama.safetensors"
  ok_train(1, "--steps 2 --vocab 250 --save " .. q(dir))
  local out, status = support.sh(("cd %s && LUAZERO=%s tools/ckpt export %s %s")
                                 :format(q(lz.root), q(lz.executable()), q(dir), q(st)))
  eq(status, 0, out)
  local f = assert(io.open(st, "rb"))
  local b = { f:read(8):byte(1, 8) }
  local len = 0
  for i = 8, 1, -1 do len = len * 256 + b[i] end
  local header = cjson.decode(f:read(len))
  f:close()
  local want = { ["model.embed_tokens.weight"] = { 250, 64 }, ["lm_head.weight"] = { 250, 64 },
                 ["model.layers.1.self_attn.q_proj.weight"] = { 64, 64 },
                 ["model.layers.1.self_attn.k_proj.weight"] = { 32, 64 },
                 ["model.layers.0.mlp.down_proj.weight"] = { 64, 176 },
                 ["model.norm.weight"] = { 64 } }
  for name, shape in pairs(want) do
    local h = assert(header[name], name .. " missing from the export")
    eq(table.concat(h.shape, "x"), table.concat(shape, "x"), name)
  end
  local n = 0
  for k in pairs(header) do if k ~= "__metadata__" then n = n + 1 end end
  eq(n, 21, "tensors exported")
end

return T
