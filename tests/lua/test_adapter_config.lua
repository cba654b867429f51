-- test_adapter_config.lua — PEFT's adapter_config.json read key by key
-- (lua/luazero/adapter_config.lua): what luazero's own export writes and
-- PEFT 0.21.2's defaults are taken; use_rslora, rank_pattern and
-- alpha_pattern become options of models/lora.lua (their math against PEFT:
-- tests/ref/test5_peft_config.py); every other key whose value changes the
-- result is refused in one line naming the key and the fix, and so is a
-- key PEFT 0.21.2 does not know that asks for something.
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local adapter_config = require("luazero.adapter_config")
local cjson = require("cjson")

local T = {}
local eq = support.eq

-- luazero's export (checkpoint/export.lua) and PEFT 0.21.2's save_pretrained
-- of a default LoraConfig(r=4, target_modules=[...]).
local OURS = { peft_type = "LORA", task_type = "CAUSAL_LM", r = 4, lora_alpha = 8,
               target_modules = { "q_proj", "v_proj" }, lora_dropout = 0.0, bias = "none",
               fan_in_fan_out = false, inference_mode = true, base_model_name_or_path = "" }
local PEFT = {
  alora_invocation_tokens = cjson.null, alpha_pattern = {}, arrow_config = cjson.null,
  auto_mapping = cjson.null, base_model_name_or_path = "base", bias = "none",
  corda_config = cjson.null, ensure_weight_tying = false, eva_config = cjson.null,
  exclude_modules = cjson.null, fan_in_fan_out = false, inference_mode = true,
  init_lora_weights = true, kasa_config = cjson.null, layer_replication = cjson.null,
  layers_pattern = cjson.null, layers_to_transform = cjson.null, loftq_config = {},
  lora_alpha = 8, lora_bias = false, lora_dropout = 0.0, lora_ga_config = cjson.null,
  megatron_config = cjson.null, megatron_core = "megatron.core", modules_to_save = cjson.null,
  monteclora_config = cjson.null, peft_type = "LORA", peft_version = "0.21.2",
  qalora_group_size = 16, r = 4, rank_pattern = {}, revision = cjson.null,
  target_modules = { "v_proj", "q_proj" }, target_parameters = cjson.null,
  task_type = "CAUSAL_LM", trainable_token_indices = cjson.null, use_bdlora = cjson.null,
  use_dora = false, use_qalora = false, use_rslora = false, velora_config = cjson.null,
}

local function with(base, changes)
  local j = {}
  for k, v in pairs(base) do j[k] = v end
  for k, v in pairs(changes) do j[k] = v end
  return j
end

function T.exported_and_peft_defaults_are_plain_lora()
  for what, j in pairs({ ours = OURS, peft = PEFT }) do
    local o = adapter_config.options("a.json", j)
    eq(o.r, 4, what .. ": r"); eq(o.alpha, 8, what .. ": alpha")
    eq(#o.targets, 2, what .. ": targets")
    assert(not o.rslora and not o.rank_of and not o.alpha_of, what .. ": plain LoRA")
  end
  -- lora_alpha absent: PEFT's default 8
  eq(adapter_config.options("a.json", { peft_type = "LORA", r = 2 }).alpha, 8, "default alpha")
end

function T.rslora_and_the_patterns_are_options()
  local o = adapter_config.options("a.json", with(PEFT, {
    use_rslora = true, rank_pattern = { q_proj = 2, ["model.layers.1.self_attn.v_proj"] = 6 },
    alpha_pattern = { v_proj = 3 } }))
  assert(o.rslora, "use_rslora")
  eq(o.rank_of("model.layers.0.self_attn.q_proj"), 2, "a name matches at a dot")
  eq(o.rank_of("model.layers.1.self_attn.v_proj"), 6, "a dotted path")
  eq(o.rank_of("model.layers.0.self_attn.v_proj"), nil, "no match: r")
  eq(o.rank_of("model.layers.0.self_attn.xq_proj"), nil, "only at a dot")
  eq(o.alpha_of("model.layers.0.self_attn.v_proj"), 3, "alpha_pattern")
  -- the key PEFT 0.21 writes itself for a fused expert tensor (all-linear on
  -- an MoE): ".*\\.NAME", a name matched at a dot
  local moe = adapter_config.options("a.json", with(PEFT, {
    rank_pattern = { [".*\\.gate_up_proj"] = 8 }, alpha_pattern = { [".*\\.gate_up_proj"] = 16 } }))
  eq(moe.rank_of("model.layers.0.mlp.experts.gate_up_proj"), 8, "a suffix regex's name")
  eq(moe.alpha_of("model.layers.0.mlp.experts.gate_up_proj"), 16, "in alpha_pattern too")
  eq(moe.rank_of("model.layers.0.mlp.experts.down_proj"), nil, "other names")
  -- models/lora.lua: rsLoRA scales by alpha / sqrt(r), the patterns per module
  local models = require("models.registry")
  local m = models.new(models.config("llama-tiny", { n_layer = 2 }))
  require("models.lora").apply(m, { r = o.r, alpha = o.alpha, targets = { "q_proj", "v_proj" },
                                    rslora = o.rslora, rank_of = o.rank_of, alpha_of = o.alpha_of })
  local shapes = {}
  for _, e in ipairs(m.param_table) do shapes[e.name] = table.concat(e.shape, "x") end
  eq(shapes["model.layers.0.self_attn.q_proj.lora_A.weight"]:match("^%d+"), "2", "q_proj r")
  eq(shapes["model.layers.1.self_attn.v_proj.lora_B.weight"]:match("%d+$"), "6", "layer 1 v_proj r")
  eq(shapes["model.layers.0.self_attn.v_proj.lora_A.weight"]:match("^%d+"), "4", "the default r")
  local scales = {}
  m:walk(function(mod, path)
    for _, ad in ipairs(mod.adapters or {}) do scales[#scales + 1] = { path, ad.r, ad.scale } end
  end)
  for _, s in ipairs(scales) do
    local alpha = s[3] * math.sqrt(s[2])
    assert(math.abs(alpha - 8) < 1e-12 or math.abs(alpha - 3) < 1e-12,
           ("%s: scale %g for r %d is not alpha / sqrt(r)"):format(s[1], s[3], s[2]))
  end
  assert(#scales == 4, "two adapters in each of two layers")
end

-- PEFT's target_parameters (the MoE experts' fused tensors) join the
-- targets models/lora.lua adapts (nn/lora_experts.lua).
function T.target_parameters_join_the_targets()
  local o = adapter_config.options("a.json", with(PEFT, {
    target_modules = { "q_proj" }, target_parameters = { "mlp.experts.gate_up_proj",
                                                          "experts.down_proj" } }))
  eq(table.concat(o.targets, ","), "q_proj,mlp.experts.gate_up_proj,experts.down_proj",
     "targets")
end

function T.keys_that_change_the_result_are_refused()
  local cases = {
    { { use_dora = true }, "use_dora true changes the result", "DoRA" },
    { { lora_alpha = 0 }, "lora_alpha must be > 0 (got 0)" },
    { { peft_type = "IA3" }, "peft_type \"IA3\" changes the result", "LORA" },
    { { target_parameters = "experts.gate_up_proj" }, "target_parameters must be a list" },
    { { lora_bias = true }, "lora_bias true" },
    { { layers_to_transform = { 0 } }, "layers_to_transform [0]" },
    { { modules_to_save = { "lm_head" } }, "modules_to_save [\"lm_head\"]" },
    { { trainable_token_indices = { 1, 2 } }, "trainable_token_indices" },
    { { init_lora_weights = "pissa" }, "init_lora_weights \"pissa\"", "merge_and_unload" },
    { { init_lora_weights = "olora" }, "init_lora_weights \"olora\"" },
    { { init_lora_weights = "mica" }, "init_lora_weights \"mica\"" },
    { { bias = "all" }, "bias \"all\"" },
    { { exclude_modules = { "layers.0.self_attn.q_proj" } }, "exclude_modules" },
    { { layer_replication = { { 0, 2 } } }, "layer_replication" },
    { { use_qalora = true }, "use_qalora true" },
    { { task_type = "SEQ_CLS" }, "task_type \"SEQ_CLS\"" },
    { { target_modules = ".*proj" }, "target_modules \".*proj\" is a string" },
    { { rank_pattern = { ["^model.*q_proj$"] = 2 } }, "is a regular expression" },
    { { rank_pattern = { q_proj = 2.5 } }, "rank_pattern[\"q_proj\"] must be a whole number" },
    { { a_new_key = 3 }, "a_new_key is not a field of PEFT 0.21.2's LoraConfig" },
    -- targets outside the blocks: named as such, with the merge as the way
    { { target_modules = { "q_proj", "lm_head" } }, "target lm_head (the LM head): LoRA there " ..
      "is not implemented", "merge_and_unload" },
    { { target_modules = { "embed_tokens" } }, "target embed_tokens (the token table)" },
    { { target_parameters = { "experts.gate_up_proj", "gate.weight" } },
      "target gate.weight (an MoE block's router)" },
  }
  for _, c in ipairs(cases) do
    local ok, err = pcall(adapter_config.options, "ad/adapter_config.json", with(PEFT, c[1]))
    assert(not ok, "accepted: " .. cjson.encode(c[1]))
    err = tostring(err)
    assert(err:find("ad/adapter_config.json: ", 1, true) == 1 and not err:find("\n"), err)
    for k = 2, #c do assert(err:find(c[k], 1, true), err .. "\n lacks " .. c[k]) end
  end
  -- keys that ask for nothing pass, known or not
  adapter_config.options("a.json", with(PEFT, { a_new_key = cjson.null, init_lora_weights = "gaussian",
                                                lora_dropout = 0.1 }))
end

-- An adapter saved under a name (save_pretrained(..., adapter_name)) sits in
-- its own folder: a read of the parent names it; a PEFT folder given to
-- --resume says what it is.
function T.a_named_adapters_folder_and_a_peft_resume_are_named()
  local support = dofile(lz.root .. "/tests/lua/support.lua")
  local write, dir = support.scratch()
  os.execute(("mkdir -p %s/foo"):format(dir))
  write("foo/adapter_config.json", cjson.encode(PEFT))
  local ok, err = pcall(adapter_config.read, dir .. "/adapter_config.json")
  assert(not ok and tostring(err):find(("(an adapter saved under a name is in its own folder: " ..
                                        "%s/foo)"):format(dir), 1, true), tostring(err))
  ok, err = pcall(require("luazero.checkpoint.disk").resolve, dir .. "/foo")
  assert(not ok and tostring(err):find("is PEFT's adapter folder, not a luazero checkpoint", 1, true),
         tostring(err))
end

-- scripts/eval.lua refuses it before anything is loaded: exit 2, the flag,
-- the file and the key named.
function T.eval_refuses_a_dora_adapter_naming_the_key()
  local q = support.quote
  local write, dir = support.scratch()
  write("val.txt", support.HAMLET:rep(20))
  local lzx = q(lz.executable())
  local out, st = support.sh(("cd %s && %s scripts/train.lua --model llama-tiny --n-layer 1 " ..
                              "--seq-len 16 --micro-batch 2 --sample 0 --steps 1 --data %s/val.txt " ..
                              "--save %s/ck && %s tools/ckpt.lua export %s/ck %s/hf")
                             :format(q(lz.root), lzx, dir, dir, lzx, dir, dir))
  assert(st == 0, out)
  os.execute("mkdir -p " .. q(dir .. "/ad"))
  write("ad/adapter_config.json", cjson.encode(with(OURS, { use_dora = true })))
  out, st = support.sh(("cd %s && %s scripts/eval.lua --hf %s/hf --adapters %s/ad --data " ..
                        "%s/val.txt --seq-len 16"):format(q(lz.root), lzx, dir, dir, dir))
  eq(st, 2, out)
  assert(out:find("eval: --adapters " .. dir .. "/ad/adapter_config.json: use_dora true changes " ..
                  "the result and is not implemented", 1, true), out)
  -- adapters of another model's modules: the adapters' file named, no flag of ours
  os.execute("mkdir -p " .. q(dir .. "/phi"))
  write("phi/adapter_config.json", cjson.encode(with(OURS, { target_modules = { "qkv_proj" } })))
  out, st = support.sh(("cd %s && %s scripts/eval.lua --hf %s/hf --adapters %s/phi --data " ..
                        "%s/val.txt --seq-len 16"):format(q(lz.root), lzx, dir, dir, dir))
  eq(st, 2, out)
  assert(out:find("eval: --adapters " .. dir .. "/phi: its adapter_config.json's target_modules " ..
                  "do not fit this model: lora: no module named qkv_proj to adapt; this model " ..
                  "has ", 1, true) and not out:find("--lora-targets", 1, true), out)
end

return T
