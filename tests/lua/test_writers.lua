-- test_writers.lua — every writer of a user's file (io/atomic.lua): tools/ckpt
-- consolidate, export to a file and to a folder, PEFT adapters,
-- tools/prepare-data (bytes and --tokenizer), the sweep's files. A write
-- that fails at a chosen byte count (LZ_WRITE_FAIL_AFTER_BYTES) or on a
-- really full tmpfs (as root) exits non-zero with one line naming the path
-- and the bytes, leaves no partial file or folder, and an earlier complete
-- output of the same name stays as it was.
local cjson = require("cjson")
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local checkpoint = require("luazero.checkpoint")

local T = {}
local q = support.quote
local write_file, tmp, corpus = support.scratch_corpus(
  "It is a truth universally acknowledged, that a single man in possession of a good fortune\n", 40)

local eq, exists = support.eq, support.exists

-- A tool run from the root: output (stdout and stderr) and exit status.
local function tool(env, cmd)
  return support.sh(("cd %s && %s LUAZERO=%s %s"):format(q(lz.root), env or "",
                                                       q(lz.executable()), cmd))
end

-- What a path holds: a file's bytes, or a folder's names and bytes, as text.
local function snapshot(path)
  local p = io.popen("cd " .. q(path:match("^(.*)/") or ".") .. " && find " ..
                     q(path:match("([^/]+)$")) .. " -type f 2>/dev/null | sort")
  local parts = {}
  for f in p:lines() do
    local dir = path:match("^(.*)/") or "."
    parts[#parts + 1] = f .. "\n" .. (lz.read_file(dir .. "/" .. f) or "?")
  end
  p:close()
  return table.concat(parts, "\n--\n")
end

local function listing(dir)
  local p = io.popen("ls -A " .. q(dir))
  local s = p:read("*a")
  p:close()
  return s
end

-- A refused write: non-zero exit, one line naming `needles`, the target and
-- its folder as they were.
local function refused(env, cmd, target, needles)
  local dir = target:match("^(.*)/")
  local before, names = snapshot(target), listing(dir)
  local out, st = tool(env, cmd)
  assert(st ~= 0, "expected a failure of " .. cmd .. ":\n" .. out)
  -- a full disk is a failure during the run (exit 1), not bad input (2)
  if env and env:find("LZ_WRITE_FAIL_AFTER_BYTES", 1, true) then eq(st, 1, "exit status: " .. out) end
  local _, lines = out:gsub("\n", "")
  eq(lines, 1, "lines of the error " .. out)
  for _, n in ipairs(needles) do
    assert(out:find(n, 1, true), ("%q does not name %q"):format(out, n))
  end
  eq(snapshot(target), before, target .. " after a failed write")
  eq(listing(dir), names, "the names in " .. dir .. " after a failed write")
  return out
end

local function ok_tool(env, cmd)
  local out, st = tool(env, cmd)
  assert(st == 0, cmd .. " failed:\n" .. out)
  return out
end

local cks = {}
-- A checkpoint: plain GPT-2 (gpt2) or llama-tiny with LoRA adapters (lora).
local function ck(kind)
  if cks[kind] then return cks[kind] end
  local dir = tmp .. "/ck-" .. kind
  local model = kind == "lora" and "--model llama-tiny --lora-r 2 --lora-alpha 4" or
                "--model gpt2-nano --n-layer 2 --n-embd 64 --n-head 4"
  local train = support.trainer(("%s --context 32 --seq-len 16 --micro-batch 2 --sample 0 " ..
                                 "--eval-batches 1 --data %s"):format(model, q(corpus)))
  local out, st = train(1, "--steps 2 --save " .. q(dir))
  assert(st == 0, out)
  local numel = checkpoint.open(dir).manifest.numel
  cks[kind] = { dir = dir, scratch = 1024 + numel * 4 }
  return cks[kind]
end

local function fail_at(n) return "LZ_WRITE_FAIL_AFTER_BYTES=" .. math.floor(n) end

function T.consolidate_that_fails_leaves_the_earlier_file()
  local c = ck("gpt2")
  local out = tmp .. "/consolidate/c.bin"
  os.execute("mkdir -p " .. q(tmp .. "/consolidate"))
  ok_tool(nil, ("tools/ckpt consolidate %s %s"):format(q(c.dir), q(out)))
  eq(#lz.read_file(out), c.scratch, "consolidated bytes")
  refused(fail_at(5000), ("tools/ckpt consolidate %s %s"):format(q(c.dir), q(out)), out,
          { out, "writing failed after 5000 of " .. c.scratch .. " bytes" })
end

function T.export_to_a_file_that_fails_leaves_the_earlier_file()
  local c = ck("gpt2")
  local out = tmp .. "/export-file/e.safetensors"
  os.execute("mkdir -p " .. q(tmp .. "/export-file"))
  ok_tool(nil, ("tools/ckpt export %s %s"):format(q(c.dir), q(out)))
  local cmd = ("tools/ckpt export %s %s --dtype bf16"):format(q(c.dir), q(out))
  -- While the scratch copy is written, then while the file itself is.
  refused(fail_at(100), cmd, out, { out, "scratch copy", "writing failed after 100 of" })
  refused(fail_at(c.scratch + 300), cmd, out, { out, "writing failed after 300 of" })
end

-- Exports checkpoint `kind` to the folder out: the earlier folder a failed
-- export must leave. Returns the checkpoint, the command, and the bytes of
-- out/file.
local function exported_folder(kind, out, file)
  local c = ck(kind)
  local cmd = ("tools/ckpt export %s %s"):format(q(c.dir), q(out))
  ok_tool(nil, cmd)
  return c, cmd, #lz.read_file(out .. "/" .. file)
end

function T.export_to_a_folder_that_fails_leaves_the_earlier_folder()
  local out = tmp .. "/export-folder/hf"
  local c, cmd, model_bytes = exported_folder("gpt2", out, "model.safetensors")
  refused(fail_at(64), cmd, out, { out, "scratch copy" })
  refused(fail_at(c.scratch + 1000), cmd, out,
          { out .. "/model.safetensors", ("after 1000 of %d bytes"):format(model_bytes) })
  refused(fail_at(c.scratch + model_bytes + 10), cmd, out,
          { out .. "/config.json", "writing failed after 10 of" })
  -- A complete export replaces it whole.
  ok_tool(nil, cmd .. " --dtype bf16")
  assert(#lz.read_file(out .. "/model.safetensors") < model_bytes, "the bf16 export is not there")
  -- In shards: one failing in a later shard leaves the earlier folder;
  -- a complete one replaces it (model.safetensors gone), and a single file
  -- replaces the shards again.
  local sharded = cmd .. " --max-shard-size 100KB"
  refused(fail_at(c.scratch + 150000), sharded, out, { out .. "/model-0000", "writing failed after" })
  ok_tool(nil, sharded)
  assert(exists(out .. "/model.safetensors.index.json") and not exists(out .. "/model.safetensors"),
         "the sharded export")
  assert(listing(out):find("model%-00001%-of%-%d+%.safetensors"), "the shards")
  ok_tool(nil, cmd)
  assert(exists(out .. "/model.safetensors") and not exists(out .. "/model.safetensors.index.json")
         and not listing(out):find("model%-%d+%-of%-%d+%.safetensors"), "the single file again")
end

function T.peft_adapters_that_fail_leave_the_earlier_folder()
  local out = tmp .. "/peft/adapters"
  local c, cmd, st_bytes = exported_folder("lora", out, "adapter_model.safetensors")
  refused(fail_at(c.scratch + 50), cmd, out, { out .. "/adapter_model.safetensors" })
  refused(fail_at(c.scratch + st_bytes + 5), cmd, out,
          { out .. "/adapter_config.json", "writing failed after 5 of" })
  local cfg = cjson.decode(lz.read_file(out .. "/adapter_config.json"))
  eq(cfg.r, 2, "adapter_config.json r")
end

function T.prepare_data_that_fails_leaves_the_earlier_file()
  local out = tmp .. "/prepared/corpus.bin"
  os.execute("mkdir -p " .. q(tmp .. "/prepared"))
  ok_tool(nil, ("tools/prepare-data %s %s"):format(q(corpus), q(out)))
  local bytes = #lz.read_file(out)
  -- (the ids stream out as each input is tokenised: the total is not known
  -- ahead, so the message says the bytes written)
  assert(bytes > 2000, bytes)
  refused(fail_at(2000), ("tools/prepare-data %s %s"):format(q(corpus), q(out)), out,
          { out, "writing failed after 2000 bytes" })
  -- With a tokenizer: every byte its own token, so the same size.
  local vocab = {}
  for b = 0, 255 do
    local printable = (b >= 33 and b <= 126) or (b >= 161 and b <= 172) or b >= 174
    if printable then vocab[b < 128 and string.char(b) or
                         string.char(0xC0 + math.floor(b / 64), 0x80 + b % 64)] = b end
  end
  local n = 0
  for b = 0, 255 do
    local printable = (b >= 33 and b <= 126) or (b >= 161 and b <= 172) or b >= 174
    if not printable then
      local cp = 256 + n
      n = n + 1
      vocab[string.char(0xC0 + math.floor(cp / 64), 0x80 + cp % 64)] = b
    end
  end
  local tok = write_file("tokenizer.json", cjson.encode({
    pre_tokenizer = { type = "ByteLevel", add_prefix_space = false, use_regex = true },
    decoder = { type = "ByteLevel" }, model = { type = "BPE", vocab = vocab, merges = {} } }))
  refused(fail_at(0), ("tools/prepare-data --tokenizer %s %s %s"):format(q(tok), q(corpus), q(out)),
          out, { out, "writing failed after 0 bytes" })
end

function T.sweep_files_that_fail_stop_the_sweep_and_leave_nothing()
  local dir = tmp .. "/sweep"
  os.execute("mkdir -p " .. q(dir))
  write_file("sweep/s.lua", ([[return { name = "w", base = { model = "gpt2-nano", data = %q,
    steps = 1, ["n-layer"] = 1, ["n-embd"] = 32, ["n-head"] = 2, context = 32, ["seq-len"] = 16,
    ["micro-batch"] = 2, sample = 0, ["eval-batches"] = 1 },
    runs = { { lr = 1e-3 } } }]]):format(corpus))
  local out, st = tool(fail_at(0), ("%s scripts/sweep.lua %s --out %s"):format(
    q(lz.executable()), q(dir .. "/s.lua"), q(dir .. "/out")))
  assert(st ~= 0, out)
  assert(out:find("command.txt: writing failed after 0 of", 1, true), out)
  local p = io.popen("find " .. q(dir .. "/out") .. " -type f 2>/dev/null")
  local files = p:read("*a")
  p:close()
  eq(files, "", "files the failed sweep left")
end

-- A really full disk: a 256 KiB tmpfs (root only; skipped otherwise).
function T.a_full_tmpfs_is_refused_without_a_partial_file()
  local c = ck("gpt2")
  local mnt = tmp .. "/tmpfs"
  os.execute("mkdir -p " .. q(mnt))
  local uid = support.sh("id -u")
  if not uid:match("^0%s") or
     select(2, support.sh("mount -t tmpfs -o size=256k tmpfs " .. q(mnt))) ~= 0 then
    print("    skipped: mounting a tmpfs needs root")
    return
  end
  local ok, err = pcall(function()
    assert(c.scratch > 256 * 1024, "the checkpoint fits the tmpfs")
    local out = mnt .. "/c.bin"
    refused(nil, ("tools/ckpt consolidate %s %s"):format(q(c.dir), q(out)), out,
            { out, "of " .. c.scratch .. " bytes", "No space left on device" })
    refused(nil, ("tools/ckpt export %s %s"):format(q(c.dir), q(mnt .. "/hf")), mnt .. "/hf",
            { mnt .. "/hf", "No space left on device" })
    -- --save there: refused before the run, and no folder left behind.
    local train = support.trainer("--model gpt2-nano --n-layer 2 --n-embd 64 --n-head 4 " ..
                                  "--context 32 --seq-len 16 --micro-batch 2 --sample 0")
    local tout, st = train(1, ("--data %s --steps 1 --save %s/run/a"):format(q(corpus), q(mnt)))
    assert(st == 2 and tout:find("MiB free, one checkpoint needs about", 1, true), tout)
    eq(listing(mnt), "", "the tmpfs after the failed writes")
  end)
  support.sh("umount " .. q(mnt))
  if not ok then error(err, 0) end
end

------------------------------------------------------------- refusals

-- An export into a folder holding another model's files is refused, the
-- folder untouched; a refused --merge-lora leaves no folder.
function T.export_refuses_a_folder_with_other_files_and_leaves_none_when_refused()
  local c = ck("gpt2")
  local out = tmp .. "/other-model"
  os.execute("mkdir -p " .. q(out))
  write_file("other-model/config.json", "{}")
  write_file("other-model/tokenizer.json", "{}")
  refused(nil, ("tools/ckpt export %s %s"):format(q(c.dir), q(out)), out,
          { out, "tokenizer.json", "new or empty folder" })
  local lc = ck("lora")
  local none = tmp .. "/never-merged"
  local text, st = tool(nil, ("tools/ckpt export %s %s --merge-lora"):format(q(lc.dir), q(none)))
  assert(st == 2 and text:find("--base PATH", 1, true), text)
  assert(not exists(none), "a refused --merge-lora left " .. none)
  text, st = tool(nil, ("tools/ckpt export %s %s --merge-lora --base %s"):format(q(lc.dir),
                  q(none), q(tmp .. "/no-such-base")))
  assert(st == 2, text)
  assert(not exists(none), "a refused --merge-lora left " .. none)
  eq(listing(tmp):find("never%-merged"), nil, "leftovers of the refused export in " .. tmp)
end

-- The 16-bit export beside a checkpoint (stage3_gather_16bit_weights_on_
-- model_save) that fails: the checkpoint is whole and latest names it, and
-- the error says so and how to write the export again, not that nothing
-- was written.
function T.a_failed_16bit_export_says_its_checkpoint_is_saved()
  local cfg = write_file("hf16.json", '{"train_micro_batch_size_per_gpu": 2, ' ..
                         '"zero_optimization": {"stage": 3, ' ..
                         '"stage3_gather_16bit_weights_on_model_save": true}}')
  local dir = tmp .. "/hf16-run"
  local out, st = tool("LZ_WRITE_FAIL_AFTER_BYTES=1000", (q(lz.executable()) ..
    " scripts/train.lua --model gpt2-nano " ..
    "--n-layer 1 --n-embd 32 --n-head 2 --context 16 --seq-len 8 --micro-batch 2 --sample 0 " ..
    "--eval-batches 1 --data %s --steps 2 --save-every 2 --config %s --save %s")
    :format(q(corpus), q(cfg), q(dir)))
  assert(st == 1, out)
  local step = dir .. "/step-000002"
  assert(out:find(step .. " is saved (latest names it), but its 16-bit export " ..
                  "(stage3_gather_16bit_weights_on_model_save) failed: ", 1, true) and
         out:find("`tools/ckpt export " .. step .. " OUT --dtype bf16` writes it again", 1, true),
         out)
  eq(lz.read_file(dir .. "/latest"), "step-000002\n", "latest")
  checkpoint.open(step) -- whole: its manifest reads
  assert(not exists(step .. "/hf16"), "a partial hf16 folder")
end

-- A folder output named by a symbolic link to a name not there yet is
-- made at that name, the link left a link; a link in a loop is refused
-- before anything is written.
function T.a_folder_output_at_a_dangling_link_is_made_at_its_target()
  local c = ck("gpt2")
  os.execute("mkdir -p " .. q(tmp .. "/links"))
  local out = tmp .. "/links/hf"
  os.execute(("ln -sfn %s %s"):format(q(tmp .. "/links/nowhere"), q(out)))
  ok_tool(nil, ("tools/ckpt export %s %s"):format(q(c.dir), q(out)))
  eq(select(2, support.sh("test -L " .. q(out))), 0, "the link is still a link")
  assert(exists(tmp .. "/links/nowhere/config.json"), "the export at the link's target")
  local loop = tmp .. "/links/loop"
  os.execute(("ln -sfn loop %s"):format(q(loop)))
  refused(nil, ("tools/ckpt convert-states %s %s --to bf16"):format(q(c.dir), q(loop)), loop,
          { loop, "a symbolic link that cannot be followed (a loop?)", "remove the link" })
end

-- An output named by a symbolic link is written where the link points, the
-- link left a link (a rename would put a file in its place); a FIFO or a
-- device named as the output is refused and left as it was (a rename would
-- replace it: /dev/null itself, for root).
function T.an_output_through_a_link_lands_at_its_target_and_a_device_is_refused()
  local dir = tmp .. "/linked"
  os.execute(("mkdir -p %s/real %s/realdir"):format(q(dir), q(dir)))
  local text = write_file("linked/in.txt", "abc abc abc\n")
  os.execute(("ln -sfn real/out.bin %s/link.bin && ln -sfn realdir %s/linkdir"):format(q(dir), q(dir)))
  ok_tool(nil, ("tools/prepare-data %s %s/link.bin"):format(q(text), q(dir)))
  eq(select(2, support.sh("test -L " .. q(dir .. "/link.bin"))), 0, "the link is still a link")
  eq(#(lz.read_file(dir .. "/real/out.bin") or ""), 1024 + 12 * 2, "the token file at the target")
  local c = ck("gpt2")
  ok_tool(nil, ("tools/ckpt export %s %s/linkdir"):format(q(c.dir), q(dir)))
  eq(select(2, support.sh("test -L " .. q(dir .. "/linkdir"))), 0, "the folder link is still a link")
  assert(exists(dir .. "/realdir/config.json"), "the export in the link's target folder")
  -- a link to a folder spelt with a trailing slash: that folder
  os.execute(("mkdir -p %s/slashed && ln -sfn slashed/ %s/slashlink"):format(q(dir), q(dir)))
  ok_tool(nil, ("tools/ckpt export %s %s/slashlink"):format(q(c.dir), q(dir)))
  assert(exists(dir .. "/slashed/config.json"), "the export in the folder a slashed link names")
  -- /dev/stdout redirected to a file: refused, the file keeping what was printed
  local script = write_file("linked/stdout.lua", 'print("before")\n' ..
    'local ok, err = pcall(require("luazero.io.atomic").write, "/dev/stdout", "DATA\\n")\n' ..
    'io.stderr:write(tostring(err), "\\n")\nprint("after")\n')
  local serr, sst = support.sh(("(%s %s > %s/redirected.txt)"):format(q(lz.executable()),
                                                                     q(script), q(dir)))
  assert(sst == 0 and serr:find("/dev/stdout is a file descriptor of this process", 1, true), serr)
  eq(lz.read_file(dir .. "/redirected.txt"), "before\nafter\n", "the redirected output")
  os.execute("mkfifo " .. q(dir .. "/pipe"))
  refused(nil, ("tools/prepare-data %s %s/pipe"):format(q(text), q(dir)), dir .. "/pipe",
          { dir .. "/pipe is a FIFO (named pipe), not a file", "give a file path" })
  eq(select(2, support.sh("test -p " .. q(dir .. "/pipe"))), 0, "the FIFO after a refused write")
  if select(2, support.sh("mknod " .. q(dir .. "/null") .. " c 1 3")) == 0 then -- (as root)
    refused(nil, ("tools/ckpt consolidate %s %s/null"):format(q(c.dir), q(dir)), dir .. "/null",
            { dir .. "/null is a character device, not a file" })
    eq(select(2, support.sh("test -c " .. q(dir .. "/null"))), 0, "the device after a refused write")
  end
end

-- An output that is one of its own inputs (the same file by real path or
-- device and inode: ./ forms, symlinks, hard links) or a file inside an
-- input folder is refused, naming both, and the input stays as it was.
function T.an_output_that_is_an_input_is_refused()
  local dir = tmp .. "/same"
  os.execute("mkdir -p " .. q(dir))
  local text = write_file("same/c.txt", "abc abc abc\n")
  os.execute(("ln -sf c.txt %s/link.txt && ln -f %s %s/hard.txt"):format(q(dir), q(text), q(dir)))
  local other = write_file("same/d.txt", "def\n")
  refused(nil, ("tools/prepare-data %s %s"):format(q(text), q(text)), text,
          { "the output " .. text, "the input " .. text })
  refused(nil, ("tools/prepare-data %s %s/./link.txt"):format(q(text), q(dir)), text,
          { "is the same file as the input" })
  refused(nil, ("tools/prepare-data %s %s %s/hard.txt"):format(q(other), q(text), q(dir)), text,
          { "the output " .. dir .. "/hard.txt", "the input " .. text })
  -- The checkpoint's own files, as consolidate's or export's output.
  local c = ck("gpt2")
  local shard = c.dir .. "/step-000002/shard-00000-of-00001.zst"
  refused(nil, ("tools/ckpt consolidate %s %s"):format(q(c.dir), q(shard)), shard,
          { "OUT " .. shard, "inside the checkpoint " .. c.dir })
  refused(nil, ("tools/ckpt export %s %s/latest"):format(q(c.dir), q(c.dir)), c.dir .. "/latest",
          { "inside the checkpoint " .. c.dir })
  -- --log: the training data, or a file the --resume folder holds.
  local train = support.trainer("--model gpt2-nano --n-layer 2 --n-embd 64 --n-head 4 " ..
                                "--context 32 --seq-len 16 --micro-batch 2 --sample 0 " ..
                                "--eval-batches 1")
  local before = lz.read_file(corpus)
  local out, st = train(1, ("--data %s --steps 1 --log %s"):format(q(corpus), q(corpus)))
  assert(st == 2 and out:find("--log " .. corpus .. " is the same file as --data " .. corpus, 1, true),
         out)
  eq(lz.read_file(corpus), before, "the data after a refused --log")
  local latest = lz.read_file(c.dir .. "/latest")
  out, st = train(1, ("--data %s --steps 3 --resume %s --log %s/latest"):format(q(corpus), q(c.dir),
                  q(c.dir)))
  assert(st == 2 and out:find("is inside --resume " .. c.dir, 1, true), out)
  eq(lz.read_file(c.dir .. "/latest"), latest, "latest after a refused --log")
end

return T
