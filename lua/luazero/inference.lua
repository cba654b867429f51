-- inference.lua — a model with trained weights, for generation and
-- evaluation (scripts/generate.lua, scripts/eval.lua), from:
--   load      a luazero checkpoint: a step folder, or a --save folder (its
--             latest); a LoRA run's brings its base from the run's --init.
--             Or a consolidated file (tools/ckpt consolidate), the model
--             named by model / model_config
--   hf        a Hugging Face folder (config.json, *.safetensors), as
--             scripts/train.lua --init reads it
--   adapters  with hf: PEFT adapters (adapter_config.json,
--             adapter_model.safetensors), as tools/ckpt export writes them
-- The weights sit in a one-rank ZeRO stage 0 engine, loaded the way
-- training loads them (hf.load_into, engine:load), and the model computes
-- in the engine's dtype: a checkpoint's own (the one its validation loss
-- was measured in) unless one is given. The caller gives the model
-- families (this layer does not reach up to models/): models.registry and
-- models.lora.
--
--   local inference = require("luazero.inference")
--   local w = inference.open({ models = require("models.registry"), lora = require("models.lora"),
--                              load = "runs/ck", micro_batch = 8, seq_len = 256 })
--   w.model:forward(tokens, targets) ... w:free()
local ffi = require("ffi")
local cjson = require("cjson")
local lz = require("luazero")
local config = require("luazero.config")
local hf = require("luazero.hf")
local zero = require("luazero.zero")
local optimizers = require("luazero.optim.registry")
local manifest_io = require("luazero.checkpoint.manifest")
local LoraExperts = require("luazero.nn.lora_experts")

local M = {}

local function fail(fmt, ...) error(fmt:format(...), 0) end

local function exists(path)
  local f = io.open(path, "rb")
  if f then f:close() end
  return f ~= nil
end

-- The model config a checkpoint was saved with: a named size with the
-- overrides scripts/train.lua takes, else (a --model-config or --init
-- run's) its config.json form read back.
local function config_of_manifest(models, m, dir)
  local saved = m.model and m.model.config
  if type(saved) ~= "table" or not saved.family then
    fail("--load %s: its manifest.json holds no model config; load a checkpoint saved by " ..
         "scripts/train.lua", dir)
  end
  if saved.name and models.family_of(saved.name) then
    return models.config(saved.name, { n_layer = saved.n_layer, n_head = saved.n_head,
                                       n_embd = saved.n_embd, context = saved.context,
                                       vocab = saved.vocab })
  end
  local tmp = os.tmpname()
  local ok, cfg = pcall(function()
    require("luazero.io.atomic").write(tmp, hf.config_json_text(saved, "fp32"))
    return hf.model_config(models, tmp, {})
  end)
  os.remove(tmp)
  if not ok then error(cfg, 0) end
  cfg.name = saved.name or cfg.name
  return cfg
end

local function targets_list(t)
  if type(t) == "table" then return t end
  local out = {}
  for n in tostring(t or ""):gmatch("[^,%s]+") do out[#out + 1] = n end
  return out
end

-- The optimizer block of the run that saved m (engine:load takes a
-- checkpoint into an engine with that optimizer only): its manifest's
-- record, else (an older checkpoint) its config's.
local function optimizer_of_manifest(m, path)
  local rec = manifest_io.optimizer_of(m)
  if not rec then
    fail("--load %s: its manifest records no optimizer (a checkpoint saved without a config); " ..
         "consolidate it (tools/ckpt consolidate %s OUT.bin) and --load OUT.bin with --model or " ..
         "--model-config", path, path)
  end
  optimizers.of_record(rec, "--load " .. path)
  return { type = rec.type, params = rec.params }
end

-- A one-rank stage 0 engine over model; optimizer: the block of the run
-- that saved the checkpoint loaded into it (nil: the default).
local function engine_for(model, dtype, batch, optimizer, seed, draw)
  local cfg = config.load({ optimizer = optimizer }, 1,
                          { stage = 0, dtype = dtype, micro_batch = batch[1], grad_accum = 1 })
  return zero.initialize({ model = model, config = cfg, seed = seed or 0, batch = batch,
                           lr = function() return 0 end, comm = require("luazero.comm").init(),
                           device = "cpu", draw_weights = draw ~= nil })
end

-- Canonical elements from a source into the engine's master: read(c, n,
-- dst) fills dst with canonical elements c .. c + n - 1.
local function fill_master(engine, read)
  local runs = engine:state_layout().runs
  engine:visit_states(true, function(off, master)
    local len = master:numel()
    local dst = ffi.cast("float *", master.data)
    for _, r in ipairs(runs) do
      local a, b = math.max(r.offset, off), math.min(r.offset + r.numel, off + len)
      if b > a then read(r.canonical + a - r.offset, b - a, dst + (a - off)) end
    end
  end)
  engine:after_load()
end

local CONSOLIDATED_MAGIC = 20240521

-- A consolidated file's header, checked against the model.
local function consolidated(path, model)
  local f, why = io.open(path, "rb")
  if not f then fail("--load %s: cannot read it (%s)", path, tostring(why)) end
  local raw = f:read(1024)
  local h = raw and #raw == 1024 and ffi.cast("const int32_t *", raw)
  if not h or h[0] ~= CONSOLIDATED_MAGIC then
    f:close()
    fail("--load %s: not a checkpoint folder nor a consolidated file (magic %d); give a step " ..
         "folder, a --save folder or tools/ckpt consolidate's output", path, CONSOLIDATED_MAGIC)
  end
  local numel = tonumber(ffi.cast("const uint32_t *", raw)[3]) + h[4] * 2 ^ 32
  local _, n = model:trainable_table()
  if h[2] ~= #model.param_table or numel ~= n then
    f:close()
    fail("--load %s holds %d tensors, %d elements; this model (%s) has %d tensors, %d " ..
         "elements: give the --model / --model-config it was trained as", path, h[2], numel,
         tostring(model.cfg.name), #model.param_table, n)
  end
  return f
end

-- PEFT adapters into the engine's master (the trainable parameters are the
-- adapters alone), then the working copy derived from it.
local function load_adapters(engine, dir)
  local path = dir .. "/adapter_model.safetensors"
  local fs = require("luazero.io.fs")
  if not fs.exists(path) and fs.exists(dir .. "/adapter_model.bin") then
    fail("--adapters %s holds adapter_model.bin (PyTorch's pickle), which luazero does not read: " ..
         "save the adapters as safetensors (PEFT's save_pretrained, whose default it is)", dir)
  end
  local st = require("luazero.checkpoint.safetensors").open(path)
  local ok, err = pcall(function()
    local by_name = {}
    for _, n in ipairs(st.names) do
      by_name[(n:gsub("^base_model%.model%.", ""))] = st.tensors[n]
    end
    local params = engine.ptable
    -- The experts' adapters: each a slice of PEFT's fused tensor of its block.
    local experts = LoraExperts.peft_names(params,
                                           hf.family(engine.model.cfg).description.lora_peft_paths)
    for _, p in ipairs(params) do
      local v = experts[p.name]
      local key = v and v.key or p.name
      local t = by_name[key]
      if not t then
        fail("--adapters %s: tensor %s is missing from adapter_model.safetensors; give the " ..
             "adapters made for this base and adapter_config.json", dir, key)
      end
      local want = v and v.E * p.numel or p.numel
      if t.numel ~= want then
        fail("--adapters %s: tensor %s has %d elements, this model's has %d (r or targets " ..
             "differ?)", dir, key, t.numel, want)
      end
    end
    local whole = {} -- fused tensors read once
    fill_master(engine, function(c, n, dst)
      while n > 0 do
        local p
        for _, e in ipairs(params) do
          if c >= e.offset and c < e.offset + e.numel then p = e; break end
        end
        local k = math.min(n, p.offset + p.numel - c)
        local v = experts[p.name]
        if v then
          local t = by_name[v.key]
          local all = whole[v.key]
          if not all then
            all = ffi.new("float[?]", t.numel)
            st:read(t, 0, t.numel, all)
            whole[v.key] = all
          end
          for j = 0, k - 1 do
            dst[j] = all[LoraExperts.fused_index(v, p.shape, c - p.offset + j)]
          end
        else
          st:read(by_name[p.name], c - p.offset, k, dst)
        end
        c, n, dst = c + k, n - k, dst + k
      end
    end)
  end)
  st:close()
  if not ok then error(err, 0) end
end

-- opts: models, lora (above), load | hf (one of them), adapters (with hf),
-- model / model_config (with a consolidated file: a named size or a
-- config.json), dtype ("fp32", "bf16"; default: a checkpoint's own, else
-- fp32), micro_batch and seq_len (the largest batch it runs: default 1 x
-- the model's context), seed. Returns { model, engine, cfg (the model
-- config), manifest (with load), dir (a Hugging Face folder for the
-- tokenizer: hf's, or a checkpoint's --init), free }.
function M.open(opts)
  local models = assert(opts.models, "inference.open: opts.models (models.registry) is required")
  if (opts.load ~= nil) == (opts.hf ~= nil) then
    fail("give --load DIR (a luazero checkpoint) or --hf DIR (a Hugging Face folder), one of them")
  end
  if opts.adapters and not opts.hf then
    fail("--adapters %s goes with --hf BASE (the base model the adapters were trained on); a " ..
         "LoRA checkpoint given to --load brings its own", opts.adapters)
  end
  local w = { dir = opts.hf }
  local dtype, lora, init, optimizer, draw_seed = opts.dtype, nil, nil, nil, nil
  if opts.load and not exists(opts.load) then
    fail("--load %s: no such file or folder; give a checkpoint (a --save folder, one of its " ..
         "step-NNNNNN folders) or a file from tools/ckpt consolidate", opts.load)
  end
  local file = opts.load and not require("luazero.io.fs").is_dir(opts.load) and opts.load
  if file then
    if not opts.model and not opts.model_config then
      fail("--load %s is a file: a consolidated file says no model; add --model NAME or " ..
           "--model-config config.json", file)
    end
    w.cfg = opts.model_config and hf.model_config(models, opts.model_config, {}) or
            models.config(opts.model, {})
  elseif opts.load then
    local checkpoint = require("luazero.checkpoint")
    local dir = checkpoint.resolve(opts.load)
    local m = checkpoint.read_manifest(dir)
    w.manifest, w.cfg = m, config_of_manifest(models, m, opts.load)
    dtype = dtype or m.dtype
    optimizer = optimizer_of_manifest(m, opts.load)
    if m.lora and not m.init then
      -- a LoRA run without --init adapted weights drawn from its seed
      lora, draw_seed = m.lora, type(m.extra) == "table" and tonumber(m.extra.seed)
      if not draw_seed then
        fail("--load %s: a LoRA checkpoint that records neither its base (--init) nor its " ..
             "seed", opts.load)
      end
    elseif m.lora then
      lora, init = m.lora, m.init
      if not exists(init) then
        fail("--load %s: a LoRA checkpoint whose base weights (%s) are not there; give the " ..
             "folder it was trained from there, or export merged weights with tools/ckpt " ..
             "export --merge-lora", opts.load, tostring(init))
      end
      w.dir = init
    elseif type(m.init) == "string" and require("luazero.io.fs").is_dir(m.init) then
      -- a full fine-tune of a Hugging Face folder: its tokenizer is the folder's
      w.dir = m.init
    end
  else
    local cfg_path = hf.config_path(opts.hf)
    if not cfg_path then
      fail("--hf %s: no config.json there; give a Hugging Face model folder", opts.hf)
    end
    w.cfg = hf.model_config(models, cfg_path, {})
    init = opts.hf
    if opts.adapters then
      local ok, a = pcall(require("luazero.adapter_config").read,
                          opts.adapters .. "/adapter_config.json")
      if not ok then
        -- (a luazero checkpoint given for PEFT's folder: where it goes instead)
        local fs = require("luazero.io.fs")
        local ours = fs.exists(opts.adapters .. "/manifest.json") or
                     fs.exists(opts.adapters .. "/latest")
        fail("--adapters %s%s", tostring(a), ours and ("; %s is a luazero checkpoint: give it " ..
             "to --load (it brings its base), or export its adapters first (tools/ckpt export " ..
             "%s DIR)"):format(opts.adapters, opts.adapters) or "")
      end
      lora = a
    end
  end
  dtype = dtype or "fp32"
  local model = models.new(w.cfg)
  if lora then
    assert(opts.lora, "inference.open: opts.lora (models.lora) is required for adapters")
    local ok, err = pcall(opts.lora.apply, model, { r = lora.r, alpha = lora.alpha,
      targets = targets_list(lora.targets), rslora = lora.rslora, rank_of = lora.rank_of,
      alpha_of = lora.alpha_of })
    if not ok then
      -- (the targets are the adapters' or the checkpoint's, not a flag of this script)
      local what = opts.adapters and ("--adapters %s: its adapter_config.json's target_modules")
                                     :format(opts.adapters)
                   or ("--load %s: the LoRA targets it was trained with"):format(opts.load)
      fail("%s do not fit this model: %s; give the base model the adapters were trained on",
           what, (tostring(err):gsub(" %(%-%-lora%-targets%)", "")))
    end
  end
  if opts.hf and not lora then
    -- Nothing trains here: frozen weights take no optimizer states (a
    -- quarter of the memory in fp32). The engine wants one parameter that
    -- trains: the smallest keeps that role (it never takes a step), one
    -- of a module whose parameters may freeze apart (not a packed q|k|v).
    local keep
    for _, e in ipairs(model.param_table) do
      if not e.module.freeze_as_one and (not keep or e.numel < keep.numel) then keep = e end
    end
    model:freeze(function(name) return name ~= keep.name end)
  end
  if init then hf.check(init, model) end
  local T = opts.seq_len or w.cfg.context
  if T > w.cfg.context then
    fail("--seq-len %d is longer than the model's context %d", T, w.cfg.context)
  end
  local batch = { opts.micro_batch or 1, T }
  local engine = engine_for(model, dtype, batch, optimizer, draw_seed or opts.seed, draw_seed)
  w.model, w.engine, w.dtype = model, engine, dtype
  if init then hf.load_into(engine, init) end
  if file then
    local f = consolidated(file, model)
    local ok, err = pcall(fill_master, engine, function(c, n, dst)
      f:seek("set", 1024 + 4 * c)
      local bytes = f:read(4 * n)
      if not bytes or #bytes ~= 4 * n then fail("--load %s: cut short", file) end
      ffi.copy(dst, bytes, 4 * n)
    end)
    f:close()
    if not ok then error(err, 0) end
  elseif opts.load then
    engine:load(opts.load)
  end
  if opts.adapters then load_adapters(engine, opts.adapters) end
  function w.free()
    engine:free()
  end
  return w
end

return M
