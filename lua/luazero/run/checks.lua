-- run/checks.lua — a training run's flags checked before anything is read
-- or built: ranges, flags that contradict one another or would be ignored,
-- outputs that would destroy an input, a device that does not exist. Each
-- refusal is one line naming the flag and the fix (exit 2).
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

-- --lora-targets with --lora-r must name a module (its dependency and
-- --lora-alpha's range are declared in the flags). Without --lora-targets
-- the model's family chooses (its description's lora_default).
local function check_lora(ex, flags)
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
-- every file it names declared and checked, a --warmup without a scheduler
-- to warm up and a flops_profiler profile_step the run never reaches
-- refused (each would do nothing).
function M.train_config(ex, flags, cfg)
  ex.checked(function() M.train_paths(flags, cfg):check() end)
  -- a --config without a scheduler trains at a constant lr (as DeepSpeed)
  if flags.warmup and flags.config and not cfg.scheduler then
    ex.user_error(("--warmup %d: --config %s has no scheduler, so the lr is constant and " ..
                   "nothing warms up; add a scheduler that takes warmup_num_steps to the " ..
                   "config, or drop --warmup")
                  :format(flags.warmup, flags.config))
  end
  -- The config's save settings without --save: nothing is saved, said so
  -- (--async-save without --save is refused; these come from a shared file).
  if not flags.save then
    local keys = {}
    if cfg.checkpoint.async then keys[#keys + 1] = "checkpoint.writer.decoupled" end
    if cfg.zero_optimization.gather_16bit_weights_on_model_save then
      keys[#keys + 1] = "zero_optimization.stage3_gather_16bit_weights_on_model_save"
    end
    if #keys > 0 then
      cfg.no_effect[#cfg.no_effect + 1] = ("%s (nothing is saved without --save DIR)")
                                          :format(table.concat(keys, ", "))
    end
  end
  -- --steps 0 trains no step, so --save has no step to save: said so
  -- (the weights as loaded export straight from --init's folder)
  if flags.save and flags.steps == 0 then
    ex.say(("--save %s: --steps 0 trains nothing, so nothing is saved there (the weights as " ..
            "loaded are where they were loaded from)"):format(flags.save))
  end
  local fp = cfg.flops_profiler
  if fp.enabled and fp.profile_step > flags.steps then
    ex.user_error(("config: flops_profiler.profile_step %d is past the run's last step " ..
                   "(--steps %d), so nothing would be profiled; give a profile_step of at most " ..
                   "%d, or more --steps"):format(fp.profile_step, flags.steps, flags.steps))
  end
end

-- scripts/train.lua's flags (ex: a luazero.run.exits), beside what their
-- declarations check (luazero.args): flags that contradict one another.
function M.train(ex, flags)
  if flags.init and flags.resume and not flags.lora_r then
    ex.user_error(("--init %s and --resume %s: give one (--resume continues a luazero " ..
                   "checkpoint, --init starts from Hugging Face weights; with --lora-r both: the " ..
                   "base from --init, the adapters from --resume)"):format(flags.init, flags.resume))
  end
  if flags.model and flags.model_config then
    ex.user_error(("--model %s beside --model-config %s: the config.json defines the model; " ..
                   "drop --model (or drop --model-config to train %s)")
                  :format(flags.model, flags.model_config, flags.model))
  end
  check_lora(ex, flags)
  -- What the flags alone say it writes (the configuration's keys join
  -- them once it is read: M.train_paths again).
  ex.checked(function() M.train_paths(flags):check() end)
  if flags.init and not require("luazero.io.fs").exists(flags.init) then
    ex.user_error(("--init %s: no such file or folder; give a Hugging Face model folder or a " ..
                   ".safetensors file"):format(flags.init))
  end
end

return M
