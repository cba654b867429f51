-- io/paths.lua — every file a run touches, declared in one table before
-- anything is opened: what it reads, what it writes, with the flag or
-- config key that named each; one check refuses an output that is an
-- input, would replace a file an input is made of, or sits inside an
-- input folder the run reads whole (devices and inodes compared: hard
-- links and symlinks count as the same file). What a run writes then goes
-- through io/atomic.lua (whole files) or luazero/jsonl.lua (records).
--
--   local p = paths.new()
--   p:read("--data", flags.data)                     -- a file or folder read
--   p:read("--hf", flags.hf, { whole = true })       -- a folder whose files make one input
--   p:write("--log", flags.log)                      -- a file written (emptied or replaced)
--   p:write_in("--save", flags.save, { "^step%-%d+$", "^latest$" }, { ["--resume"] = true })
--   p:check()                                        -- error: one line naming both
--   p.entries                                        -- { role, what, path, ... } in order
local atomic = require("luazero.io.atomic")
local fs = require("luazero.io.fs")

local M = {}
local Paths = {}
Paths.__index = Paths

function M.new() return setmetatable({ entries = {} }, Paths) end

local function add(self, e)
  if e.path and e.path ~= "" then self.entries[#self.entries + 1] = e end
  return self
end

-- An input: `what` names it in messages (a flag, a config key). opts.whole:
-- a folder every file of which belongs to the input (a model folder), so
-- nothing may be written inside it.
function Paths:read(what, path, opts)
  return add(self, { role = "read", what = what, path = path, whole = opts and opts.whole })
end

-- An output file (emptied, replaced or appended to).
function Paths:write(what, path)
  return add(self, { role = "write", what = what, path = path })
end

-- An output folder: the run makes the names matching `names` (Lua patterns)
-- inside it. `holds`: the inputs (by what) it may hold, e.g. a --save
-- folder the run resumes from.
function Paths:write_in(what, path, names, holds)
  return add(self, { role = "write_in", what = what, path = path, names = names or {},
                     holds = holds or {} })
end

-- The first path component of `inner` below the folder `outer` (both real
-- paths), or nil when inner is not below outer.
local function below(inner, outer)
  if outer == "/" then outer = "" end
  if inner:sub(1, #outer + 1) ~= outer .. "/" then return nil end
  return inner:sub(#outer + 2):match("^[^/]+")
end

local function names_match(name, names)
  for _, pat in ipairs(names) do
    if name:match(pat) then return true end
  end
  return false
end

-- How the output `o` would destroy the input `i`: a phrase, or nil.
local function conflict(o, i)
  local ro, ri = atomic.real_path(o.path), atomic.real_path(i.path)
  if o.role == "write" then
    local how = atomic.overlap(o.path, i.path)
    if how then return how end
    if ro and ri and i.whole and below(ro, ri) then return "inside" end
    return nil
  end
  -- a folder written in: it replaces only the names it makes
  if o.holds[i.what] or not ro or not ri then return nil end
  if atomic.overlap(o.path, i.path) == "the same file as" then
    if not fs.is_dir(i.path) then return "the same file as" end
    return i.whole and "the same folder as" or nil
  end
  local first = below(ri, ro)
  if first and names_match(first, o.names) then return "the folder holding" end
  if i.whole and below(ro, ri) then return "inside" end
end

-- Refuses the first output that conflicts with an input: one line naming
-- both and the fix.
function Paths:check()
  for _, o in ipairs(self.entries) do
    if o.role ~= "read" then
      for _, i in ipairs(self.entries) do
        if i.role == "read" then
          local how = conflict(o, i)
          if how then
            error(("%s %s is %s %s %s; writing it would destroy that input: give another path")
                  :format(o.what, o.path, how, i.what, i.path), 0)
          end
        end
      end
    end
  end
  -- two outputs that are one file: one would overwrite the other
  for a, o in ipairs(self.entries) do
    for b, p in ipairs(self.entries) do
      local same = a < b and o.role == "write" and p.role == "write" and
                   atomic.overlap(o.path, p.path)
      local ro, rp = atomic.real_path(o.path), atomic.real_path(p.path)
      local first = o.role == "write" and p.role == "write_in" and ro and rp and below(ro, rp)
      if same or (first and names_match(first, p.names)) then
        error(("%s %s is %s %s %s; one would overwrite the other: give another path to one " ..
               "of them"):format(o.what, o.path, same and "the same file as" or "a name made by",
               p.what, p.path), 0)
      end
    end
  end
  return self
end

return M
