-- test_public.lua — the public surface (lua/luazero/public.lua) and its
-- page (docs/api.md) agree: every public name exists and is on the page;
-- every name the top-level package exports is public or marked internal;
-- the page's code and the example scripts require public modules only; and
-- every lua block of the page runs, as it is, in a folder of its own.
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local public = require("luazero.public")

local T = {}
local q = support.quote
local DOC = lz.root .. "/docs/api.md"
local page = assert(lz.read_file(DOC))
-- Modules outside luazero a script may require.
local OUTSIDE = { ffi = true, cjson = true, bit = true, jit = true }

local function blocks()
  local out = {}
  for code in page:gmatch("\n```lua\n(.-)\n```") do out[#out + 1] = code end
  return out
end

local function set(list)
  local s = {}
  for _, v in ipairs(list) do s[v] = true end
  return s
end

function T.every_public_name_exists_and_is_on_the_page()
  local n = 0
  for mod, names in pairs(public.modules) do
    local m = require(mod)
    assert(page:find(mod, 1, true), mod .. " is not on docs/api.md")
    for _, name in ipairs(names) do
      assert(m[name] ~= nil, ("%s.%s is public but does not exist"):format(mod, name))
      assert(page:find(name, 1, true), ("%s.%s is not on docs/api.md"):format(mod, name))
      n = n + 1
    end
  end
  local Engine = require("luazero.zero.engine").Engine
  local Module = require("luazero.nn.module")
  local objects = { engine = Engine, module = Module, tensor = lz.Tensor,
                    loader = require("luazero.data.stream").Loader }
  for kind, names in pairs(public.methods) do
    for _, name in ipairs(names) do
      local cls = objects[kind]
      assert(not cls or type(cls[name]) == "function",
             ("%s:%s is public but not a method"):format(kind, name))
      assert(page:find(name, 1, true), ("%s:%s is not on docs/api.md"):format(kind, name))
      n = n + 1
    end
  end
  assert(n > 80, "public names counted: " .. n)
end

function T.the_top_level_package_exports_public_or_marked_names()
  local known = set(public.modules["luazero"])
  for _, name in ipairs(public.internal) do
    assert(not known[name], name .. " is both public and internal")
    known[name] = true
  end
  local unmarked = {}
  for name in pairs(lz) do
    if not known[name] then unmarked[#unmarked + 1] = name end
  end
  table.sort(unmarked)
  assert(#unmarked == 0, "require('luazero') exports names neither public nor marked internal " ..
         "in lua/luazero/public.lua: " .. table.concat(unmarked, ", "))
end

function T.the_page_and_the_examples_require_public_modules_only()
  local texts = { { DOC, table.concat(blocks(), "\n") } }
  local p = io.popen("ls " .. q(lz.root .. "/scripts/examples") .. "/*.lua")
  for path in p:lines() do texts[#texts + 1] = { path, assert(lz.read_file(path)) } end
  p:close()
  assert(#texts >= 5, "the page and 4 examples")
  for _, t in ipairs(texts) do
    for mod in t[2]:gmatch("require%(?%s*[\"']([%w_.]+)[\"']") do
      assert(public.modules[mod] or OUTSIDE[mod],
             ("%s requires %s, which is not public (lua/luazero/public.lua)"):format(t[1], mod))
    end
  end
end

function T.every_lua_block_of_the_page_runs()
  local list = blocks()
  assert(#list >= 6, "lua blocks on docs/api.md: " .. #list)
  for i, code in ipairs(list) do
    local write, dir = support.scratch_corpus(support.HAMLET, 40)
    local script = write("block.lua", code)
    local out, st = support.sh(("cd %s && %s %s"):format(q(dir), q(lz.executable()), q(script)))
    assert(st == 0, ("docs/api.md's lua block %d failed:\n%s\n--- output:\n%s")
                    :format(i, code, out))
    os.execute("rm -rf " .. q(dir))
  end
end

return T
