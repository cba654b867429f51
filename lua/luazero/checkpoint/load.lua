-- checkpoint/load.lua — loading a checkpoint into a ZeRO engine at any world
-- size and stage: each rank finds where its own optimizer elements lie in
-- the saved shards (the manifest's runs), reads those shards forward once,
-- verifies them and fills its states through the engine's state contract
-- (engine:state_parts().shard.visit), then engine:restore_parts.
local ffi = require("ffi")
local lz = require("luazero")
local disk = require("luazero.checkpoint.disk")
local manifest_io = require("luazero.checkpoint.manifest")
local optimizers = require("luazero.optim.registry")
local formats = require("luazero.optim.formats")
local families = require("luazero.families")
local agree = require("luazero.checkpoint.agree").agree

local fail = disk.fail
local SB = disk.SB
local states_of = disk.states_of

local M = {}

-- Fields of every model's config that are the run's settings, not its
-- architecture: a resume may change them (the default learning rate and
-- batch, the name, the context of a model without a position table, the
-- initialisation's scale, the token ids generation starts and stops at).
-- A family adds its own (its run_fields: luazero/families.lua).
local RUN_FIELDS = { lr = true, micro_batch = true, name = true, context = true, std = true,
                     bos_id = true, eos_id = true }

-- The run's settings of a model of config cfg: every model's and its family's.
local function run_fields(cfg)
  local out = {}
  for k in pairs(RUN_FIELDS) do out[k] = true end
  for _, k in ipairs(families.run_fields(cfg.family)) do out[k] = true end
  return out
end

local function same_value(a, b)
  if type(a) == "number" and type(b) == "number" then
    return a == b or math.abs(a - b) <= 1e-12 * math.max(math.abs(a), math.abs(b))
  end
  return a == b
end

-- The first field of the architecture both configs have where they differ
-- (a table's entries one by one): key, saved value, this model's.
local function config_difference(saved, here)
  local keys, run = {}, run_fields(here)
  for k in pairs(saved) do
    if here[k] ~= nil and not run[k] then keys[#keys + 1] = k end
  end
  table.sort(keys)
  for _, k in ipairs(keys) do
    local a, b = saved[k], here[k]
    if type(a) == "table" and type(b) == "table" then
      for tk, tv in pairs(a) do
        if type(b[tk]) ~= "table" and type(b[tk]) ~= "function" and not same_value(tv, b[tk]) then
          return k .. "." .. tostring(tk), tv, b[tk]
        end
      end
    elseif type(a) ~= "table" and type(b) ~= "table" and type(b) ~= "function" and
           not same_value(a, b) then
      return k, a, b
    end
  end
end

-- The first tensor where the checkpoint's model and this one differ, or
-- the first field of its architecture (tensors of the same shapes in
-- another arrangement: heads, norms, rotary base, routing).
local function check_model(m, parts, dir)
  local here = parts.params
  local function shape(s) return "[" .. table.concat(s, ", ") .. "]" end
  local model_name = m.model and m.model.name or "see its manifest.json"
  local saved = type(m.model) == "table" and type(m.model.config) == "table" and m.model.config
  local cfg = parts.model and parts.model.cfg
  for i = 1, math.max(#here, #m.params) do
    local a, b = m.params[i], here[i]
    if not a or not b or a.name ~= b.name or shape(a.shape) ~= shape(b.shape) then
      -- (experts' adapters sit in another order under another moe.gather)
      local g = saved and saved.moe_gather
      local hint = g and cfg and cfg.moe_gather and g ~= cfg.moe_gather and
                   (', and the config\'s "moe": {"gather": "%s"}'):format(g) or ""
      fail("%s holds a different model: parameter %d is %s there but %s here; load it with " ..
           "the model flags it was saved with (%s)%s", dir, i,
           a and (a.name .. " " .. shape(a.shape)) or "absent",
           b and (b.name .. " " .. shape(b.shape)) or "absent", model_name, hint)
    end
  end
  if saved and type(cfg) == "table" then
    local key, a, b = config_difference(saved, cfg)
    if key then
      fail("%s holds a different model: its %s is %s, this model's %s; load it with the model " ..
           "flags it was saved with (%s)", dir, key, tostring(a), tostring(b), model_name)
    end
  end
end

-- Pieces {dst, shard, src, numel}: where each of this rank's optimizer
-- elements lies in the saved shards (shard: index into m.shards).
local function plan(m, runs)
  local saved = {}
  for i, s in ipairs(m.shards) do
    for _, r in ipairs(s.runs) do
      saved[#saved + 1] = { shard = i, offset = r[1], canonical = r[2], numel = r[3] }
    end
  end
  table.sort(saved, function(a, b) return a.canonical < b.canonical end)
  local pieces = {}
  for _, r in ipairs(runs) do
    -- the saved run holding r.canonical: binary search
    local lo, hi = 1, #saved
    while lo < hi do
      local mid = math.floor((lo + hi + 1) / 2)
      if saved[mid].canonical <= r.canonical then lo = mid else hi = mid - 1 end
    end
    local c, left, dst = r.canonical, r.numel, r.offset
    local i = lo
    while left > 0 do
      local s = saved[i]
      local a = c - s.canonical
      local n = math.min(left, s.numel - a)
      pieces[#pieces + 1] = { dst = dst, shard = s.shard, src = s.offset + a, numel = n }
      c, dst, left, i = c + n, dst + n, left - n, i + 1
    end
  end
  return pieces
end

-- The tensors an optimizer with block-scaled states keeps in f32 (under
-- its block_min_numel), by a manifest's record; and the param that sets it
-- (its declaration's small_below: AdamW8bit's min_8bit_size).
local function small_below(rec)
  local o = optimizers.new({ type = rec.type, params = rec.params,
                             state_formats = rec.state_formats, master_format = rec.master_format })
  return o.block_min_numel, o.small_below
end

-- Where this run keeps block-scaled states, a tensor the saving run kept in
-- f32 (under its threshold) and this one would quantise (at or above this
-- run's) would lose its moments' bits: refused, naming the setting. A
-- checkpoint converted into u8 by tools/ckpt convert-states (its record's
-- converted_from) holds f32 values for every tensor, for the loading run to
-- quantise as it keeps them. (The other way, a tensor quantised there and
-- kept in f32 here, keeps every bit.)
local function check_small(dir, m, rec, parts)
  local ours = parts.optimizer_record
  if not rec or rec.converted_from or not formats.block_of(ours.state_formats) then return end
  local was = small_below(rec)
  local now, key = small_below(ours)
  if not was or not now or was <= now then return end
  for _, p in ipairs(m.params) do
    if p.numel >= now and p.numel < was then
      fail("%s was saved keeping the optimizer states of tensors under %d elements in f32 " ..
           "(%s %d); this run's %d would quantise those of %s (%d elements): resume " ..
           "with optimizer.params.%s %d", dir, was, key, was, now, p.name, p.numel, key, was)
    end
  end
end

-- The checkpoint at path fits engine: the same model, and the same
-- optimizer's states and optimizer (the manifest's record, or an older
-- checkpoint's config). Every rank reads the same manifest, so a refusal here
-- is the input's, not one rank's. Returns the folder, the manifest and the
-- saved states' names.
function M.check(engine, path)
  local dir = disk.resolve(path)
  local m = disk.read_manifest(dir)
  local parts = engine:state_parts()
  check_model(m, parts, dir)
  local saved, want = states_of(m), parts.shard.states
  if table.concat(saved, ",") ~= table.concat(want, ",") then
    fail("%s holds the states %s; this run's optimizer %s keeps %s: resume with the optimizer " ..
         "that saved it", dir, table.concat(saved, ", "), parts.optimizer,
         table.concat(want, ", "))
  end
  local rec = manifest_io.optimizer_of(m)
  if rec and not parts.optimizer_accepts(rec.type) then
    -- (the same states in another format: the saving optimizer's
    -- converts_to names this run's)
    local class = optimizers.find(rec.type)
    local ours, hint = parts.optimizer_record.state_formats or {}, ""
    local _, mine = next(ours)
    for fmt, t in pairs(class and class.converts_to or {}) do
      if parts.optimizer_accepts(t) and mine == fmt then
        hint = (", or convert its states first (tools/ckpt convert-states %s OUT --to %s)")
               :format(dir, fmt)
      end
    end
    fail("%s was saved by the optimizer %s; this run's is %s: resume with the optimizer that " ..
         "saved it (optimizer.type %q)%s", dir, rec.type, parts.optimizer_record.type, rec.type,
         hint)
  end
  -- The states' formats (f32 where a record predates them) must be this
  -- run's: bytes of another format are not these numbers.
  local ours = parts.optimizer_record.state_formats or {}
  local theirs = rec and type(rec.state_formats) == "table" and rec.state_formats or {}
  for _, name in ipairs(want) do
    local a, b = theirs[name] or "f32", ours[name] or "f32"
    if a ~= b then
      fail("%s keeps the optimizer state %s in %s; this run keeps it in %s: convert it first " ..
           "(tools/ckpt convert-states %s OUT --to %s) or resume with the formats that saved it",
           dir, name, a, b, dir, b)
    end
  end
  check_small(dir, m, rec, parts)
  -- Frozen weights are not in a checkpoint: where they came from no file
  -- (drawn from the seed, or set by hand), their hash was recorded, and this
  -- engine's must be it. (Collective at stage 3: every rank checks.)
  if m.frozen_xxh64 and engine.frozen and #(engine.frozen.entries or {}) > 0 and
     not engine.init_path then
    local got = engine:frozen_checksum()
    if got ~= m.frozen_xxh64 then
      fail("%s was saved with frozen weights hashing to xxh64 %s, which it does not hold (only " ..
           "what trains is saved); this engine's hash to %s: make them as that run did (its " ..
           "seed, %s, or the weights it set) before loading", dir, m.frozen_xxh64, got,
           tostring(m.frozen_seed))
    end
  end
  -- The master weights' format likewise (bf16_stochastic_round keeps no
  -- fp32 master).
  local a, b = rec and rec.master_format or "f32", parts.optimizer_record.master_format or "f32"
  if a ~= b then
    fail("%s keeps its master weights in %s; this run keeps them in %s: convert it first " ..
         "(tools/ckpt convert-states %s OUT --master %s) or resume with the setting that saved " ..
         "it (optimizer.params.bf16_stochastic_round %s)", dir, a, b, dir, b, tostring(a == "bf16"))
  end
  return dir, m, saved, parts
end

-- Loads a checkpoint (a step folder, or a --save folder through latest) into
-- engine, whatever world size and stage it was saved at. Returns the
-- manifest (its `extra` holds what the trainer saved).
function M.load(engine, path)
  local dir, m, saved, parts = M.check(engine, path)
  local NSTATES = #saved
  local B = m.block_elems
  local layout = parts.shard.layout()
  local pieces = plan(m, layout.runs)
  -- Each needed shard: opened on first use, read forward once, verified
  -- and closed after its last piece.
  local last_use = {}
  for i, p in ipairs(pieces) do last_use[p.shard] = i end
  local open, bufs = {}, {}
  local pi = 1
  local ok, err = pcall(function()
    parts.shard.visit(true, function(off, ...)
      local views = { ... }
      local len = views[1]:numel()
      local dst = {}
      for s = 1, NSTATES do dst[s] = ffi.cast("char *", views[s].data) end
      -- Padding is in no piece: zero, as the engine keeps it.
      for s = 1, NSTATES do ffi.fill(dst[s], len * SB) end
      while pi <= #pieces and pieces[pi].dst < off + len do
        local p = pieces[pi]
        local a = math.max(p.dst, off) -- pieces may straddle chunks
        local b = math.min(p.dst + p.numel, off + len)
        local sh = open[p.shard]
        if not sh then
          sh = disk.open_shard(dir, m.shards[p.shard], B, NSTATES)
          open[p.shard] = sh
          bufs[p.shard] = lz.tensor({ NSTATES * B }, "f32", "workspace")
        end
        local buf = bufs[p.shard]
        local src = p.src + a - p.dst
        local pos = a
        while pos < b do
          local k = math.floor(src / B)
          if sh.block < k then sh:read_block(k, buf) end
          local blen = sh:block_len(k)
          local n = math.min(b - pos, (k + 1) * B - src)
          local base = ffi.cast("char *", buf.data)
          for s = 1, NSTATES do
            ffi.copy(dst[s] + (pos - off) * SB, base + ((s - 1) * blen + src - k * B) * SB, n * SB)
          end
          pos, src = pos + n, src + n
        end
        if b == p.dst + p.numel then
          if last_use[p.shard] == pi then
            sh:close(true)
            bufs[p.shard]:free()
            open[p.shard], bufs[p.shard] = false, nil
          end
          pi = pi + 1
        else
          break -- the rest of this piece is in the next chunk
        end
      end
    end)
    if pi <= #pieces then fail("%s: the engine's chunks did not cover its states", dir) end
  end)
  for i, sh in pairs(open) do
    if sh then pcall(sh.close, sh, false) end
    if bufs[i] then bufs[i]:free() end
  end
  agree(parts.comm, ok, err, "load of " .. dir)
  engine:restore_parts{
    steps = { optimizer = m.optimizer_steps, global = m.global_steps, skipped = m.skipped_steps },
    dtype = m.dtype, loss_scaler = m.loss_scaler,
    resumed_from = { dir = dir, step = m.global_steps },
  }
  if m.generators and parts.model.set_generator_states then
    parts.model:set_generator_states(m.generators)
  end
  m.dir = dir
  return m
end

return M
