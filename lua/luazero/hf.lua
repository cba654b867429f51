-- hf.lua — Hugging Face weights and a ZeRO engine: which Hugging Face tensor
-- each of our parameters is (as the model's family maps the names and
-- layouts: its hf table, luazero/families.lua), a model.safetensors or a
-- Hugging Face folder loaded into an engine with each rank reading only the
-- byte ranges of its own partition, and the config.json of a model (its
-- family's writer). Holds no family's names. docs/models.md, "Hugging Face
-- weights".
--
--   local hf = require("luazero.hf")
--   hf.check("model.safetensors", model)          -- names, shapes, sizes: errors before any work
--   hf.load_into(engine, "model.safetensors")     -- or a folder: config.json, shards, index
--   hf.config_path("folder")                      -- its config.json, or nil
--   hf.tensor_of(family, name, shape, vocab)      -- {name, shape, conv, rows}
--   hf.config_json(model_cfg, "fp32")             -- a table for cjson
local oneline = require("luazero.io.oneline")
local ffi = require("ffi")
local lz = require("luazero")
local Module = require("luazero.nn.module")
local rng = require("luazero.rng")
local cjson = require("cjson")
local safetensors = require("luazero.checkpoint.safetensors")
local families = require("luazero.families")

local M = {}

local shape_text = safetensors.shape_text

local function fail(fmt, ...) error(oneline.of("init: " .. fmt:format(...)), 0) end

------------------------------------------------------------------- names

-- A family's name mapping (its hf table, luazero/families.lua), with what
-- a family may leave out: names as they are, nothing transposed.
local function same(n) return n end
local function mapping(fam)
  local h = fam and fam.hf or {}
  local vocab = {}
  for _, n in ipairs(h.vocab_tables or {}) do vocab[n] = true end
  return { to_hf = h.to_hf or same, from_hf = h.from_hf or same, transposed = h.transposed or {},
           vocab = vocab, ignored = h.ignored or {} }
end

-- The family of a model config (cfg.family), from the table of families.
function M.family(cfg) return families.get((cfg or {}).family) end

-- A file's name for one of our parameters as family `fam` maps it
-- (fam.hf.to_hf), its shape in the file: a token table (fam.hf.vocab_tables)
-- with the real vocabulary's rows (ours are padded), a weight the family
-- stores transposed (fam.hf.transposed: GPT-2's Conv1D, [in, out]) with
-- its dimensions swapped.
function M.tensor_of(fam, name, shape, vocab)
  local h = mapping(fam)
  local n = h.to_hf(name)
  local conv = false
  for _, pat in ipairs(h.transposed) do conv = conv or n:match(pat) ~= nil end
  local s = { unpack(shape) }
  local rows = s[1]
  if h.vocab[n] and vocab and vocab < rows then rows = vocab; s[1] = vocab end
  if conv then s = { s[2], s[1] } end
  return { name = n, shape = s, conv = conv, rows = rows }
end

------------------------------------------------------------------ source

local fs = require("luazero.io.fs")
local exists, is_dir = fs.exists, fs.is_dir

-- A folder's config.json, or nil (a file, or a folder without one).
function M.config_path(path)
  path = path:gsub("/+$", "")
  if is_dir(path) and exists(path .. "/config.json") then return path .. "/config.json" end
end

local function list_safetensors(dir)
  local p = io.popen("ls -1 '" .. dir:gsub("'", "'\\''") .. "' 2>/dev/null")
  local out = {}
  for name in p:lines() do
    if name:match("%.safetensors$") then out[#out + 1] = dir .. "/" .. name end
  end
  p:close()
  table.sort(out)
  return out
end

-- The files of `path` opened and their headers checked: a .safetensors
-- file, or a folder with model.safetensors, else model.safetensors.index.json
-- (its weight_map names the shards), else *.safetensors (transformers' order). Returns {files, by_name
-- (a tensor's name as tensor_of gives it, through fam.hf.from_hf ->
-- {file, t}), where (what names the source in messages)}. fam: the family
-- whose names the files hold (nil: names as they are).
function M.open(path, fam)
  local normal_name = mapping(fam).from_hf
  path = path:gsub("/+$", "")
  local src = { files = {}, by_name = {}, where = path }
  local names, index = {}, nil
  if is_dir(path) then
    -- (model.safetensors first, then the index, as transformers looks)
    local ipath = path .. "/model.safetensors.index.json"
    local text = not exists(path .. "/model.safetensors") and require("luazero").read_file(ipath)
    if text then
      local ok, j = pcall(cjson.decode, text)
      if not ok or type(j) ~= "table" or type(j.weight_map) ~= "table" then
        fail("%s: not JSON with a weight_map object (%s); the index is damaged", ipath,
             ok and "no weight_map" or tostring(j))
      end
      index = { path = ipath, map = j.weight_map }
      local seen = {}
      for _, file in pairs(j.weight_map) do
        if type(file) ~= "string" or file:find("/", 1, true) or file == "" or file == "." or
           file == ".." then
          fail("%s: weight_map holds %s, not a file name in %s", ipath, cjson.encode(file), path)
        end
        if not seen[file] then seen[file] = true; names[#names + 1] = path .. "/" .. file end
      end
      table.sort(names)
    elseif exists(path .. "/model.safetensors") then
      names = { path .. "/model.safetensors" }
    else
      names = list_safetensors(path)
    end
    if #names == 0 then
      -- (an older Hub folder: PyTorch's pickles, which are not read here)
      if exists(path .. "/pytorch_model.bin") or exists(path .. "/pytorch_model.bin.index.json") then
        fail("%s: its weights are pytorch_model*.bin (PyTorch pickles), which luazero does not " ..
             "read; convert them once to safetensors with transformers: " ..
             "AutoModelForCausalLM.from_pretrained(%q).save_pretrained(OUT, " ..
             "safe_serialization=True)", path, path)
      end
      fail("%s: a folder without model.safetensors, model.safetensors.index.json or any " ..
           "*.safetensors; give a Hugging Face model folder or a .safetensors file", path)
    end
  else
    if not exists(path) then fail("%s: cannot read it; give a .safetensors file or a folder", path) end
    names = { path }
  end
  local ok, err = pcall(function()
    for _, file in ipairs(names) do
      if not exists(file) then
        fail("%s: %s names %s, which is missing; download the shard again", index.path,
             "its weight_map", file)
      end
      local st = safetensors.open(file)
      src.files[#src.files + 1] = st
      for _, n in ipairs(st.names) do
        local key = normal_name(n)
        local prev = src.by_name[key]
        if prev then
          fail("tensor %s is in both %s and %s; keep one", n, prev.file.path, file)
        end
        src.by_name[key] = { file = st, t = st.tensors[n] }
      end
    end
    if index then
      for n, file in pairs(index.map) do
        local e = src.by_name[normal_name(n)]
        if e and e.file.path ~= path .. "/" .. file then
          fail("%s says tensor %s is in %s, but %s holds it; fix the index", index.path, n, file,
               e.file.path)
        elseif not e then
          fail("%s: tensor %s is missing (%s names it there); download the shard again",
               path .. "/" .. file, n, index.path)
        end
      end
    end
  end)
  if not ok then
    M.close(src)
    error(err, 0)
  end
  return src
end

function M.close(src)
  for _, st in ipairs(src.files) do st:close() end
end

-- xxh64 of the bytes of path's safetensors files, in the order M.open lists
-- them (16 hex digits): what a LoRA checkpoint records of its base.
local sums = {}
function M.checksum(path)
  if sums[path] then return sums[path] end
  local src = M.open(path)
  local h = lz.hasher(0)
  local ok, err = pcall(function()
    for _, st in ipairs(src.files) do
      local f = assert(io.open(st.path, "rb"))
      while true do
        local chunk = f:read(2 ^ 24)
        if not chunk then break end
        h:update(chunk, #chunk)
      end
      f:close()
    end
  end)
  M.close(src)
  local sum = ok and require("bit").tohex(h:digest(), 16)
  h:free()
  if not ok then error(err, 0) end
  sums[path] = sum
  return sum
end

------------------------------------------------------------------ plan

-- A tied model's file may hold the LM head beside the token table: a copy
-- of it is skipped; a head that differs is refused, since the model would
-- train the table in its place (transformers 5 keeps such a checkpoint's
-- head apart, untied; 4.x drops it). head: the file's entry (by_name's).
-- A head found the table's copy is remembered by file and name, as
-- M.checksum remembers its sums: hf.check and hf.load_into each plan, and
-- the comparison reads both tables whole.
local tied_copies = {}
local function check_tied_head(src, h, fam, cfg, head)
  local tab = src.by_name[h.from_hf(fam.hf.vocab_tables[1])]
  if not tab then return end -- (the plan names a missing table)
  local a, b = head.t, tab.t
  local key = head.file.path .. "\0" .. a.name .. "\0" .. tab.file.path .. "\0" .. b.name
  if tied_copies[key] then return end
  local same = shape_text(a.shape) == shape_text(b.shape)
  local CHUNK = 2 ^ 20
  local x, y = ffi.new("float[?]", CHUNK), ffi.new("float[?]", CHUNK)
  local xb, yb = ffi.cast("uint32_t *", x), ffi.cast("uint32_t *", y)
  local at = 0
  while same and at < a.numel do
    local k = math.min(CHUNK, a.numel - at)
    head.file:read(a, at, k, x)
    tab.file:read(b, at, k, y)
    for i = 0, k - 1 do
      if xb[i] ~= yb[i] then
        same = false
        break
      end
    end
    at = at + k
  end
  if not same then
    fail("%s: tensor %s differs from %s, but this model (%s) ties its LM head to the token " ..
         "table (config.json's tie_word_embeddings); to train the file's head, set " ..
         "\"tie_word_embeddings\": false in config.json (as transformers 5 reads such a file)",
         head.file.path, a.name, b.name, cfg.name or "?")
  end
  tied_copies[key] = true
end

-- What fixes weights that do not fit the model: the model described by the
-- config.json beside them (its name is its folder's, as models.registry
-- names one) has sizes that do not match them; another, the model flags.
local function fit_fix(src, cfg)
  local folder = (src.where:gsub("/+$", "")):match("([^/]+)$")
  local named = type(cfg.name) == "string" and cfg.name:match("([^/]+)/config%.json$")
  if folder and named == folder then
    return "the config.json beside them does not describe them: check the sizes it gives " ..
           "(hidden_size, num_attention_heads, num_key_value_heads, head_dim, " ..
           "intermediate_size, vocab_size)"
  end
  return "give the --model / --model-config the weights were made for"
end

-- For each of the model's parameters (param_table order), the tensor that
-- fills it; every tensor of the source used once. Errors name the tensor
-- and the file.
local function plan(src, model, fam)
  local cfg = model.cfg or {}
  local want, used = {}, {}
  local one = #src.files == 1 and src.files[1].path or src.where
  local i = 0
  for _, p in ipairs(model.param_table) do
    -- LoRA adapters are not in a base model's files: they keep their start.
    if p.name:find("lora_[AB]%.weight$") then goto next end
    i = i + 1
    local e = M.tensor_of(fam, p.name, p.shape, cfg.vocab)
    local have = src.by_name[e.name]
    if not have then
      fail("%s: tensor %s %s is missing (this model, %s, has it); give the weights of this " ..
           "model, or the --model / --model-config they were made for", one, e.name,
           shape_text(e.shape), cfg.name or "?")
    end
    if shape_text(have.t.shape) ~= shape_text(e.shape) then
      fail("%s: tensor %s has shape %s, this model (%s) wants %s; %s", have.file.path,
           have.t.name, shape_text(have.t.shape), cfg.name or "?", shape_text(e.shape),
           fit_fix(src, cfg))
    end
    used[e.name] = true
    e.file, e.t, e.p = have.file, have.t, p
    want[i] = e
    want[p.name] = e
    ::next::
  end
  -- A tied model's file may hold the LM head (the token table's copy).
  local h = mapping(fam)
  local tied_head = fam.hf.tied(cfg) and fam.hf.head
  for _, st in ipairs(src.files) do
    for _, n in ipairs(st.names) do
      local key = h.from_hf(n)
      local skip = key == tied_head
      if skip then check_tied_head(src, h, fam, cfg, src.by_name[key]) end
      for _, pat in ipairs(h.ignored) do skip = skip or key:match(pat) ~= nil end
      if not used[key] and not skip then
        fail("%s: tensor %s is not a parameter of this model (%s); give the --model / " ..
             "--model-config the weights were made for", st.path, n, cfg.name or "?")
      end
    end
  end
  return want
end

------------------------------------------------------------------ reading

-- Elements [a, a + k) of our parameter (canonical layout) into dst.
local function read_param(e, a, k, dst)
  if not e.conv then
    -- Rows past the file's (the vocabulary padding) stay zero.
    local n = math.max(0, math.min(k, e.t.numel - a))
    e.file:read(e.t, a, n, dst)
    return
  end
  -- Ours [out, in], the file's [in, out]: our rows r0..r1 are the file's
  -- columns r0..r1, read from each of its `in` rows.
  local out, inn = e.p.shape[1], e.p.shape[2]
  local r0, r1 = math.floor(a / inn), math.floor((a + k - 1) / inn)
  local nr = r1 - r0 + 1
  local tmp = ffi.new("float[?]", inn * nr)
  for c = 0, inn - 1 do e.file:read(e.t, c * out + r0, nr, tmp + c * nr) end
  for j = 0, k - 1 do
    local idx = a + j
    local r = math.floor(idx / inn)
    dst[j] = tmp[(idx - r * inn) * nr + r - r0]
  end
end

-- A parameter the files do not hold (a LoRA adapter): drawn whole as its
-- init says, from its own generator (the seed and its place in the table;
-- a keyed init's, Module.init_rng: the seed and its name), so every rank
-- and every chunking draws the same numbers. Cached by name.
local function drawn(p, index, seed, cache)
  local t = cache[p.name]
  if t then return t end
  t = ffi.new("float[?]", p.numel)
  Module.fill_init(p.init, t, p.numel, Module.init_rng(p, seed, rng.new(seed, 1000 + index)))
  cache[p.name] = t
  return t
end

-- Canonical elements [c, c + n) of `params` (a parameter table: the
-- engine's trainable one) into dst, across parameters; one the files do
-- not hold is drawn (drawn).
local function fill(want, params, c, n, dst, seed, cache)
  local lo, hi = 1, #params
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    if params[mid].offset <= c then lo = mid else hi = mid - 1 end
  end
  local i = lo
  while n > 0 do
    local p = params[i]
    local a = c - p.offset
    local k = math.min(n, p.numel - a)
    local e = want[p.name]
    if e then
      read_param(e, a, k, dst)
    else
      ffi.copy(dst, drawn(p, i, seed, cache) + a, k * 4)
    end
    c, n, dst, i = c + k, n - k, dst + k, i + 1
  end
end

-- Checks that path's weights fill model (names, shapes, file sizes) without
-- reading them: what load_into refuses, refused before anything is built.
function M.check(path, model)
  local fam = M.family(model.cfg)
  local src = M.open(path, fam)
  local ok, err = pcall(plan, src, model, fam)
  M.close(src)
  if not ok then error(err, 0) end
end

-- Loads Hugging Face weights (path: a .safetensors file or a folder) into
-- engine's fp32 master, through the states the optimizer holds on this rank
-- (engine:visit_states), reading only their byte ranges; the optimizer's
-- own states are zero. Then engine:after_load() derives the working copy
-- and gathers. Every check is made before anything is written. Returns
-- {files, tensors}.
function M.load_into(engine, path)
  local fam = M.family(engine.model.cfg)
  local src = M.open(path, fam)
  local ok, err = pcall(function()
    local want = plan(src, engine.model, fam)
    local runs = engine:state_layout().runs
    local params = engine.ptable
    local cache = {}
    local ri = 1
    engine:visit_states(true, function(off, ...)
      local views = { ... }
      local len = views[1]:numel()
      -- The optimizer's states start at zero; the master's elements are all
      -- written below but an adapter's (and padding, zero already).
      for s = 2, #views do ffi.fill(views[s].data, len * 4) end
      local master = ffi.cast("float *", views[1].data)
      if ri > #runs or runs[ri].offset > off then ri = 1 end
      while ri <= #runs and runs[ri].offset + runs[ri].numel <= off do ri = ri + 1 end
      local j = ri
      while j <= #runs and runs[j].offset < off + len do
        local r = runs[j]
        local a, b = math.max(r.offset, off), math.min(r.offset + r.numel, off + len)
        if b > a then
          fill(want, params, r.canonical + a - r.offset, b - a, master + (a - off), engine.seed,
               cache)
        end
        j = j + 1
      end
    end)
    -- Frozen parameters, in the working dtype: the parts this rank keeps
    -- (engine.frozen:ranges: all of them below stage 3), read in chunks.
    local chunk = 2 ^ 22
    local tmp = lz.tensor({ chunk }, "f32", "workspace")
    local frozen = engine.frozen
    for _, p in ipairs(frozen.entries) do
      local e = want[p.name]
      if e then
        for _, r in ipairs(frozen:ranges(p)) do
          for a = r[1], r[1] + r[2] - 1, chunk do
            local k = math.min(chunk, r[1] + r[2] - a)
            read_param(e, a, k, ffi.cast("float *", tmp.data))
            local v = tmp:view(0, { k })
            frozen:write(p, a, v)
            v:free()
          end
        end
      end
    end
    tmp:free()
    frozen:done()
    return #want
  end)
  M.close(src)
  if not ok then error(err, 0) end
  engine:after_load()
  return { files = #src.files, tensors = err }
end

------------------------------------------------------------------ config

local TORCH_DTYPES = { fp32 = "float32", bf16 = "bfloat16", fp16 = "float16" }

-- models.from_hf_config(path, overrides) (models: the registry, given by the
-- caller: this layer does not reach up to models/), its errors naming the
-- file's fields (num_attention_heads) rather than ours (n_head).
function M.model_config(models, path, overrides)
  return models.from_hf_config(path, overrides, { file_words = true })
end

-- The config.json of a model config (models/registry.lua's fields, or a
-- manifest's model.config): its family's (fam.hf.config_json), loadable by
-- transformers' AutoModelForCausalLM; dtype: the weights' (fp32, bf16).
function M.config_json(cfg, dtype)
  local j = M.family(cfg).hf.config_json(cfg)
  j.torch_dtype = TORCH_DTYPES[dtype or "fp32"] or "float32"
  return j
end

-- config_json as the text of the file. cjson writes a whole number without
-- a decimal point, and transformers 5.x refuses an int where its config
-- declares a float: the keys a family lists in hf.float_keys are written
-- with one (2 -> 2.0).
function M.config_json_text(cfg, dtype)
  local j = M.config_json(cfg, dtype)
  local text = cjson.encode(j)
  for _, k in ipairs(M.family(cfg).hf.float_keys or {}) do
    -- (a key inside objects: "rope_scaling.factor"; the file holds one such name)
    local v, last = j, k
    for part in k:gmatch("[^.]+") do
      v, last = type(v) == "table" and v[part] or nil, part
    end
    if type(v) == "number" and v == math.floor(v) and math.abs(v) < 2 ^ 53 then
      text = text:gsub('("' .. last .. '":)(%-?%d+)([,}])', "%1%2.0%3")
    end
  end
  return text
end

return M
