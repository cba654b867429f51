-- run/checks.lua — a training run's flags checked before anything is read
-- or built: ranges, flags that contradict one another or would be ignored,
-- outputs that would destroy an input, a device that does not exist. Each
-- refusal is one line naming the flag and the fix (exit 2).
local run_flags = require("luazero.run.flags")
local paths = require("luazero.io.paths")
local families = require("luazero.families")
local M = {}

-- "c_attn (gpt2) or q_proj,v_proj (llama)": each family's default targets.
local function default_targets_hint()
  local t = {}
  for _, fam in ipairs(families.list()) do
    t[#t + 1] = ("%s (%s)"):format(table.concat(fam.description.lora_default or {}, ","), fam.name)
  end
  return table.concat(t, " or ")
end

-- --lora-alpha and --lora-targets shape the adapters --lora-r adds: alone
-- they would be ignored. Without --lora-targets the model's family chooses
-- (its description's lora_default).
local function check_lora(ex, flags)
  for _, n in ipairs({ "lora-alpha", "lora-targets" }) do
    local v = flags[n:gsub("-", "_")]
    if v ~= nil and not flags.lora_r then
      ex.user_error(("--%s %s without --lora-r does nothing: add --lora-r R (the adapters' " ..
                     "rank) or drop --%s"):format(n, v == "" and "''" or tostring(v), n))
    end
  end
  if flags.lora_alpha and flags.lora_alpha <= 0 then
    ex.user_error(("--lora-alpha must be > 0 (got %s): the adapters' scale is alpha / r")
                  :format(tostring(flags.lora_alpha)))
  end
  if flags.lora_r and flags.lora_targets and not flags.lora_targets:find("[^,%s]") then
    ex.user_error(("--lora-targets '%s' names no module: give comma-separated names, e.g. %s")
                  :format(flags.lora_targets, default_targets_hint()))
  end
end

-- The folders a training run writes in, and the names it makes there.
local SAVE_NAMES = { "^step%-%d+$", "^latest$", "^%.step%-%d+%.", "^%.write%-check%-" }
local SWAP_NAMES = { "^luazero%-swap%-" }

-- Every file a training run touches (io/paths.lua): the flags' and, once
-- the configuration is read (cfg), its monitors', profiler's and NVMe
-- tier's.
function M.train_paths(flags, cfg)
  local fs = require("luazero.io.fs")
  local p = paths.new()
  p:read("--data", flags.data):read("--val-data", flags.val_data)
  p:read("--resume", flags.resume):read("--config", flags.config)
  p:read("--model-config", flags.model_config)
  for _, n in ipairs({ "init", "tokenizer" }) do
    local v = flags[n]
    p:read("--" .. n, v, { whole = v and fs.is_dir(v) })
  end
  p:write("--log", flags.log):write("--profile-json", flags.profile_json)
  p:write_in("--save", flags.save, SAVE_NAMES, { ["--resume"] = true })
  p:write_in("--nvme-path", flags.nvme_path, SWAP_NAMES)
  if cfg then
    local monitor = require("luazero.monitor")
    for _, m in ipairs(monitor.files(cfg)) do
      if m.names then p:write_in(m.what, m.path, m.names) else p:write(m.what, m.path) end
    end
    local z = cfg.zero_optimization
    for _, k in ipairs({ "offload_optimizer", "offload_param" }) do
      p:write_in(("zero_optimization.%s.nvme_path"):format(k), z[k].nvme_path, SWAP_NAMES)
    end
  end
  return p
end

-- scripts/train.lua's configuration (cfg, normalised) beside its flags:
-- every file it names declared and checked, and a flops_profiler
-- profile_step the run never reaches refused (it would profile nothing).
function M.train_config(ex, flags, cfg)
  ex.checked(function() M.train_paths(flags, cfg):check() end)
  local fp = cfg.flops_profiler
  if fp.enabled and fp.profile_step > flags.steps then
    ex.user_error(("config: flops_profiler.profile_step %d is past the run's last step " ..
                   "(--steps %d), so nothing would be profiled; give a profile_step of at most " ..
                   "%d, or more --steps"):format(fp.profile_step, flags.steps, flags.steps))
  end
end

-- scripts/train.lua's flags (ex: a luazero.run.exits).
function M.train(ex, flags)
  run_flags.required(ex, flags, "data", "a text file, a token file made by tools/prepare-data, " ..
                                        "or instruction examples (.jsonl)")
  for _, n in ipairs({ "micro-batch", "grad-accum", "seq-len", "n-layer", "n-head",
                       "n-embd", "context", "vocab" }) do
    run_flags.at_least(ex, flags, n, 1)
  end
  run_flags.at_least(ex, flags, "steps", flags.init and 0 or 1)
  if flags.init and flags.resume and not flags.lora_r then
    ex.user_error(("--init %s and --resume %s: give one (--resume continues a luazero " ..
                   "checkpoint, --init starts from Hugging Face weights; with --lora-r both: the " ..
                   "base from --init, the adapters from --resume)"):format(flags.init, flags.resume))
  end
  for _, n in ipairs({ "warmup", "eval-every", "eval-batches", "sample", "save-every", "keep" }) do
    run_flags.at_least(ex, flags, n, 0)
  end
  if flags.save_every_minutes < 0 then
    ex.user_error(("--save-every-minutes must be >= 0 (got %g)"):format(flags.save_every_minutes))
  end
  if flags.lr and flags.lr <= 0 then ex.user_error("--lr must be > 0 (got " .. flags.lr .. ")") end
  if flags.model and flags.model_config then
    ex.user_error(("--model %s beside --model-config %s: the config.json defines the model; " ..
                   "drop --model (or drop --model-config to train %s)")
                  :format(flags.model, flags.model_config, flags.model))
  end
  check_lora(ex, flags)
  -- The checkpoint flags shape the saves --save makes: alone they would be ignored.
  if not flags.save then
    for _, n in ipairs({ "save-every", "save-every-minutes", "keep", "async-save" }) do
      local v = flags[n:gsub("-", "_")]
      if v ~= nil and v ~= 0 and v ~= false then
        ex.user_error(("--%s without --save does nothing: add --save DIR (the checkpoint " ..
                       "folder) or drop --%s"):format(n, n))
      end
    end
  end
  -- What the flags alone say it writes (the configuration's keys join
  -- them once it is read: M.train_paths again).
  ex.checked(function() M.train_paths(flags):check() end)
  if flags.init and not require("luazero.io.fs").exists(flags.init) then
    ex.user_error(("--init %s: no such file or folder; give a Hugging Face model folder or a " ..
                   ".safetensors file"):format(flags.init))
  end
  if flags.device ~= "cpu" and flags.device ~= "sim" and flags.device ~= "cuda" then
    ex.user_error(("--device must be cpu, sim or cuda (got %s)"):format(flags.device))
  end
end

return M
