-- test_mistral.lua — models/mistral.lua: mistral-7b's parameter count, its
-- config.json as transformers 4.x and 5.x write it (rope_theta or
-- rope_parameters, a null or absent sliding_window) and the refusals; the
-- window reaches every layer's attention; a windowed run at world 2 ends with
-- one params_checksum at stages 0 and 3, and another than without the window.
local cjson = require("cjson")
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local models = require("models.registry")

local T = {}
local q = support.quote
local write_file = support.scratch()
local eq = support.eq

-- Mistral-7B-v0.1 has 7,241,732,096 parameters (Hugging Face's count).
function T.mistral_7b_has_hugging_faces_parameter_count()
  local cfg = models.config("mistral-7b")
  eq(cfg.family, "mistral", "family")
  eq(cfg.window, 4096, "window")
  eq(models.new(cfg):count_params(), 7241732096, "mistral-7b")
end

local base = { architectures = { "MistralForCausalLM" }, hidden_size = 64,
               intermediate_size = 176, num_attention_heads = 4, num_hidden_layers = 2,
               num_key_value_heads = 2, vocab_size = 256, max_position_embeddings = 64,
               rms_norm_eps = 1e-5 }

local function read(extra)
  local j = {}
  for k, v in pairs(base) do j[k] = v end
  for k, v in pairs(extra) do j[k] = v end
  local path = write_file("config.json", cjson.encode(j))
  return pcall(models.from_hf_config, path)
end

function T.config_json_of_4x_and_5x()
  local ok, cfg = read({ rope_theta = 1e6, sliding_window = 5, torch_dtype = "bfloat16" })
  assert(ok, cfg)
  eq(cfg.window, 5, "4.x window")
  eq(cfg.rope_theta, 1e6, "4.x rope_theta")
  ok, cfg = read({ rope_parameters = { rope_type = "default", rope_theta = 5e5 },
                   sliding_window = cjson.null, dtype = "float32" })
  assert(ok, cfg)
  eq(cfg.window, 0, "null window")
  eq(cfg.rope_theta, 5e5, "5.x rope_theta")
  ok, cfg = read({})
  assert(ok, cfg)
  eq(cfg.window, 4096, "absent window: transformers' default")
  eq(cfg.rope_theta, 10000, "default rope_theta")
  local m = models.new(cfg)
  for i, blk in ipairs(m.layers.blocks) do eq(blk.attn.window, 4096, "layer " .. i) end
  local why
  ok, why = read({ rope_parameters = { rope_type = "yarn", rope_theta = 1e4, factor = 4 } })
  assert(not ok and why:find("rope_parameters.rope_type is \"yarn\"", 1, true), why)
  ok, why = read({ rope_scaling = { type = "linear", factor = 2 } })
  assert(not ok and why:find("field rope_scaling.type is \"linear\"; only \"default\" is " ..
                             "implemented for mistral", 1, true), why)
  ok, why = read({ sliding_window = 2.5 })
  assert(not ok and why:find("sliding_window", 1, true), why)
end

-- flags: the model's (--model or --model-config) and the stage.
local function checksum(flags)
  local corpus = write_file("corpus.txt", ("a line of the corpus, %d words and more\n"):rep(60))
  local cmd = ("%s -n 2 %s --seq-len 16 --sample 0 --eval-batches 1 --seed 7 --micro-batch 2 " ..
               "--steps 2 --lr 3e-3 --data %s %s 2>&1")
              :format(q(lz.root .. "/build/bin/luazero"), q(lz.root .. "/scripts/train.lua"),
                      q(corpus), flags)
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  return assert(out:match("params_checksum (%x+)"), out)
end

-- mistral-tiny as a config.json, with its window or none.
local function tiny_json(window)
  local j = {}
  for k, v in pairs(base) do j[k] = v end
  j.max_position_embeddings, j.sliding_window = 256, window
  return write_file("tiny.json", cjson.encode(j))
end

function T.windowed_runs_agree_across_stages_and_differ_without_the_window()
  local s0 = checksum("--model mistral-tiny --stage 0")
  eq(checksum("--model mistral-tiny --stage 3"), s0, "stage 3 against stage 0")
  eq(checksum("--model-config " .. q(tiny_json(8)) .. " --stage 3"), s0, "its config.json")
  local none = checksum("--model-config " .. q(tiny_json(cjson.null)) .. " --stage 3")
  assert(none ~= s0, "the window changes nothing at seq-len 16: " .. none)
end

return T
