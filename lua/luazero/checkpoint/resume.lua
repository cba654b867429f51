-- checkpoint/resume.lua — what a resume must agree with its checkpoint on,
-- beyond the model's tensors (checkpoint/load.lua checks those): a LoRA
-- run's rank, alpha and targets, and the frozen base its adapters were
-- trained on (the --init path and the xxh64 of its safetensors files'
-- bytes, both in the manifest). A difference is one line naming the flag
-- and the saved value.
--
--   local init = resume.check(flags, manifest, path)  -- the --init to use, or nil
local hf = require("luazero.hf")

local M = {}

local function fail(fmt, ...) error(fmt:format(...), 0) end

local exists = require("luazero.io.fs").exists

local function targets_of(text)
  local t = {}
  for s in (text or ""):gmatch("[^,%s]+") do t[#t + 1] = s end
  return table.concat(t, ",")
end

-- A comma-separated list as its distinct names, sorted: the set it names.
local function sorted_set(text)
  local t, seen = {}, {}
  for name in text:gmatch("[^,]+") do
    if not seen[name] then seen[name] = true; t[#t + 1] = name end
  end
  table.sort(t)
  return table.concat(t, ",")
end

-- The LoRA flags against the manifest's lora {r, alpha, targets}.
local function check_lora(flags, lora, where)
  if not lora then
    if flags.lora_r then
      fail("--lora-r %d: the checkpoint %s holds no LoRA adapters (a run that trained every " ..
           "weight); resume without --lora-r", flags.lora_r, where)
    end
    return
  end
  -- A manifest without targets comes from a version whose one default was q_proj,v_proj.
  local targets = table.concat(lora.targets or { "q_proj", "v_proj" }, ",")
  if not flags.lora_r then
    fail("the checkpoint %s trained LoRA adapters; resume with --lora-r %d --lora-alpha %.14g " ..
         "--lora-targets %s", where, lora.r, lora.alpha, targets)
  end
  if flags.lora_r ~= lora.r then
    fail("--lora-r %d: the checkpoint %s was saved with --lora-r %d; resume with --lora-r %d",
         flags.lora_r, where, lora.r, lora.r)
  end
  local alpha = flags.lora_alpha or flags.lora_r
  -- (the manifest keeps 14 digits: an alpha of more is the same to them)
  if math.abs(alpha - lora.alpha) > 1e-13 * math.abs(lora.alpha) then
    fail("--lora-alpha %.14g%s: the checkpoint %s was saved with --lora-alpha %.14g; resume with " ..
         "--lora-alpha %.14g", alpha, flags.lora_alpha and "" or " (the default: --lora-r)", where,
         lora.alpha, lora.alpha)
  end
  if flags.lora_targets and sorted_set(targets_of(flags.lora_targets)) ~= sorted_set(targets) then
    fail("--lora-targets %s: the checkpoint %s was saved with --lora-targets %s; resume with " ..
         "--lora-targets %s", targets_of(flags.lora_targets), where, targets, targets)
  end
  -- The same set in another order, or none given: the saved order, which
  -- lays the adapters out as they were saved.
  flags.lora_targets = targets
end

-- The base weights of a LoRA checkpoint: the --init given, or the one it
-- recorded; its checksum must be the recorded one.
local function check_base(flags, m, where)
  if not m.init then
    if flags.init then
      fail("--init %s: the checkpoint %s was trained on a base drawn from --seed (no --init); " ..
           "resume without --init", flags.init, where)
    end
    return nil
  end
  local path, recorded = flags.init, false
  if not path then
    path, recorded = m.init, true
    if not exists(path) then
      fail("the checkpoint %s was trained on the base --init %s, which is gone; give those " ..
           "weights with --init PATH", where, path)
    end
  end
  M.check_base_checksum(path, m, where, "--init")
  return recorded and path or nil
end

-- The base weights at `path` (given as `flag`: --init, --base) against the
-- xxh64 the manifest m recorded for its --init (nothing recorded: nothing
-- to check).
function M.check_base_checksum(path, m, where, flag)
  local want = m.init_xxh64
  if not want then return end
  local got = hf.checksum(path)
  if got ~= want then
    fail("%s %s: its weights hash to xxh64 %s, but the checkpoint %s was trained on a " ..
         "base hashing to %s (%s); give the base the run started from", flag, path, got, where,
         want, m.init)
  end
end

function M.check(flags, m, where)
  check_lora(flags, m.lora, where)
  if m.lora then return check_base(flags, m, where) end
  return nil
end

return M
