-- checkpoint/export.lua — a checkpoint as Hugging Face files: a
-- model.safetensors (Hugging Face's tensor names, fp32, bf16 or fp16) or a model
-- folder (with config.json), and a LoRA run's adapter folder (PEFT's) or its
-- adapters merged into the base. tools/ckpt export and the 16-bit export
-- beside each save (zero_optimization.stage3_gather_16bit_weights_on_model_save)
-- both write through here. docs/checkpoints.md.
--   local export = require("luazero.checkpoint.export")
--   print(export.export(checkpoint.open("runs/a/step-000020"), "hf-folder", "bf16"))
-- Each returns the line that says what it wrote; a file or folder appears
-- whole or not at all (io/atomic.lua).
local ffi = require("ffi")
local cjson = require("cjson")
local lz = require("luazero")
local progress = require("luazero.checkpoint.reader").progress
local hf = require("luazero.hf")
local safetensors = require("luazero.checkpoint.safetensors")
local atomic = require("luazero.io.atomic")
local fs = require("luazero.io.fs")
local LoraExperts = require("luazero.nn.lora_experts")

pcall(ffi.cdef, "int getpid(void);")

local M = {}

-- The tokenizer's files a Hugging Face folder holds (AutoTokenizer's).
local TOKENIZER_FILES = { "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                          "tokenizer.model", "chat_template.jinja", "added_tokens.json",
                          "vocab.json", "merges.txt" }
-- What an export folder holds; an existing folder holding anything else is
-- refused rather than left with stale files of another model beside ours.
local FOLDER_FILES = { "config.json", "model.safetensors", "adapter_config.json",
                       "adapter_model.safetensors", "generation_config.json" }

-- The tokenizer the model reads: the --init folder's, else the one its data
-- was read with (the manifest's extra.data.tokenizer: a folder, or a
-- tokenizer.json of any name). Returns its folder and, for a lone file, its
-- path; nil for none (byte level).
local function tokenizer_source(m)
  if m.init and fs.exists(m.init .. "/tokenizer.json") then return m.init end
  local t = type(m.extra) == "table" and type(m.extra.data) == "table" and m.extra.data.tokenizer
  if type(t) ~= "string" then return nil end
  if fs.is_dir(t) then return fs.exists(t .. "/tokenizer.json") and t or nil end
  if fs.exists(t) then return t:match("^(.*)/[^/]*$") or ".", t end
end

-- The tokenizer's files an export of m copies: { name = source path }.
local function tokenizer_files(m)
  local from, file = tokenizer_source(m)
  local out = {}
  if not from then return out end
  for _, name in ipairs(TOKENIZER_FILES) do
    local src = (file and name == "tokenizer.json") and file or from .. "/" .. name
    -- (a lone tokenizer.json: its folder's tokenizer_config.json beside it)
    if (not file or name == "tokenizer.json" or name == "tokenizer_config.json") and
       fs.exists(src) and not fs.is_dir(src) then
      out[name] = src
    end
  end
  return out
end

-- What an export folder of m holds: FOLDER_FILES and the tokenizer's files
-- it copies (a folder holding another tokenizer.json is refused when this
-- export writes none).
local function folder_files(m)
  local names = { "model.safetensors.index.json", "^model%-%d+%-of%-%d+%.safetensors$" }
  for _, n in ipairs(FOLDER_FILES) do names[#names + 1] = n end
  for n in pairs(tokenizer_files(m)) do names[#names + 1] = n end
  return names
end

-- The --init folder's generation_config.json (the tokens transformers'
-- generate stops at, its sampling defaults), and the model's tokenizer
-- (tokenizer_files), copied into an export of a model trained from them,
-- where they are still there: the folder loads in transformers with its
-- tokenizer, and generate.lua --hf reads text with it.
local function copy_generation_config(m, dir)
  local text = m.init and lz.read_file(m.init .. "/generation_config.json")
  if text then atomic.write(dir .. "/generation_config.json", text) end
  for name, src in pairs(tokenizer_files(m)) do
    local t = lz.read_file(src)
    if t then atomic.write(dir .. "/" .. name, t) end
  end
end

local function refuse(msg) error(msg, 0) end

-- What an export folder holds, in words: "an export of <architecture>",
-- "PEFT adapters", or nil (nothing of ours).
local function held(dir)
  local ok, j = pcall(cjson.decode, lz.read_file(dir .. "/config.json") or "")
  if ok and type(j) == "table" and type(j.architectures) == "table" then
    return "an export of " .. tostring(j.architectures[1])
  end
  if lz.read_file(dir .. "/adapter_config.json") then return "PEFT adapters" end
end

-- The end of an export's message where the folder held something else
-- before (`before`, held's words) that it replaced.
local function replaced(before, dir)
  local now = held(dir)
  if before and before ~= now then return ("; it replaced %s there"):format(before) end
  return ""
end

local function path_exists(path)
  local f = io.open(path, "rb")
  if f then f:close() end
  return f ~= nil
end

-- The consolidated fp32 master as a scratch file beside `near`, handed to
-- fn(path); removed afterwards whatever happens. `out`: the output named in
-- messages.
local function with_consolidated(ck, near, out, fn)
  local dir, name = near:match("^(.*)/([^/]*)$")
  dir, name = dir or ".", name or near
  local scratch = ("%s/.%s.consolidated-%d"):format(dir, name, ffi.C.getpid())
  local probe = io.open(dir .. "/.", "rb")
  if not probe then refuse(("%s: the folder %s does not exist; make it first"):format(out, dir)) end
  probe:close()
  local ok, err = pcall(ck.consolidate, ck, scratch)
  if not ok then
    os.remove(scratch)
    local i, j = tostring(err):find(scratch .. ": ", 1, true)
    if i == 1 then
      err = ("%s: its scratch copy of the fp32 weights (%s): %s"):format(out, scratch,
            tostring(err):sub(j + 1))
    end
    error(err, 0)
  end
  ok, err = pcall(fn, scratch)
  os.remove(scratch)
  if not ok then error(err, 0) end
  return err
end

-- n fp32 values of the consolidated file at element `offset`.
local function read_floats(src, scratch, offset, n)
  src:seek("set", 1024 + offset * 4)
  local raw = src:read(n * 4)
  if not raw or #raw ~= n * 4 then
    refuse(("%s: read %d of %d bytes at element %d; the scratch copy was cut short")
           :format(scratch, raw and #raw or 0, n * 4, offset))
  end
  return raw
end

-- What each export dtype writes: the safetensors dtype (its bytes an
-- element: safetensors.DTYPES) and the tensor dtype it is rounded through
-- (none: fp32 as is).
local DTYPES = { fp32 = { st = "F32" }, bf16 = { st = "BF16", lz = "bf16" },
                 fp16 = { st = "F16", lz = "f16" } }
for _, d in pairs(DTYPES) do d.size = safetensors.DTYPES[d.st] end

-- An f32 tensor's data written to w in dtype (fp32 as is, bf16 and fp16
-- rounded to nearest even).
local function write_data(w, t, dtype)
  local lz_dtype = DTYPES[dtype].lz
  if lz_dtype then
    local h = lz.tensor({ t:numel() }, lz_dtype, "workspace"):copy(t)
    local ok, err = pcall(w.write, w, h.data, h:bytes())
    h:free()
    if not ok then error(err, 0) end
  else
    w:write(t.data, t:bytes())
  end
end

local function write_json(path, t) atomic.write(path, cjson.encode(t) .. "\n") end

-- The tensors of an export in shards of at most max_bytes each (a larger
-- tensor alone), in order, as save_pretrained's max_shard_size splits them;
-- one shard when max_bytes is nil.
local function shards_of(entries, max_bytes)
  local shards, cur, size = {}, nil, 0
  for _, e in ipairs(entries) do
    if not cur or (max_bytes and size + e.bytes > max_bytes and #cur > 0) then
      cur, size = {}, 0
      shards[#shards + 1] = cur
    end
    cur[#cur + 1] = e
    size = size + e.bytes
  end
  return shards
end

-- model.safetensors of a checkpoint at `file`: Hugging Face's names (as the
-- checkpoint's family maps them, luazero/hf.lua), token tables without
-- their padding rows, streamed from
-- the consolidated fp32 master (a scratch file beside), one tensor in
-- memory. With max_shard_bytes and more than one shard's worth, they go into
-- model-0000k-of-0000n.safetensors beside `file` and
-- model.safetensors.index.json (transformers' sharded layout). Returns the
-- tensor count, the bytes of data and the number of files.
local function write_model(ck, file, dtype, out, max_shard_bytes)
  local m = ck.manifest
  local mcfg = m.model and m.model.config or {}
  local fam = hf.family(mcfg)
  local esize = DTYPES[dtype].size
  local entries = {}
  for _, p in ipairs(m.params) do
    local e = hf.tensor_of(fam, p.name, p.shape, mcfg.vocab)
    local n = 1
    for _, d in ipairs(e.shape) do n = n * d end
    e.p, e.numel, e.bytes = p, n, n * esize
    e.dtype = DTYPES[dtype].st
    entries[#entries + 1] = e
  end
  local shards = shards_of(entries, max_shard_bytes)
  local dir = file:match("^(.*)/[^/]*$") or "."
  local files, grand = {}, 0
  for k, list in ipairs(shards) do
    files[k] = #shards == 1 and file or
               ("%s/model-%05d-of-%05d.safetensors"):format(dir, k, #shards)
    for _, e in ipairs(list) do grand = grand + e.bytes end
  end
  local meta = { format = "pt", source = "luazero " .. lz.version(),
                 step = tostring(m.global_steps) }
  with_consolidated(ck, file, out or file, function(scratch)
    local src = assert(io.open(scratch, "rb"))
    local bar = progress("export", grand)
    local before = 0
    local ok, err = pcall(function()
      for k, list in ipairs(shards) do
        local head, total = safetensors.header(list, meta)
        atomic.build_file(files[k], #head + total, function(w)
          w:write(head)
          for _, e in ipairs(list) do
            local p = e.p
            local n_in = e.conv and p.numel or e.numel -- token tables: the real vocabulary rows
            local raw = read_floats(src, scratch, p.offset, n_in)
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
            local wok, werr = pcall(write_data, w, t, dtype)
            t:free()
            if not wok then error(werr, 0) end
            bar.update(before + e.data_offset + e.bytes)
          end
        end)
        for _, e in ipairs(list) do before = before + e.bytes end
      end
    end)
    src:close()
    bar.finish()
    if not ok then error(err, 0) end
  end)
  if #shards > 1 then
    local map = {}
    for k, list in ipairs(shards) do
      for _, e in ipairs(list) do map[e.name] = files[k]:match("([^/]*)$") end
    end
    write_json(dir .. "/model.safetensors.index.json",
               { metadata = { total_size = grand }, weight_map = map })
  end
  return #entries, grand, #shards
end

-- A folder's shards at most this big, as save_pretrained's max_shard_size
-- ("5GB": 5e9 bytes).
M.MAX_SHARD_BYTES = 5e9

-- Bytes as save_pretrained's max_shard_size writes them: "5GB", "300KB".
local function decimal_bytes(b)
  for _, u in ipairs({ { 1e12, "TB" }, { 1e9, "GB" }, { 1e6, "MB" }, { 1e3, "KB" } }) do
    if b >= u[1] then return ("%.4g%s"):format(b / u[1], u[2]) end
  end
  return ("%dB"):format(b)
end

-- The export: OUT ending in .safetensors: that file; anything else: a
-- folder with model.safetensors (or, past max_shard_bytes, default
-- MAX_SHARD_BYTES, model-0000k-of-0000n.safetensors and their index) and
-- config.json, loadable by transformers' from_pretrained. Either appears
-- whole or not at all.
function M.export(ck, out, dtype, max_shard_bytes)
  local mcfg = ck.manifest.model and ck.manifest.model.config or {}
  -- (frozen weights drawn from a seed, or set by hand, are in no file)
  local missing = ck.manifest.frozen_xxh64 and "; the model's frozen weights are not in it: " ..
                  "a checkpoint holds what trains, and they came from no --init" or ""
  if not out:match("%.safetensors$") then
    out = out:gsub("/+$", "")
    local before = held(out)
    local r = atomic.build_folder(out, folder_files(ck.manifest), function(f)
      local n, total, shards = write_model(ck, f.tmp .. "/model.safetensors", dtype, out,
                                           max_shard_bytes or M.MAX_SHARD_BYTES)
      atomic.write(f.tmp .. "/config.json", hf.config_json_text(mcfg, dtype) .. "\n")
      copy_generation_config(ck.manifest, f.tmp)
      return { n, total, shards }
    end)
    local where = r[3] == 1 and "model.safetensors" or
                  ("model-00001-of-%05d.safetensors ... (%d shards of at most %s) and " ..
                   "model.safetensors.index.json"):format(r[3], r[3],
                   decimal_bytes(max_shard_bytes or M.MAX_SHARD_BYTES))
    return ("exported %d tensors (%s, %.1f MiB) to %s/%s and config.json%s%s")
           :format(r[1], dtype, r[2] / 2 ^ 20, out, where, replaced(before, out), missing)
  end
  local n, total = write_model(ck, out, dtype)
  return ("exported %d tensors (%s, %.1f MiB) to %s%s"):format(n, dtype, total / 2 ^ 20, out,
                                                                missing)
end

------------------------------------------------------------------ LoRA

-- Writes a safetensors file of `tensors` ({name, shape, data = f32 tensor})
-- in dtype (fp32|bf16|fp16).
local function write_safetensors(file, tensors, dtype, m)
  local esize = DTYPES[dtype].size
  local entries = {}
  for _, t in ipairs(tensors) do
    local n = t.data:numel()
    entries[#entries + 1] = { name = t.name, shape = t.shape, numel = n, bytes = n * esize,
                              dtype = DTYPES[dtype].st, src = t.data }
  end
  local head, total = safetensors.header(entries, { format = "pt",
    source = "luazero " .. lz.version(), step = tostring(m.global_steps) })
  atomic.build_file(file, #head + total, function(w)
    w:write(head)
    for _, e in ipairs(entries) do write_data(w, e.src, dtype) end
  end)
end

-- The adapters of a LoRA checkpoint, fp32, by name: { [name] = {name, shape, data} }, in order.
local function adapters_of(ck, near, out)
  local m = ck.manifest
  return with_consolidated(ck, near, out, function(scratch)
    local src = assert(io.open(scratch, "rb"))
    local list = {}
    local ok, err = pcall(function()
      for _, p in ipairs(m.params) do
        local raw = read_floats(src, scratch, p.offset, p.numel)
        local t = lz.tensor({ p.numel }, "f32", "workspace")
        ffi.copy(t.data, raw, p.numel * 4)
        list[#list + 1] = { name = p.name, shape = p.shape, data = t }
      end
    end)
    src:close()
    if not ok then error(err, 0) end
    return list
  end)
end

-- The base model with the adapters folded in: W + (alpha / r) B A,
-- computed as the adapted layers compute it; its tensors, in the base's
-- order, and how many gained adapters. An expert's adapters
-- (nn/lora_experts.lua) fold into its gate, up and down weights, each the
-- rows of B that adapt it.
local function merged(m, adapters, base)
  local lora = m.lora
  local by_base = {}
  local on_experts = false
  -- (keyed by the base file's name of the weight: the family's, GPT-2's
  -- without "transformer.", and conv where the file holds it transposed)
  local fam = hf.family(m.model.config)
  for _, a in ipairs(adapters) do
    if LoraExperts.is_adapter(a.name) then
      on_experts = true
    else
      local f = hf.tensor_of(fam, (a.name:gsub("%.lora_([AB])%.weight$", ".weight")), { 1, 1 })
      by_base[f.name] = by_base[f.name] or { conv = f.conv }
      by_base[f.name][a.name:match("lora_([AB])%.weight$")] = a
    end
  end
  if on_experts then
    local desc = hf.family(m.model.config).description
    if not desc.expert_names then
      refuse(("export --merge-lora: the %s family does not name its experts' projections " ..
              "(its description's expert_names); export the PEFT folder instead")
             :format(tostring(m.model.config.family)))
    end
    for w, t in pairs(LoraExperts.merge_targets(adapters, desc.expert_names)) do by_base[w] = t end
  end
  local src = hf.open(base)
  -- (a file's names as the family reads them: GPT2LMHeadModel's carry
  -- "transformer.", which tensor_of's leave out)
  local from_hf = fam and fam.hf and fam.hf.from_hf or function(x) return x end
  local scale = lora.alpha / lora.r
  local out_list, folded = {}, 0
  for _, st in ipairs(src.files) do
    for _, n in ipairs(st.names) do
      local t = st.tensors[n]
      local w = lz.tensor({ t.numel }, "f32", "workspace")
      st:read(t, 0, t.numel, ffi.cast("float *", w.data))
      local key = by_base[n] and n or from_hf(n)
      local ad = by_base[key]
      if ad then
        local rows, cols = t.shape[1], t.shape[2]
        if ad.conv then rows, cols = cols, rows end -- (the file's [in, out])
        if ad.rows and ad.rows ~= rows then
          refuse(("export --merge-lora: %s is [%d, %d] in %s; its adapters adapt %d rows: give " ..
                  "the base the run started from (--base)"):format(n, rows, cols, base, ad.rows))
        end
        local a = ad.A.data:view(0, { lora.r, cols })
        local b = ad.B.data:view((ad.row or 0) * lora.r, { rows, lora.r })
        if ad.conv then -- W^T [in, out] += s A^T B^T
          lz.ops.matmul(w:view(0, { cols, rows }), a, b, 1, 1, scale, 1)
        else
          lz.ops.matmul(w:view(0, { rows, cols }), b, a, 0, 0, scale, 1)
        end
        by_base[key] = nil
        folded = folded + 1
      end
      out_list[#out_list + 1] = { name = n, shape = t.shape, data = w }
    end
  end
  hf.close(src)
  local missing = next(by_base)
  if missing then
    refuse(("export --merge-lora: %s has no tensor %s for its adapters; give the base the run " ..
            "started from (--base)"):format(base, missing))
  end
  return out_list, folded
end

-- The adapters under PEFT's names, and adapter_config.json's target lists:
-- the experts' (nn/lora_experts.lua) fused into PEFT's per-block tensors
-- and listed as target_parameters, the rest as they are (target_modules).
local function peft_adapters(m, adapters)
  local desc = hf.family(m.model.config).description
  local where = desc.lora_targets or {}
  local modules, params = {}, {}
  for _, t in ipairs(m.lora.targets) do
    local list = where[t] and where[t].experts and params or modules
    list[#list + 1] = t
  end
  local experts = LoraExperts.peft_names(adapters, desc.lora_peft_paths)
  local named, fused = {}, {}
  for _, a in ipairs(adapters) do
    local v = experts[a.name]
    if v then
      local n = a.data:numel()
      local f = fused[v.key]
      if not f then
        f = { name = "base_model.model." .. v.key, data = lz.tensor({ v.E * n }, "f32", "workspace"),
              shape = v.ab == "A" and { v.E * v.r, a.shape[2] } or { a.shape[1], v.r * v.E } }
        fused[v.key] = f
        named[#named + 1] = f
      end
      local src, dst = ffi.cast("float *", a.data.data), ffi.cast("float *", f.data.data)
      for j = 0, n - 1 do dst[LoraExperts.fused_index(v, a.shape, j)] = src[j] end
    else
      named[#named + 1] = { name = "base_model.model." .. a.name, shape = a.shape, data = a.data }
    end
  end
  return named, modules, params
end

-- PEFT's adapter folder, or (merge) the base model with the adapters folded
-- in; the folder appears whole or not at all.
function M.export_lora(ck, out, dtype, merge, base)
  local m = ck.manifest
  local lora, mcfg = m.lora, m.model and m.model.config or {}
  out = out:gsub("/+$", "")
  if out:match("%.safetensors$") then
    refuse(("export: %s: a LoRA checkpoint exports a folder (PEFT's adapter_model.safetensors " ..
            "and adapter_config.json, or with --merge-lora the merged model's files), not one " ..
            ".safetensors file; give a folder name"):format(out))
  end
  base = base or m.init
  if merge and not base then
    refuse("export --merge-lora: the checkpoint does not say where its base weights came from " ..
           "(no --init); give them with --base PATH")
  end
  if merge then
    if not path_exists(base) then
      refuse(("export --merge-lora: the base %s%s is not there; give the weights the run " ..
              "started from with --base PATH"):format(base, base == m.init and
              " (the run's --init)" or ""))
    end
    atomic.refuse_overlap(out, "OUT", base, "the base")
    require("luazero.checkpoint.resume").check_base_checksum(base, m, ck.dir,
      base == m.init and "the run's --init" or "--base")
  end
  local before = held(out)
  local n_out = atomic.build_folder(out, merge and folder_files(m) or FOLDER_FILES, function(f)
    local adapters = adapters_of(ck, f.tmp .. "/adapters", out)
    if not merge then
      local named, modules, params = peft_adapters(m, adapters)
      local fam = hf.family(mcfg)
      local transposed = fam and fam.hf and fam.hf.transposed or {}
      write_safetensors(f.tmp .. "/adapter_model.safetensors", named, dtype, m)
      -- cjson writes an empty table as {}: target_modules is a list ([] when
      -- only the experts are adapted; absent, PEFT would pick its default).
      atomic.write(f.tmp .. "/adapter_config.json", (cjson.encode({
        peft_type = "LORA", task_type = "CAUSAL_LM", r = lora.r, lora_alpha = lora.alpha,
        target_modules = modules, lora_dropout = 0.0, bias = "none",
        target_parameters = #params > 0 and params or nil,
        -- (a family whose file stores weights [in, out], GPT-2's Conv1D:
        -- PEFT's flag for that)
        fan_in_fan_out = #transposed > 0, inference_mode = true,
        base_model_name_or_path = m.init or "",
      }):gsub('"target_modules":{}', '"target_modules":[]')) .. "\n")
      return #named
    end

    local out_list, folded = merged(m, adapters, base)
    write_safetensors(f.tmp .. "/model.safetensors", out_list, dtype, m)
    atomic.write(f.tmp .. "/config.json", hf.config_json_text(mcfg, dtype) .. "\n")
    copy_generation_config(m, f.tmp)
    return { #out_list, folded }
  end)
  if not merge then
    return ("exported %d adapter tensors (%s) to %s/adapter_model.safetensors and " ..
            "adapter_config.json%s"):format(n_out, dtype, out, replaced(before, out))
  end
  return ("exported %d tensors (%s, %d with adapters folded in) to %s/model.safetensors and " ..
          "config.json%s"):format(n_out[1], dtype, n_out[2], out, replaced(before, out))
end

return M
