-- test_families.lua — a model family is one file (luazero/families.lua,
-- models/registry.lua): a toy family from tests/fixtures/families/llamax.lua
-- (Llama with config.json's num_hidden_layers renamed num_layers and its
-- tensors named llamax.*), registered from the test folder, reads its
-- config.json, trains through scripts/train.lua, exports with its own names
-- and config.json (tools/ckpt) and loads back bitwise (--init); without the
-- file its architecture is unknown, in the registry and on the command line.
local cjson = require("cjson")
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local models = require("models.registry")
local families = require("luazero.families")
local safetensors = require("luazero.checkpoint.safetensors")

local T = {}
local q, eq = support.quote, support.eq
local write_file, tmp = support.scratch()

local FIXTURE = lz.root .. "/tests/fixtures/families/llamax.lua"
local REGISTER = ("require('models.registry').register(dofile(%q))"):format(FIXTURE)

local llamax_json = {
  architectures = { "LlamaXForCausalLM" }, model_type = "llamax", hidden_act = "silu",
  hidden_size = 64, intermediate_size = 176, max_position_embeddings = 64,
  num_attention_heads = 4, num_layers = 2, num_key_value_heads = 2, rms_norm_eps = 1e-5,
  rope_theta = 10000, tie_word_embeddings = false, vocab_size = 256,
}

local function corpus()
  local lines = {}
  for i = 1, 200 do
    lines[i] = ("line %d: it was the best of times, the worst of times."):format(i)
  end
  return write_file("corpus.txt", table.concat(lines, "\n"))
end

-- luazero SCRIPT ARGS, with the toy family registered first when `with`.
local function run(with, script, args)
  return support.sh(("cd %s && %s %s %s %s"):format(q(lz.root), q(lz.executable()),
                    with and ("-e " .. q(REGISTER)) or "", script, args))
end

-- The toy family in the registry while fn runs; unknown again after.
local function with_toy(fn)
  local fam = models.register(dofile(FIXTURE))
  local ok, err = pcall(fn, fam)
  models.unregister(fam.name)
  if not ok then error(err, 0) end
end

-- The registered families' architectures, read from the table (not a list kept here).
local KNOWN = table.concat(families.architectures(), ", ")
local FAMILY_NAMES = (function()
  local names = {}
  for i, f in ipairs(families.list()) do names[i] = f.name end
  return table.concat(names, ", ")
end)()
local UNKNOWN = "field architectures[0] is \"LlamaXForCausalLM\": unknown architecture " ..
                "(known: " .. KNOWN .. ")"

function T.toy_family_reads_its_own_config_json_and_builds()
  local path = write_file("llamax.json", cjson.encode(llamax_json))
  support.expect_error(function() models.from_hf_config(path) end, UNKNOWN)
  with_toy(function()
    local cfg = models.from_hf_config(path)
    eq(cfg.family, "llamax", "family")
    eq(cfg.n_layer, 2, "n_layer from num_layers")
    eq(cfg.n_kv_head, 2, "n_kv_head")
    eq(cfg.lr, 3e-3, "lr of llamax-tiny")
    local model = models.new(cfg)
    eq(model:count_params(), models.new(models.config("llamax-tiny")):count_params(),
       "parameters of the config.json's model and of the named size")
    assert(models.family_of("llamax-tiny"), "llamax-tiny is a known size")
    -- a registered family's architecture comes after those of models/registry.lua's list
    local known = table.concat(families.architectures(), ", ")
    eq(known, KNOWN .. ", LlamaXForCausalLM", "architectures")
    -- Llama's field name is not this family's: the renamed field is the one read.
    local j = {}
    for k, v in pairs(llamax_json) do j[k] = v end
    j.num_hidden_layers, j.num_layers = 2, nil
    support.expect_error(function()
      models.from_hf_config(write_file("llama-named.json", cjson.encode(j)))
    end, "field num_layers is missing")
    -- The family's own checks speak of the file's fields.
    j.num_layers, j.num_key_value_heads = 2, 3
    support.expect_error(function()
      models.from_hf_config(write_file("bad-kv.json", cjson.encode(j)), nil, { file_words = true })
    end, "num_attention_heads 4 is not a multiple of num_key_value_heads 3")
  end)
  support.expect_error(function() models.config("llamax-tiny") end, "unknown model 'llamax-tiny'")
  support.expect_error(function() models.from_hf_config(path) end, UNKNOWN)
  support.expect_error(function() families.get("llamax") end,
                       "model family llamax is unknown (known: " .. FAMILY_NAMES .. ")")
end

-- LoRA's default targets are the family's (its description's lora_default).
-- A family's run_fields (the config fields a resume may change) are a list
-- of names; anything else is refused when the family registers.
function T.run_fields_are_a_list_of_names()
  for _, bad in ipairs({ { jitter = true }, { "jitter", 3 }, "jitter" }) do
    local fam = dofile(FIXTURE)
    fam.run_fields = bad
    support.expect_error(function() families.register(fam) end,
                         "families: family llamax's run_fields must be a list of config field names")
    eq(families.run_fields("llamax")[1], nil, "a refused family's run_fields")
  end
  with_toy(function(fam)
    eq(#families.run_fields(fam.name), 0, "a family declaring none")
  end)
  eq(families.run_fields("mixtral")[1], "moe_gather", "mixtral's first run field")
  eq(#families.run_fields(nil), 0, "a model of no family")
end

-- A named size's overrides are fields of the family's configs: a typo is
-- refused naming the field it likely meant, not stored beside them.
function T.a_sizes_overrides_are_its_familys_fields()
  support.expect_error(function() models.config("gpt2-nano", { n_lyer = 2 }) end,
                       "model gpt2-nano: no field n_lyer in a gpt2 config (did you mean n_layer?)")
  eq(models.config("gpt2-nano", { n_layer = 2 }).n_layer, 2, "a field of the family")
  eq(models.config("mixtral-tiny", { moe_gather = "expert" }).moe_gather, "expert",
     "a field its finish fills")
end

function T.lora_default_targets_are_the_familys()
  local lora = require("models.lora")
  local g = models.new(models.config("gpt2-nano", { n_layer = 1 }))
  eq(lora.apply(g, { r = 2 }), 1, "GPT-2 adapted weights (c_attn, one layer)")
  eq(table.concat(g.lora.targets, ","), "c_attn", "GPT-2's default targets")
  local l = models.new(models.config("llama-tiny"))
  eq(lora.apply(l, { r = 2 }), 4, "Llama adapted weights (q_proj, v_proj, two layers)")
  eq(table.concat(l.lora.targets, ","), "q_proj,v_proj", "Llama's default targets")
end

-- Trained 3 steps, saved, exported with the family's names and config.json,
-- loaded back with --init: the checkpoint's val_loss and params_checksum to
-- the last bit. Without the family file the same command line is refused.
function T.toy_family_trains_exports_and_loads_back_bitwise()
  local cfg_path = write_file("llamax-run.json", cjson.encode(llamax_json))
  local data = corpus()
  local RUN = ("--seq-len 32 --micro-batch 4 --sample 0 --eval-batches 4 --data %s"):format(q(data))
  local out, st = run(false, "scripts/train.lua", ("--model-config %s %s --steps 1")
                                                  :format(q(cfg_path), RUN))
  eq(st, 2, "exit status without the family:\n" .. out)
  assert(out:find("model config " .. cfg_path .. ": " .. UNKNOWN, 1, true), out)

  local dir, hf = tmp .. "/llamax-ck", tmp .. "/llamax-hf"
  out, st = run(true, "scripts/train.lua", ("--model-config %s %s --steps 3 --save %s")
                                           :format(q(cfg_path), RUN, q(dir)))
  eq(st, 0, "training the toy family:\n" .. out)
  out, st = run(true, "scripts/train.lua", ("--model-config %s %s --steps 3 --resume %s")
                                           :format(q(cfg_path), RUN, q(dir)))
  eq(st, 0, "resuming the toy family:\n" .. out)
  local val, sum = out:match("val_loss (%S+)"), out:match("params_checksum (%x+)")
  assert(val and sum, out)

  out, st = run(false, "tools/ckpt.lua", ("export %s %s"):format(q(dir), q(tmp .. "/no-family")))
  eq(st, 2, "export without the family:\n" .. out)
  assert(out:find("model family llamax is unknown (known: " .. FAMILY_NAMES .. ")", 1, true), out)
  out, st = run(true, "tools/ckpt.lua", ("export %s %s"):format(q(dir), q(hf)))
  eq(st, 0, "export:\n" .. out)
  local j = cjson.decode(lz.read_file(hf .. "/config.json"))
  eq(j.architectures[1], "LlamaXForCausalLM", "config.json architectures")
  eq(j.num_layers, 2, "config.json num_layers")
  eq(j.num_hidden_layers, nil, "config.json num_hidden_layers")
  local st_file = safetensors.open(hf .. "/model.safetensors")
  local names = {}
  for _, n in ipairs(st_file.names) do names[n] = st_file.tensors[n].shape end
  st_file:close()
  assert(names["llamax.layers.1.self_attn.q_proj.weight"], "llamax.* names in the export")
  assert(not names["model.norm.weight"], "no Llama names in the export")
  eq(names["llamax.embed_tokens.weight"][1], 256, "token table rows: the real vocabulary")

  out, st = run(true, "scripts/train.lua", ("%s --steps 0 --init %s"):format(RUN, q(hf)))
  eq(st, 0, "--init of the export:\n" .. out)
  assert(out:find("initialized from", 1, true), out)
  eq(out:match("val_loss (%S+)"), val, "--init val_loss (the checkpoint's)")
  eq(out:match("params_checksum (%x+)"), sum, "--init params_checksum")
end

return T
