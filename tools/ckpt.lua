-- tools/ckpt.lua — checkpoint tools, run by tools/ckpt. docs/checkpoints.md.
--   luazero tools/ckpt.lua inspect CKPT
--   luazero tools/ckpt.lua consolidate CKPT OUT.bin
--   luazero tools/ckpt.lua export CKPT OUT.safetensors [--dtype fp32|bf16]
local ffi = require("ffi")
local cjson = require("cjson")
local lz = require("luazero")
local args = require("luazero.args")
local checkpoint = require("luazero.checkpoint")

local USAGE = [[
usage: tools/ckpt COMMAND CKPT [OUT] [flags]
  inspect CKPT                 the manifest's summary, per-rank shard sizes, per-tensor norms
  consolidate CKPT OUT.bin     the fp32 master weights in canonical order (header: 256 int32,
                               magic 20240521, version 1, tensors, elements low/high 32 bits)
  export CKPT OUT.safetensors  safetensors with Hugging Face names: GPT-2's (wte.weight,
                               h.0.attn.c_attn.weight [in, out], ...), Llama's as they are
                               (model.embed_tokens.weight, ...); --dtype fp32|bf16
CKPT: a step folder (DIR/step-000020) or a --save folder (its latest).]]

local function fail(msg)
  io.stderr:write("ckpt: ", tostring(msg):gsub("^checkpoint: ", ""), "\n")
  os.exit(2)
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

-- Hugging Face GPT-2 (GPT2Model) name of a luazero parameter, and whether
-- it is a Conv1D weight (stored [in, out]: our [out, in] transposed).
local function hf_name(name)
  local n = name:gsub("^transformer%.", "")
  local conv = n:match("%.c_attn%.weight$") or n:match("%.c_proj%.weight$") or
               n:match("%.c_fc%.weight$")
  return n, conv ~= nil
end

-- Tables with a row per token: exported without the padding rows past the
-- real vocabulary (GPT-2's wte; Llama's embed_tokens and untied lm_head).
local vocab_tables = { ["wte.weight"] = true, ["model.embed_tokens.weight"] = true,
                       ["lm_head.weight"] = true }

local function export(ck, out, dtype)
  local m = ck.manifest
  if dtype ~= "fp32" and dtype ~= "bf16" then
    fail(("--dtype %s: expected fp32 or bf16"):format(tostring(dtype)))
  end
  local vocab = m.model and m.model.config and m.model.config.vocab
  local tmp = out .. ".consolidated-tmp"
  checked(ck.consolidate, ck, tmp)
  local esize = dtype == "bf16" and 2 or 4
  -- Header: every tensor's name, dtype, shape, byte range.
  local entries, offset = {}, 0
  local header = { __metadata__ = { format = "pt", source = "luazero " .. lz.version(),
                                    step = tostring(m.global_steps) } }
  for _, p in ipairs(m.params) do
    local name, conv = hf_name(p.name)
    local shape = { unpack(p.shape) }
    local rows = shape[1]
    if vocab_tables[name] and vocab and vocab < rows then rows = vocab; shape[1] = vocab end
    if conv then shape = { shape[2], shape[1] } end
    local n = 1
    for _, d in ipairs(shape) do n = n * d end
    entries[#entries + 1] = { p = p, name = name, conv = conv, shape = shape, numel = n,
                              rows = rows, begin = offset }
    header[name] = { dtype = dtype == "bf16" and "BF16" or "F32", shape = shape,
                     data_offsets = { offset, offset + n * esize } }
    offset = offset + n * esize
  end
  local text = cjson.encode(header)
  text = text .. (" "):rep((8 - #text % 8) % 8)
  local f, err = io.open(out, "wb")
  if not f then os.remove(tmp); fail(("%s: cannot write it (%s)"):format(out, tostring(err))) end
  local len = ffi.new("uint64_t[1]", #text)
  f:write(ffi.string(len, 8), text)
  local src = assert(io.open(tmp, "rb"))
  local bar = checkpoint.progress("export", offset)
  for _, e in ipairs(entries) do
    local p = e.p
    src:seek("set", 1024 + p.offset * 4)
    local n_in = e.conv and p.numel or e.numel -- token tables: only the real vocabulary rows
    local raw = src:read(n_in * 4)
    local t = lz.tensor({ e.numel }, "f32", "workspace")
    if e.conv then
      local a, b = ffi.cast("const float *", raw), ffi.cast("float *", t.data)
      local rows, cols = p.shape[1], p.shape[2] -- ours [out, in] -> [in, out]
      for r = 0, rows - 1 do
        for c = 0, cols - 1 do b[c * rows + r] = a[r * cols + c] end
      end
    else
      ffi.copy(t.data, raw, e.numel * 4)
    end
    if dtype == "bf16" then
      local h = lz.tensor({ e.numel }, "bf16", "workspace"):copy(t)
      f:write(ffi.string(h.data, h:bytes()))
      h:free()
    else
      f:write(ffi.string(t.data, t:bytes()))
    end
    t:free()
    bar.update(e.begin + e.numel * esize)
  end
  bar.finish()
  src:close()
  f:close()
  os.remove(tmp)
  print(("exported %d tensors (%s, %.1f MiB) to %s"):format(#entries, dtype, offset / 2 ^ 20, out))
end

local function main(argv)
  local cmd, ck_path, out = argv[1], argv[2], argv[3]
  if not cmd or cmd == "--help" or cmd == "-h" then
    print(USAGE)
    return
  end
  local rest = {}
  for i = (cmd == "inspect" and 3 or 4), #argv do rest[#rest + 1] = argv[i] end
  local flags = checked(args.parse, rest, { { "dtype", "string", "fp32", "export: fp32 or bf16" } })
  if not ck_path then fail("missing CKPT\n" .. USAGE) end
  local ck = checked(checkpoint.open, ck_path)
  if cmd == "inspect" then
    checked(inspect, ck)
  elseif cmd == "consolidate" then
    if not out then fail("consolidate needs OUT.bin") end
    local n = checked(ck.consolidate, ck, out)
    print(("consolidated %d fp32 elements (%d tensors) to %s"):format(n, #ck.manifest.params, out))
  elseif cmd == "export" then
    if not out then fail("export needs OUT.safetensors") end
    export(ck, out, flags.dtype)
  else
    fail(("unknown command %q\n%s"):format(cmd, USAGE))
  end
end

main(arg)
