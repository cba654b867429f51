-- test_phi3.lua — models/phi3.lua: phi-3-mini's parameter count, the real
-- config.json files (tests/fixtures/phi3/: a 4k one and a 128k LongRoPE one
-- as transformers 4.x writes them) and one as 5.x writes it
-- (rope_parameters), LongRoPE's frequencies and attention factor, the
-- refusals; the fused tensors' names and LoRA's default target; stages 0
-- and 3 agree with a window and with LongRoPE.
local cjson = require("cjson")
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local models = require("models.registry")
local phi3 = require("models.phi3")

local T = {}
local write_file = support.scratch()
local eq = support.eq
local FIXTURES = lz.root .. "/tests/fixtures/phi3/"

local function read_json(path) return cjson.decode(lz.read_file(path)) end

-- Hugging Face's count for microsoft/Phi-3-mini-4k-instruct: 3,821,079,552.
function T.phi_3_mini_has_hugging_faces_parameter_count()
  eq(models.new(models.config("phi-3-mini")):count_params(), 3821079552, "phi-3-mini")
end

function T.the_4k_config_reads_as_the_named_size()
  local cfg = models.from_hf_config(FIXTURES .. "phi-3-mini-4k-instruct.json")
  local named = models.config("phi-3-mini")
  eq(cfg.family, "phi3", "family")
  for _, k in ipairs({ "n_layer", "n_head", "n_kv_head", "n_embd", "n_hidden", "context", "vocab",
                       "head_dim", "rotary_dim", "window", "original_max", "rope_theta" }) do
    eq(cfg[k], named[k], k)
  end
  eq(cfg.window, 2047, "sliding_window")
  eq(cfg.rope_scaling, nil, "no rope scaling")
  eq(cfg.pad_id, 32000, "pad_token_id")
end

-- The 128k shape: LongRoPE with 48 factors each (head_dim 96), the long ones
-- past 4096 positions, cos and sin times sqrt(1 + ln 32 / ln 4096).
function T.the_128k_longrope_config_reads()
  local j = read_json(FIXTURES .. "phi-3.5-mini-instruct.json")
  local cfg = models.from_hf_config(FIXTURES .. "phi-3.5-mini-instruct.json")
  eq(cfg.context, 131072, "max_position_embeddings")
  eq(cfg.original_max, 4096, "original_max_position_embeddings")
  eq(cfg.window, 262144, "sliding_window")
  eq(#cfg.rope_scaling.long_factor, 48, "long factors")
  local r = phi3.rope(cfg)
  eq(#r.freqs, 48, "short frequencies")
  local f = require("ffi").new("float[1]", math.sqrt(1 + math.log(32) / math.log(4096)))
  eq(r.scale, f[0], "attention factor")
  for i = 1, 48 do
    local plain = 1 / 10000 ^ ((2 * (i - 1)) / 96)
    local want_s = plain / j.rope_scaling.short_factor[i]
    local want_l = plain / j.rope_scaling.long_factor[i]
    assert(math.abs(r.freqs[i] - want_s) <= 1e-6 * want_s, "short frequency " .. i)
    assert(math.abs(r.long[i] - want_l) <= 1e-6 * want_l, "long frequency " .. i)
  end
  -- "su" (the first 128k files) reads as longrope
  j.rope_scaling.type = "su"
  local su = models.from_hf_config(write_file("su.json", cjson.encode(j)))
  eq(#su.rope_scaling.long_factor, 48, "su's long factors")
  assert(math.abs(su.rope_scaling.long_factor[48] - 64.84) < 1e-4, "su's last long factor")
end

-- transformers 5.x writes rope_theta, partial_rotary_factor and the
-- LongRoPE fields inside rope_parameters.
function T.a_5x_config_with_rope_parameters_reads()
  local j = read_json(FIXTURES .. "phi-3-mini-4k-instruct.json")
  j.rope_theta, j.rope_scaling, j.torch_dtype, j.dtype = nil, nil, nil, "bfloat16"
  j.num_key_value_heads = 8
  local short, long = {}, {}
  for i = 1, 36 do short[i], long[i] = 1, 1 + i end
  j.rope_parameters = { rope_type = "longrope", rope_theta = 250000.0, partial_rotary_factor = 0.75,
                        short_factor = short, long_factor = long,
                        original_max_position_embeddings = 4096 }
  local cfg = models.from_hf_config(write_file("v5.json", cjson.encode(j)))
  eq(cfg.rope_theta, 250000, "rope_theta from rope_parameters")
  eq(cfg.rotary_dim, 72, "96 * 0.75 values turn")
  eq(cfg.n_kv_head, 8, "num_key_value_heads")
  eq(#phi3.rope(cfg).long, 36, "long frequencies")
  j.rope_parameters = { rope_type = "default", rope_theta = 10000.0, partial_rotary_factor = 1.0 }
  cfg = models.from_hf_config(write_file("v5-default.json", cjson.encode(j)))
  eq(cfg.rope_scaling, nil, "the default rope")
  eq(cfg.rotary_dim, 96, "every value turns")
end

function T.refusals_name_the_field()
  local j = read_json(FIXTURES .. "phi-3.5-mini-instruct.json")
  j.rope_scaling.type = "dynamic"
  support.expect_error(function()
    models.from_hf_config(write_file("dyn.json", cjson.encode(j)))
  end, "field rope_scaling.type is \"dynamic\"; only \"longrope\", \"su\", " ..
     "\"yarn\" or \"default\" is implemented for phi3")
  j.rope_scaling.type = "longrope"
  j.rope_scaling.short_factor = { 1, 1 }
  support.expect_error(function()
    models.from_hf_config(write_file("short.json", cjson.encode(j)))
  end, "rope_scaling.short_factor must be a list of 48 numbers (rotary_dim / 2; got 2 values)")
  support.expect_error(function() models.config("phi3-tiny", { partial_rotary_factor = 0.1 }) end,
                       "partial_rotary_factor 0.1 gives 1 turning values of a 16-value head")
end

-- Hugging Face's fused tensors are one parameter each; LoRA adapts qkv_proj
-- when no target is given (PEFT has no default for phi3).
function T.fused_tensors_and_lora_default()
  local model = models.new(models.config("phi3-tiny"))
  local names = {}
  for _, p in ipairs(model.param_table) do names[p.name] = p.shape end
  eq(table.concat(names["model.layers.0.self_attn.qkv_proj.weight"], "x"), "128x64", "qkv_proj")
  eq(table.concat(names["model.layers.1.mlp.gate_up_proj.weight"], "x"), "192x64", "gate_up_proj")
  eq(names["model.layers.0.self_attn.q_proj.weight"], nil, "no q_proj")
  local lora = require("models.lora")
  eq(lora.apply(model, { r = 2 }), 2, "adapted weights (qkv_proj, two layers)")
  eq(table.concat(model.lora.targets, ","), "qkv_proj", "default targets")
end

-- flags: the model's and the stage; two steps at world 2.
local function checksum(flags)
  local corpus = write_file("corpus.txt", ("a line of the corpus, %d words and more\n"):rep(60))
  local cmd = ("%s -n 2 %s --seq-len 16 --sample 0 --eval-batches 1 --seed 7 --micro-batch 2 " ..
               "--steps 2 --lr 3e-3 --data %s %s 2>&1")
              :format(support.quote(lz.root .. "/build/bin/luazero"),
                      support.quote(lz.root .. "/scripts/train.lua"), support.quote(corpus), flags)
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  return assert(out:match("params_checksum (%x+)"), out)
end

-- A windowed, partly turning phi3-tiny (window 8 under 16 positions), then
-- with LongRoPE past original_max 8: ZeRO stages 0 and 3 end with one
-- checksum, and each option changes it.
function T.runs_agree_across_stages_and_the_options_change_them()
  local j = {
    architectures = { "Phi3ForCausalLM" }, hidden_size = 64, intermediate_size = 96,
    num_hidden_layers = 2, num_attention_heads = 4, num_key_value_heads = 2,
    max_position_embeddings = 256, vocab_size = 256, rms_norm_eps = 1e-5,
    partial_rotary_factor = 0.5, sliding_window = 8, original_max_position_embeddings = 256,
  }
  local function run(stage) return checksum(("--model-config %s --stage %d")
                                            :format(support.quote(write_file("p.json",
                                                    cjson.encode(j))), stage)) end
  local windowed = run(0)
  eq(run(3), windowed, "window: stage 3 against stage 0")
  j.original_max_position_embeddings = 8
  j.rope_scaling = { type = "longrope", short_factor = { 1, 1.5, 2, 3 }, long_factor = { 2, 4, 6, 8 } }
  local longrope = run(0)
  eq(run(3), longrope, "LongRoPE: stage 3 against stage 0")
  assert(longrope ~= windowed, "LongRoPE changes nothing: " .. longrope)
  j.sliding_window, j.rope_scaling = cjson.null, nil
  assert(run(3) ~= windowed, "the window changes nothing at seq-len 16")
end

-- A checkpoint keeps LongRoPE's factor lists (the manifest's model config),
-- so its export's config.json has them: they were dropped (tables two deep),
-- and the export was a short-context model.
function T.a_longrope_checkpoint_exports_its_factors()
  local j = {
    architectures = { "Phi3ForCausalLM" }, hidden_size = 64, intermediate_size = 96,
    num_hidden_layers = 2, num_attention_heads = 4, num_key_value_heads = 2,
    max_position_embeddings = 256, vocab_size = 256, rms_norm_eps = 1e-5,
    partial_rotary_factor = 0.5, original_max_position_embeddings = 8,
    rope_scaling = { type = "longrope", short_factor = { 1, 1.5, 2, 3 },
                     long_factor = { 2, 4, 6, 8 } },
  }
  local dir = write_file("lr.json", cjson.encode(j)):gsub("lr%.json$", "lr-ck")
  local corpus = write_file("corpus.txt", ("a line of the corpus, %d words and more\n"):rep(60))
  local q = support.quote
  local out, st = support.sh(("cd %s && %s scripts/train.lua --model-config %s --seq-len 16 " ..
    "--sample 0 --eval-batches 1 --micro-batch 2 --steps 1 --data %s --save %s && %s " ..
    "tools/ckpt.lua export %s %s"):format(q(lz.root), q(lz.executable()),
    q(write_file("lr.json", cjson.encode(j))), q(corpus), q(dir), q(lz.executable()), q(dir),
    q(dir .. "-hf")))
  assert(st == 0, out)
  local f = assert(io.open(dir .. "-hf/config.json"))
  local c = cjson.decode(f:read("*a"))
  f:close()
  local rs = assert(c.rope_scaling, "config.json has no rope_scaling")
  eq(table.concat(rs.long_factor, ","), "2,4,6,8", "long_factor")
  eq(table.concat(rs.short_factor, ","), "1,1.5,2,3", "short_factor")
end

return T
