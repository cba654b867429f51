-- adapter_config.lua — PEFT's adapter_config.json, key by key: every field
-- of PEFT 0.21.2's LoraConfig (and its PeftConfig base) is either honoured
-- (r, lora_alpha, target_modules, target_parameters (the MoE experts'),
-- use_rslora, rank_pattern, alpha_pattern),
-- without effect on a loaded adapter's math (names, dropout: off when
-- evaluating, the initialisation the weights have left behind), or refused
-- in one line naming the key and the fix when its value would change the
-- result. A key PEFT 0.21.2 does not know is refused unless it asks for
-- nothing (null, false, {} or []).
--
--   local lora = adapter_config.read("ad/adapter_config.json")
--   -- { r, alpha, targets, rslora, rank_of, alpha_of }: models/lora.lua's apply options
local cjson = require("cjson")

local M = {}

local null = cjson.null

-- Whether v asks for nothing: absent, null, false, an empty table.
local function nothing(v)
  return v == nil or v == null or v == false or (type(v) == "table" and next(v) == nil)
end

-- What a value that changes the math needs instead: the fix.
local NOT_LORA = "luazero loads plain LoRA adapters (y = W x + scale B A x)"

-- key -> "honour" (read below), "none" (no effect on a loaded adapter), or
-- a function(v) that returns the fix when v is refused.
local function unless(ok, fix)
  return function(v)
    if not ok(v) then return fix end
  end
end
local function absent(fix) return unless(nothing, fix) end

M.keys = {
  -- PeftConfig
  peft_type = unless(function(v) return v == "LORA" end,
                     "give LoRA adapters (peft_type LORA): " .. NOT_LORA),
  task_type = unless(function(v) return nothing(v) or v == "CAUSAL_LM" end,
                     "give adapters of a causal language model (task_type CAUSAL_LM)"),
  base_model_name_or_path = "none", revision = "none", inference_mode = "none",
  auto_mapping = "none", peft_version = "none",
  -- LoraConfig
  r = "honour", lora_alpha = "honour", target_modules = "honour", use_rslora = "honour",
  rank_pattern = "honour", alpha_pattern = "honour",
  lora_dropout = "none", -- dropout is off when a model is evaluated or generates
  megatron_core = "none", runtime_config = "none", qalora_group_size = "none",
  exclude_modules = absent("adapt the modules by target_modules alone (merge the adapters " ..
                           "with PEFT's merge_and_unload to keep the exclusion)"),
  -- how the base weight is stored (PEFT sets it true for GPT-2's Conv1D,
  -- false for nn.Linear, whatever the file says): lora_A [r, in] and
  -- lora_B [out, r] and their forward are the same either way
  fan_in_fan_out = "none",
  bias = unless(function(v) return nothing(v) or v == "none" end,
                "give adapters trained with bias \"none\" (the base biases stay frozen), or " ..
                "merge them into the model with PEFT's merge_and_unload and load that with --hf"),
  modules_to_save = absent("merge the adapters with PEFT's merge_and_unload (the saved modules " ..
                           "come with them) and load that with --hf"),
  init_lora_weights = unless(function(v)
    return nothing(v) or v == true or v == "gaussian" or v == "orthogonal" or v == "eva"
  end, "PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA and MiCA change the base weights or the " ..
       "forward: merge the adapters with PEFT's merge_and_unload and load that with --hf"),
  layers_to_transform = absent("adapt every layer, or merge the adapters with PEFT's " ..
                               "merge_and_unload and load that with --hf"),
  layers_pattern = absent("drop it with layers_to_transform (luazero adapts every layer)"),
  megatron_config = absent("give adapters of a model without Megatron's parallel layers"),
  trainable_token_indices = absent("merge the adapters with PEFT's merge_and_unload (the " ..
                                   "trained embeddings come with them) and load that with --hf"),
  loftq_config = absent("LoftQ changes the base weights: merge the adapters with PEFT's " ..
                        "merge_and_unload and load that with --hf"),
  eva_config = "none", corda_config = "none", -- initialisation only; init_lora_weights decides
  lora_ga_config = absent("LoRA-GA changes the base weights: merge the adapters with PEFT's " ..
                          "merge_and_unload and load that with --hf"),
  use_dora = absent("DoRA scales each column by a learned magnitude: " .. NOT_LORA ..
                    "; merge with PEFT's merge_and_unload and load that with --hf"),
  velora_config = absent(NOT_LORA .. "; merge with PEFT's merge_and_unload and load that with --hf"),
  alora_invocation_tokens = absent("activated LoRA applies after its invocation tokens only: " ..
                                   NOT_LORA),
  use_qalora = absent("QALoRA pools its input: " .. NOT_LORA),
  monteclora_config = absent(NOT_LORA),
  layer_replication = absent("replicate the layers in the base model first (a model folder " ..
                             "with the layers it adds)"),
  lora_bias = absent("merge the adapters with PEFT's merge_and_unload (the adapters' bias " ..
                     "comes with them) and load that with --hf"),
  target_parameters = "honour", -- the MoE experts' fused tensors (nn/lora_experts.lua)
  use_bdlora = absent(NOT_LORA),
  arrow_config = absent("Arrow routes among several adapters: give one adapter"),
  kasa_config = absent(NOT_LORA),
  ensure_weight_tying = unless(nothing, "drop it (it matters with modules_to_save, which " ..
                                        "luazero does not load)"),
}

-- A name or dotted path, the keys luazero matches (PEFT takes regular
-- expressions: anchored at a dot or the start, through the end).
local function pattern_matcher(path, key, tbl)
  if type(tbl) ~= "table" or tbl[1] ~= nil then
    error(("%s: %s must be an object of module name -> number (got %s)")
          :format(path, key, cjson.encode(tbl)), 0)
  end
  local list = {}
  for k, v in pairs(tbl) do
    -- (".*\\.gate_up_proj", which PEFT writes itself for a fused expert
    -- tensor, is a name matched as a suffix: the name)
    local plain = k:match("^%.%*\\%.([%w_\\%.]+)$")
    if plain then k = plain:gsub("\\%.", ".") end
    if not k:match("^[%w_%.]+$") then
      error(("%s: %s key %q is a regular expression; luazero matches module names and dotted " ..
             "paths (q_proj, layers.0.self_attn.q_proj): give those"):format(path, key, k), 0)
    end
    if type(v) ~= "number" or v <= 0 or (key == "rank_pattern" and v ~= math.floor(v)) then
      error(("%s: %s[%q] must be a %s > 0 (got %s)"):format(path, key, k,
            key == "rank_pattern" and "whole number" or "number", cjson.encode(v)), 0)
    end
    list[#list + 1] = { k, v }
  end
  -- PEFT takes the first key that matches, in the file's order; JSON
  -- objects have none here, so two keys matching one module are refused.
  return function(name)
    local hit
    for _, e in ipairs(list) do
      if name == e[1] or name:sub(-(#e[1] + 1)) == "." .. e[1] then
        if hit and hit[2] ~= e[2] then
          error(("%s: %s keys %q and %q both match %s with different values; give one")
                :format(path, key, hit[1], e[1], name), 0)
        end
        hit = e
      end
    end
    return hit and hit[2]
  end
end

-- The adapters' options for models/lora.lua's apply, from the decoded JSON
-- `j` of `path`; errors are one line naming the file and the key.
function M.options(path, j)
  local keys = {}
  for k in pairs(j) do keys[#keys + 1] = k end
  table.sort(keys)
  for _, k in ipairs(keys) do
    local rule, v = M.keys[k], j[k]
    if rule == nil then
      if not nothing(v) then
        error(("%s: %s is not a field of PEFT 0.21.2's LoraConfig and asks for something " ..
               "(%s); give adapters saved by PEFT 0.21.2 or drop the key")
              :format(path, k, cjson.encode(v)), 0)
      end
    elseif type(rule) == "function" then
      local fix = rule(v)
      if fix then
        error(("%s: %s %s changes the result and is not implemented; %s")
              :format(path, k, cjson.encode(v), fix), 0)
      end
    end
  end
  local r, alpha = j.r, j.lora_alpha
  if type(r) ~= "number" or r < 1 or r ~= math.floor(r) then
    error(("%s: r must be a whole number >= 1 (got %s)"):format(path, cjson.encode(r)), 0)
  end
  if nothing(alpha) then alpha = 8 end -- PEFT's default
  if type(alpha) ~= "number" or alpha <= 0 then
    error(("%s: lora_alpha must be > 0 (got %s): the adapters' scale is lora_alpha / r, and " ..
           "0 turns them off; give the alpha they were trained with"):format(path,
           cjson.encode(alpha)), 0)
  end
  local targets = j.target_modules
  if type(targets) == "string" then
    error(("%s: target_modules %q is a string, which PEFT matches as a regular expression " ..
           "against whole module paths; give the list of module names (q_proj, v_proj)")
          :format(path, targets), 0)
  end
  if nothing(targets) then targets = nil end
  local params = j.target_parameters
  if not nothing(params) then
    if type(params) ~= "table" or params[1] == nil then
      error(("%s: target_parameters must be a list of parameter names " ..
             "(experts.gate_up_proj, experts.down_proj); got %s"):format(path,
             cjson.encode(params)), 0)
    end
    local all = {}
    for _, t in ipairs(targets or {}) do all[#all + 1] = t end
    for _, t in ipairs(params) do all[#all + 1] = t end
    targets = all
  end
  -- Targets outside the blocks' Linear layers and experts: the head, the
  -- token table, an MoE router (PEFT's all-linear puts it in
  -- target_parameters as gate.weight).
  for _, t in ipairs(targets or {}) do
    local what = (t == "lm_head" or t == "embed_out") and "the LM head" or
                 (t == "embed_tokens" or t == "wte" or t == "wpe") and "the token table" or
                 (t == "gate" or t == "gate.weight") and "an MoE block's router" or nil
    if what then
      error(("%s: target %s (%s): LoRA there is not implemented (luazero adapts the blocks' " ..
             "Linear layers and experts); merge the adapters into the base with PEFT " ..
             "(merge_and_unload, save_pretrained) and give the merged folder to --hf, or train " ..
             "adapters without it"):format(path, t, what), 0)
    end
  end
  local rslora = j.use_rslora
  if not nothing(rslora) and rslora ~= true then
    error(("%s: use_rslora must be true or false (got %s)"):format(path, cjson.encode(rslora)), 0)
  end
  local o = { r = r, alpha = alpha, targets = targets, rslora = rslora == true or nil }
  if not nothing(j.rank_pattern) then o.rank_of = pattern_matcher(path, "rank_pattern", j.rank_pattern) end
  if not nothing(j.alpha_pattern) then
    o.alpha_of = pattern_matcher(path, "alpha_pattern", j.alpha_pattern)
  end
  return o
end

-- adapter_config.json at `path`, read and checked.
function M.read(path)
  local f = io.open(path, "rb")
  if not f then
    -- (an adapter saved under a name: PEFT's save_pretrained puts it in DIR/NAME)
    local dir = path:match("^(.*)/[^/]*$") or "."
    local fs, inner = require("luazero.io.fs"), {}
    for _, name in ipairs(fs.is_dir(dir) and fs.list(dir) or {}) do
      if name ~= "." and name ~= ".." and fs.exists(dir .. "/" .. name .. "/adapter_config.json") then
        inner[#inner + 1] = dir .. "/" .. name
      end
    end
    error(("%s is not there; give PEFT's adapter folder%s"):format(path, #inner > 0 and
          (" (an adapter saved under a name is in its own folder: %s)"):format(
            table.concat(inner, ", ")) or ""), 0)
  end
  local text = f:read("*a")
  f:close()
  local ok, j = pcall(cjson.decode, text)
  if not ok or type(j) ~= "table" then error(("%s is not a JSON object"):format(path), 0) end
  return M.options(path, j)
end

return M
