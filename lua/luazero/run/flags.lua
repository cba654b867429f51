-- run/flags.lua — the scripts' command lines: parsed by luazero.args with
-- the usage printed for --help, and the flags they share declared once,
-- with their ranges and dependencies (luazero.args checks them), so that
-- train, eval and generate refuse the same bad value with the same line.
local args = require("luazero.args")
local M = {}

-- A consolidated file says no model: the flags that name one go with it.
local function load_is_file(flags)
  return flags.load ~= nil and not require("luazero.io.fs").is_dir(flags.load)
end
local NAMES_MODEL = { ok = load_is_file, with = { "--load", "model.bin" },
                     says = "goes with --load FILE (a consolidated file, which names no " ..
                            "model); a checkpoint folder or an --hf folder names its own: drop it" }

-- The flags that name trained weights for luazero.inference.open (eval and
-- generate): a checkpoint, or a Hugging Face folder (holding `hf_files`)
-- with PEFT adapters.
function M.weights(hf_files)
  return {
    { "load", "string", nil, "a luazero checkpoint: a step folder, a --save folder (its latest) or a consolidated file" },
    { "model", "string", nil, "with --load FILE (tools/ckpt consolidate's): the model's named size",
      needs = NAMES_MODEL },
    { "model-config", "string", nil, "with --load FILE: the model's Hugging Face config.json",
      needs = NAMES_MODEL },
    { "hf", "string", nil, "a Hugging Face model folder (" .. hf_files .. ")" },
    { "adapters", "string", nil, "with --hf: PEFT LoRA adapters (tools/ckpt export of a LoRA run)",
      needs = { flag = "hf", says = "goes with --hf BASE (the base model the adapters were " ..
                                   "trained on); a LoRA checkpoint given to --load brings its own" } },
  }
end

-- The inputs the weights flags name, declared in `p` (io/paths.lua).
function M.weights_paths(p, flags)
  local is_dir = require("luazero.io.fs").is_dir
  p:read("--load", flags.load):read("--model-config", flags.model_config)
  for _, n in ipairs({ "hf", "adapters" }) do
    local v = flags[n]
    p:read("--" .. n, v, { whole = v and is_dir(v) })
  end
  return p
end

-- One spec from several lists of flags, in order.
function M.spec(...)
  local out = {}
  for _, list in ipairs({ ... }) do
    for _, s in ipairs(list) do out[#out + 1] = s end
  end
  return out
end

-- The flags of argv, or nil after printing "usage: <usage>" and the flags
-- for --help. ex: a luazero.run.exits.
function M.parse(ex, argv, spec, usage)
  local flags, text = ex.checked(args.parse, argv, spec)
  if not flags then
    ex.say("usage: " .. usage .. "\n" .. text)
    return nil
  end
  return flags
end

return M
