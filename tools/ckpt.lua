-- tools/ckpt.lua — checkpoint tools, run by tools/ckpt. docs/checkpoints.md.
--   luazero tools/ckpt.lua inspect CKPT
--   luazero tools/ckpt.lua consolidate CKPT OUT.bin
--   luazero tools/ckpt.lua export CKPT OUT.safetensors|FOLDER [--dtype fp32|bf16|fp16]
--   luazero tools/ckpt.lua convert-states CKPT OUT --to f32|bf16|u8
local args = require("luazero.args")
local checkpoint = require("luazero.checkpoint")
local paths = require("luazero.io.paths")
local fs = require("luazero.io.fs")
-- The model families: an export names its tensors and writes its
-- config.json as the checkpoint's family declares.
local families = require("luazero.families")
require("models.registry")
local optimizers = require("luazero.optim.registry")
local formats = require("luazero.optim.formats")

local USAGE = ([[
usage: tools/ckpt COMMAND CKPT [OUT] [flags]
  inspect CKPT                 the manifest's summary, per-rank shard sizes, per-tensor norms
  consolidate CKPT OUT.bin     the fp32 master weights in canonical order (header: 256 int32,
                               magic 20240521, version 1, tensors, elements low/high 32 bits)
  export CKPT OUT.safetensors  safetensors with Hugging Face names, as the model's family
                               (models/) maps them; --dtype fp32|bf16|fp16
  export CKPT FOLDER           the same as FOLDER/model.safetensors, with FOLDER/config.json
                               (%s): a Hugging Face model folder
                               (past --max-shard-size, 5GB by default: shards and their index)
  A LoRA run's checkpoint (--lora-r) holds its adapters:
  export CKPT FOLDER           PEFT's adapter folder: adapter_model.safetensors, adapter_config.json
  export CKPT FOLDER --merge-lora [--base PATH]
                               the adapters folded into the base weights (PATH: the run's --init,
                               by default) as a Hugging Face model folder
  convert-states CKPT OUT [--to f32|bf16|u8] [--master f32|bf16]
                               a copy (OUT: a new step folder) whose optimizer states are kept
                               in f32 or bf16 (AdamW's momentum_dtype/variance_dtype) or u8
                               (AdamW8bit's, which it then names) on resume, and its master
                               weights in f32 or bf16 (bf16_stochastic_round)
CKPT: a step folder (DIR/step-000020) or a --save folder (its latest).]]):format(
  table.concat(families.architectures(), ", "))

-- Exit status 2 for bad input, 1 when writing the output failed (a full
-- disk), as docs/training.md's table says.
local function fail(msg)
  io.stderr:write("ckpt: ", tostring(msg):gsub("^checkpoint: ", ""), "\n")
  os.exit(require("luazero.io.atomic").write_failed and 1 or 2)
end

local function checked(fn, ...) return args.checked(fail, fn, ...) end

local function gib(b) return b / 2 ^ 30 end

local function inspect(ck)
  local s = ck:summary()
  print(("checkpoint %s"):format(s.dir))
  print(("  model %s, %d tensors, %d elements; saved at world %d, stage %d, %s")
        :format(tostring(s.model), s.params, s.numel, s.world_size, s.stage, s.dtype))
  print(("  steps: %d global, %d optimizer, %d skipped; loss scale %s; created %s")
        :format(s.global_steps, s.optimizer_steps, s.skipped_steps, tostring(s.loss_scale),
                tostring(s.created)))
  print(("  optimizer %s; states %s"):format(optimizers.describe(s.optimizer, s.optimizer_from),
                                             s.states_text))
  print(("  %d shard%s: %.3f GiB raw, %.3f GiB compressed (ratio %.3f)")
        :format(s.shards, s.shards == 1 and "" or "s", gib(s.raw_bytes), gib(s.compressed_bytes),
                s.ratio))
  print("  rank  file                          elements       raw bytes   compressed  ranges")
  for _, r in ipairs(ck:shard_table()) do
    print(("  %4d  %-28s %10d %15d %12d  %d"):format(r.rank, r.file, r.elems, r.raw_bytes,
                                                     r.compressed_bytes, #r.ranges))
  end
  print("  tensor                                      shape            norm (fp32 master)")
  for _, t in ipairs(ck:norms()) do
    print(("  %-43s %-16s %.6g"):format(t.name, table.concat(t.shape, "x"), t.norm))
  end
end

local export = require("luazero.checkpoint.export")
local convert = require("luazero.checkpoint.convert")

local COMMANDS = { inspect = 1, consolidate = 2, export = 2, ["convert-states"] = 2 }
-- The flags of `cmd`: the ones that shape what export or convert-states
-- writes refuse to stand beside another command (they would be ignored).
local function flag_spec(cmd)
  local export_only = { ok = function() return cmd == "export" end,
                        says = ("goes with export (the weights it writes); %s does not read it: " ..
                                "drop it"):format(cmd) }
  local convert_only = { ok = function() return cmd == "convert-states" end,
                         says = ("goes with convert-states; %s does not read it: drop it")
                                :format(cmd) }
  return {
    { "dtype", "string", "fp32", "export: fp32, bf16 or fp16", choices = { "fp32", "bf16", "fp16" },
      needs = export_only },
    { "merge-lora", "flag", false, "export of a LoRA checkpoint: the adapters folded into the base",
      needs = export_only },
    { "base", "string", nil, "with --merge-lora: the base weights (default: the run's --init)",
      needs = "merge-lora" },
    { "max-shard-size", "string", nil, "export to a FOLDER: shards of at most this many bytes " ..
      "(\"5GB\", save_pretrained's default; \"200MB\"), model-0000k-of-0000n.safetensors and " ..
      "model.safetensors.index.json", needs = export_only },
    { "to", "string", nil, "convert-states: the states' format", choices = formats.names,
      needs = convert_only },
    { "master", "string", nil, "convert-states: the master weights' format (bf16: " ..
      "bf16_stochastic_round's)", choices = { "f32", "bf16" }, needs = convert_only },
  }
end

-- The flags given a value as the next word (--dtype bf16), told from their spec.
local TAKES_VALUE = {}
for _, f in ipairs(flag_spec("")) do
  if f[2] ~= "flag" then TAKES_VALUE["--" .. f[1]] = true end
end

local function main(argv)
  -- the command, then CKPT [OUT] and the flags in any order
  local words, rest = {}, {}
  local i = 1
  while i <= #argv do
    local a = argv[i]
    if a == "--help" or a == "-h" then
      print(USAGE)
      return
    end
    if a:sub(1, 2) == "--" and #words > 0 then
      rest[#rest + 1] = a
      if TAKES_VALUE[a] and argv[i + 1] then
        rest[#rest + 1] = argv[i + 1]
        i = i + 1
      end
    else
      words[#words + 1] = a
    end
    i = i + 1
  end
  local cmd = words[1]
  if not cmd then
    io.stderr:write(USAGE, "\n")
    os.exit(2)
  end
  if not COMMANDS[cmd] then
    fail(("unknown command '%s' (inspect, consolidate, export, convert-states; --help)"):format(cmd))
  end
  local ck_path, out = words[2], words[3]
  if #words > COMMANDS[cmd] + 1 then
    fail(("unexpected argument '%s' (%s takes CKPT%s)"):format(words[COMMANDS[cmd] + 2], cmd,
         COMMANDS[cmd] == 2 and " OUT" or ""))
  end
  local flags = checked(args.parse, rest, flag_spec(cmd))
  if not ck_path then fail("missing CKPT\n" .. USAGE) end
  -- Every file it touches (io/paths.lua): OUT must not be an input. (An
  -- export's base from the run's --init is checked where it is read.)
  local p = paths.new():read("the checkpoint", ck_path)
  p:read("--base", flags.base, { whole = flags.base and fs.is_dir(flags.base) })
  if cmd ~= "inspect" then p:write("OUT", out) end
  checked(p.check, p)
  local ck = checked(checkpoint.open, ck_path)
  if cmd == "inspect" then
    checked(inspect, ck)
  elseif cmd == "consolidate" then
    if not out then fail("consolidate needs OUT.bin") end
    local n = checked(ck.consolidate, ck, out)
    print(("consolidated %d fp32 elements (%d tensors) to %s"):format(n, #ck.manifest.params, out))
  elseif cmd == "export" then
    if not out then fail("export needs OUT.safetensors or a FOLDER") end
    if ck.manifest.lora then
      print(checked(export.export_lora, ck, out, flags.dtype, flags.merge_lora, flags.base))
    elseif flags.merge_lora then
      fail(("export --merge-lora: %s is not a LoRA run's checkpoint (no adapters)"):format(ck_path))
    else
      local shard
      if flags.max_shard_size then
        local why
        shard, why = require("luazero.config").parse_bytes(flags.max_shard_size)
        if not shard then fail(("--max-shard-size %s %s"):format(flags.max_shard_size, why)) end
        if out:match("%.safetensors$") then
          fail("--max-shard-size shards a FOLDER export; OUT.safetensors is one file: give a folder")
        end
      end
      print(checked(export.export, ck, out, flags.dtype, shard))
    end
  elseif cmd == "convert-states" then
    if not out then
      fail("convert-states needs OUT (a new step folder) and --to f32|bf16|u8 or --master f32|bf16")
    end
    if not (flags.to or flags.master) then
      fail("convert-states needs --to f32|bf16|u8 (the states) or --master f32|bf16 (the master weights)")
    end
    print(checked(convert.states, ck_path, out, flags.to, flags.master))
  else
    fail(("unknown command %q\n%s"):format(cmd, USAGE))
  end
end

main(arg)
