-- checkpoint.lua — sharded, compressed, atomic checkpoints of the ZeRO
-- engine, loadable at any world size and stage; and a reading API for tools
-- and the REPL. docs/checkpoints.md describes the layout on disk.
--
--   engine:save(dir, extra, {zstd_level = 3, keep = 2})  -- dir/step-000020/, dir/latest
--   local manifest = engine:load(path)                  -- a step folder or a --save folder
--   local ck = checkpoint.open(path)                     -- reading without an engine
--   ck:summary(); ck:shard_table(); ck:norms(); ck:tensor("transformer.wte.weight")
--
-- The rooms: checkpoint/disk.lua (names, the step folder a path names, the
-- manifest against the shards, shard streaming), checkpoint/save.lua,
-- checkpoint/load.lua, checkpoint/reader.lua (without an engine),
-- checkpoint/agree.lua (ranks agreeing on an outcome),
-- checkpoint/manifest.lua (manifest.json).
local disk = require("luazero.checkpoint.disk")
local save = require("luazero.checkpoint.save")
local load = require("luazero.checkpoint.load")
local reader = require("luazero.checkpoint.reader")

local M = {}

M.BLOCK = disk.BLOCK
M.manifest = require("luazero.checkpoint.manifest")
M.step_name, M.shard_name = disk.step_name, disk.shard_name
M.resolve, M.read_manifest, M.stream_shard = disk.resolve, disk.read_manifest, disk.stream_shard
M.save, M.runs_of = save.save, save.runs_of
M.load = load.load
M.open, M.progress, M.CONSOLIDATED_MAGIC = reader.open, reader.progress, reader.CONSOLIDATED_MAGIC

return M
