-- monitor/csv.lua — DeepSpeed's csv_monitor layout: one CSV per tag in the
-- job's folder, named after the tag with "/" and " " turned into "_"
-- (Train/Samples/lr -> Train_Samples_lr.csv), its header "step,<the tag's
-- last part>", then one "step,value" row per step, appended when the step
-- ends (luazero/jsonl.lua). A file that exists already (a resumed run) is
-- continued, with no second header.
--
--   local c = csv.open("runs/job")
--   c:scalars(step, { { "Train/Samples/lr", 1e-3 }, ... })
--   c:close()
local jsonl = require("luazero.jsonl")
local decimal = require("luazero.io.decimal")

local M = {}
local Csv = {}
Csv.__index = Csv

function M.open(dir) return setmetatable({ dir = dir, files = {} }, Csv) end

function M.file_name(tag) return (tag:gsub("[/ ]", "_")) .. ".csv" end

-- The shortest decimal that reads back as v (Python's repr, which
-- DeepSpeed's csv.writer writes).
function M.number(v)
  if v ~= v then return "nan" end
  if v == math.huge or v == -math.huge then return v > 0 and "inf" or "-inf" end
  return decimal.shortest(v)
end

function Csv:file(tag)
  local f = self.files[tag]
  if f then return f end
  local path = self.dir .. "/" .. M.file_name(tag)
  local err
  f, err = jsonl.open(path, { append = true })
  if not f then return nil, ("%s: %s"):format(path, err) end
  if f.size == 0 then
    local ok, werr = f:write(("step,%s\n"):format(tag:match("([^/]*)$")))
    if not ok then
      f:discard()
      return nil, ("%s: %s"):format(path, werr)
    end
  end
  self.files[tag] = f
  return f
end

-- scalars: { {tag, value}, ... } of one step. true, or nil and the reason.
function Csv:scalars(step, scalars)
  for _, sv in ipairs(scalars) do
    local f, err = self:file(sv[1])
    if not f then return nil, err end
    local ok, werr = f:write(("%d,%s\n"):format(step, M.number(sv[2])))
    if not ok then return nil, ("%s: %s"):format(f.path, werr) end
  end
  return true
end

-- A run that continues (a resume, a restart) from `step` on: each of the
-- files of `tags` keeps its header and the rows before that step, so the
-- steps trained again are not there twice. true, or nil and the reason.
function Csv:purge_from(step, tags)
  local atomic = require("luazero.io.atomic")
  for _, tag in ipairs(tags) do
    local path = self.dir .. "/" .. M.file_name(tag)
    local f = io.open(path, "rb")
    if f then
      local keep, dropped = {}, false
      for line in f:lines() do
        local s = tonumber(line:match("^(%d+),"))
        if s and s >= step then dropped = true else keep[#keep + 1] = line .. "\n" end
      end
      f:close()
      if dropped then
        local ok, err = pcall(atomic.write, path, table.concat(keep))
        if not ok then return nil, tostring(err) end
      end
    end
  end
  return true
end

function Csv:close()
  for _, f in pairs(self.files) do f:close() end
  self.files = {}
end

return M
