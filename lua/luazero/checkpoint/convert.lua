-- checkpoint/convert.lua — a checkpoint's optimizer states kept in other
-- formats (tools/ckpt convert-states): a copy of the step folder whose
-- manifest records the new formats. A checkpoint holds every state in fp32
-- whatever its format (the values of a bf16 state are exactly bf16, those
-- of a u8 one the values its 8-bit code stands for), so bf16 or u8 -> f32
-- changes no number, f32 -> bf16 rounds each value to nearest even when the
-- run loads it, as the run rounds its moments after each step, and -> u8
-- quantises each block as the 8-bit update does. Where the optimizer that
-- saved it keeps no states in the new format, the record names the one
-- its declaration's converts_to gives (AdamW8bit <-> AdamW), with the
-- hyperparameters both have and the new one's defaults for the rest.
--
--   local convert = require("luazero.checkpoint.convert")
--   convert.states("ck/step-000020", "ck16/step-000020", "bf16")
local disk = require("luazero.checkpoint.disk")
local manifest_io = require("luazero.checkpoint.manifest")
local atomic = require("luazero.io.atomic")
local fs = require("luazero.io.fs")
local formats = require("luazero.optim.formats")
local optimizers = require("luazero.optim.registry")

local M = {}

local fail = disk.fail

-- The formats a manifest records for each of its states (f32 where it
-- predates them).
function M.formats_of(m)
  local rec = manifest_io.optimizer_of(m)
  local saved = rec and type(rec.state_formats) == "table" and rec.state_formats or {}
  local out = {}
  for _, name in ipairs(disk.states_of(m)) do
    if name ~= "master" then out[name] = saved[name] or formats.default end
  end
  return out
end

-- The optimizer type and params a record becomes with its states in
-- format `to` (dir: the checkpoint, for errors).
local function converted(rec, to, dir)
  local class = optimizers.of_record(rec, dir)
  local function keeps(c)
    for _, f in ipairs(c.keeps) do if f == to then return true end end
    return false
  end
  if keeps(class) then return rec.type, rec.params end
  local target, spelling = optimizers.find(class.converts_to and class.converts_to[to])
  if not target or not keeps(target) then
    fail("convert-states: the optimizer %s keeps its states in %s, not %s, and names no " ..
         "optimizer that keeps them in %s: no run could resume the copy", class.name,
         table.concat(class.keeps, " or "), to, to)
  end
  local params = {}
  for k, v in pairs(target.defaults) do
    local saved = type(rec.params) == "table" and rec.params[k]
    if saved ~= nil then params[k] = saved else params[k] = v end
  end
  return spelling, params
end

-- Writes out (a new step folder) as the checkpoint at path with every
-- optimizer state in format `to` (f32 or bf16; nil: as saved) and the
-- master weights in `master` (f32 or bf16; nil: as saved); to u8 (or from
-- it) the record may name another optimizer (converted above). The master too
-- is held in fp32 whatever its format: bf16 -> f32 changes no number, f32
-- -> bf16 rounds to nearest even as the run loads it. Returns a one-line
-- summary.
function M.states(path, out, to, master)
  if to == nil and master == nil then
    fail("convert-states: give --to %s (the states) or --master f32|bf16 (the master weights)",
         table.concat(formats.names, "|"))
  end
  local f = to and formats.by_name[to]
  if to and not f then
    fail("convert-states: --to must be %s (got %s)", table.concat(formats.names, ", "), tostring(to))
  end
  local mf = master and formats.by_name[master]
  if master and not (mf and mf.master) then
    fail("convert-states: --master must be f32 or bf16 (got %s)", tostring(master))
  end
  local dir = disk.resolve(path)
  if fs.exists(out) then
    fail("convert-states: %s exists; give a new folder (convert-states never replaces a " ..
         "checkpoint)", out)
  end
  local m = disk.read_manifest(dir)
  local rec = manifest_io.optimizer_of(m)
  if not rec then
    fail("convert-states: %s records no optimizer (saved without a config); its states' " ..
         "formats are unknown", dir)
  end
  if master == "bf16" and rec.master_format ~= "bf16" then
    local class = optimizers.of_record(rec, dir)
    if not (class.accepted and class.accepted.bf16_stochastic_round) then
      fail("convert-states: the optimizer %s keeps no bf16 master weights (it has no " ..
           "bf16_stochastic_round): no run could resume the copy", class.name)
    end
  end
  local from = M.formats_of(m)
  local names, was = {}, {}
  for name, fmt in pairs(from) do names[#names + 1] = name; was[#was + 1] = name .. " " .. fmt end
  table.sort(names)
  table.sort(was)
  local type_name, params = rec.type, rec.params
  if to then type_name, params = converted(rec, to, dir) end
  -- converted_from: states brought into a block-scaled format from another
  -- hold f32 values in every tensor, which the loading run quantises where
  -- it keeps them so (checkpoint/load.lua's check_small: whatever its
  -- min_8bit_size); what a run saved records no such thing.
  local converted_from = rec.converted_from
  if to then
    converted_from = nil
    for _, name in ipairs(names) do
      if f.block and not formats.by_name[from[name]].block then converted_from = from[name] end
    end
  end
  m.optimizer = { type = type_name, params = params, state_formats = {},
                  master_format = rec.master_format, converted_from = converted_from }
  for _, name in ipairs(names) do m.optimizer.state_formats[name] = to or from[name] end
  local said = {}
  if to then said[#said + 1] = ("the optimizer states (%s) now in %s"):format(table.concat(was, ", "), to) end
  if type_name ~= rec.type then
    said[#said + 1] = ("the optimizer now %s (resume with optimizer.type %q)"):format(type_name,
                                                                                   type_name)
  end
  if master then
    -- (f32 is the default: not recorded)
    m.optimizer.master_format = master ~= "f32" and master or nil
    said[#said + 1] = ("the master weights (%s) now in %s"):format(rec.master_format or "f32", master)
  end
  m.manifest_xxh64 = nil
  local owned = { "manifest.json" }
  for _, s in ipairs(m.shards) do owned[#owned + 1] = s.file end
  atomic.build_folder(out, owned, function(folder)
    for _, s in ipairs(m.shards) do atomic.copy(dir .. "/" .. s.file, folder.tmp .. "/" .. s.file) end
    atomic.write(folder.tmp .. "/manifest.json", manifest_io.encode(m))
  end)
  return ("%s: %s"):format(out, table.concat(said, "; "))
end

return M
