-- check_layers.lua — arrows point down only (run through tools/check-layers,
-- from the repository root).
--
-- The core's rooms, lowest first. A room may include from, and call into,
-- the rooms before it in this list, never the ones after it:
--   mem      tensors, storage, the ledger, dtype conversion, errors and
--            argument checks, the memory the job's ranks share, and the
--            backend slot (the device table, the op table, device copies,
--            streams and events): tensors and the ledger allocate through
--            the slot, so it sits here, below everything that fills it or
--            dispatches through it.
--   kernels  the public ops (checks, then the slot's op table) and the cpu
--            backend's kernels (lz_cpu_<name>).
--   optim    AdamW, Lion and the pass they share; also through the table.
--   io       swap files, checkpoint files, hashing.
--   devices  the backends that fill the slot: the cpu's table, lz_cuda_init
--            (loads libluazero_cuda.so) and the sim device, which runs the
--            cpu kernels on its own streams.
--   comm     the collectives and their backends (local, shm, mpi, nccl);
--            they read sim buffers through the sim device's host view.
--   launch   the launcher, which forks the ranks the collectives join.
-- core/luazero.h, the public header (with the core/luazero_*.h parts it
-- includes), stands outside the rooms: every room
-- may include it, and it includes no room.
--
-- Checks:
--   core files: every source under core/ lives in a named room;
--   core includes: every #include "..." under core/ names a header of its
--     own room or of a room below it, and the rooms' include graph has no
--     cycle;
--   core calls: where build objects exist (build/obj/release/luazero), no
--     object calls a function defined in a higher room (the public header
--     declares every function, so includes alone cannot show these);
--   lua requires: every require names its module in a string (a computed
--     one hides its arrow), and the require("...") graph of lua/ and
--     models/ has no cycle (a require inside a function, or through pcall,
--     counts too: it is still an arrow).
--   tools/check-layers --lua FILE...: the last two checks on these files only.
local ORDER = { "mem", "kernels", "optim", "io", "devices", "comm", "launch" }

local rank = {}
for i, room in ipairs(ORDER) do rank[room] = i end

local passed, failed = 0, 0
local function report(ok, what, problems)
  if ok then
    passed = passed + 1
    print("ok   " .. what)
  else
    failed = failed + 1
    print("FAIL " .. what)
    for _, p in ipairs(problems) do print("     " .. p) end
  end
end

local function lines_of(cmd)
  local out = {}
  local p = assert(io.popen(cmd))
  for line in p:lines() do out[#out + 1] = line end
  p:close()
  return out
end

local function read(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  return s
end

-- A cycle in graph (node -> set of nodes), as "a -> b -> a", or nil; each
-- cycle once, by its set of nodes.
local function cycles(graph)
  local found, seen_sets = {}, {}
  local state, stack = {}, {}
  local nodes = {}
  for n in pairs(graph) do nodes[#nodes + 1] = n end
  table.sort(nodes)
  local function visit(n)
    state[n] = "open"
    stack[#stack + 1] = n
    local next_nodes = {}
    for m in pairs(graph[n] or {}) do next_nodes[#next_nodes + 1] = m end
    table.sort(next_nodes)
    for _, m in ipairs(next_nodes) do
      if state[m] == "open" then
        local path, start = {}, nil
        for i = #stack, 1, -1 do
          if stack[i] == m then start = i break end
        end
        for i = start, #stack do path[#path + 1] = stack[i] end
        local key = {}
        for _, v in ipairs(path) do key[#key + 1] = v end
        table.sort(key)
        key = table.concat(key, " ")
        if not seen_sets[key] then
          seen_sets[key] = true
          path[#path + 1] = m
          found[#found + 1] = table.concat(path, " -> ")
        end
      elseif not state[m] then
        visit(m)
      end
    end
    stack[#stack] = nil
    state[n] = "done"
  end
  for _, n in ipairs(nodes) do
    if not state[n] then visit(n) end
  end
  return found
end

------------------------------------------------------------ require graph

-- A module's file: luazero.x.y is lua/luazero/x/y.lua (or .../y/init.lua),
-- models.x is models/x.lua. Modules outside the tree (ffi, cjson) are left out.
local function module_file(name)
  local rel = name:gsub("%.", "/")
  for _, dir in ipairs({ "lua/", "" }) do
    for _, candidate in ipairs({ dir .. rel .. ".lua", dir .. rel .. "/init.lua" }) do
      if read(candidate) then return candidate end
    end
  end
  return nil
end

-- The require graph of the Lua files `paths`: a module's name is its path
-- with lua/ and .lua dropped and / as dots. Every require counts, at the top
-- of a file or inside a function (a lazy require is still an arrow), and so
-- does pcall(require, "name"); a require whose name is computed
-- (require("luazero.zero." .. part), require(name)) hides its arrow, so it
-- is a problem of its own: name the module in a string.
-- Returns graph, number of requires, problems.
local function require_graph(paths)
  local module_of = {}
  for _, path in ipairs(paths) do
    local name = path:gsub("^lua/", ""):gsub("/init%.lua$", ""):gsub("%.lua$", ""):gsub("/", ".")
    module_of[path] = name
  end
  local graph, n, computed = {}, 0, {}
  for _, path in ipairs(paths) do
    local from = module_of[path]
    graph[from] = graph[from] or {}
    local line_no = 0
    for line in ((read(path) or "") .. "\n"):gmatch("([^\n]*)\n") do
      line_no = line_no + 1
      local code = line:gsub("%-%-.*$", ""):gsub('"[^"]*"', function(str)
        -- a string's own words are not code, but a require's name is
        return str:find("^\"[%w_%.]+\"$") and str or '""'
      end)
      local pos = 1
      while true do
        local s, e = code:find("%f[%w_]require%f[^%w_]", pos)
        if not s then break end
        pos = e + 1
        local rest, before = code:sub(e + 1), code:sub(1, s - 1)
        local name = rest:match("^%s*%(%s*[\"']([%w_%.]+)[\"']%s*%)")
                     or rest:match("^%s*[\"']([%w_%.]+)[\"']")
        if not name and before:match("pcall%s*%(%s*$") then
          name = rest:match("^%s*,%s*[\"']([%w_%.]+)[\"']%s*%)")
        end
        if name then
          local file = module_file(name)
          if file and module_of[file] and module_of[file] ~= from then
            n = n + 1
            graph[from][module_of[file]] = true
          end
        else
          computed[#computed + 1] = ("%s:%d: a computed require (%s); require each module by its name in a string")
                                    :format(path, line_no, (line:gsub("^%s+", "")))
        end
      end
    end
  end
  return graph, n, computed
end

-- tools/check-layers --lua FILE...: only the require graph of these files
-- (a test shows it on modules of its own).
if arg and arg[1] == "--lua" then
  local paths = {}
  for i = 2, #arg do paths[#paths + 1] = arg[i] end
  local graph, n, computed = require_graph(paths)
  report(#computed == 0, "lua requires: every require names its module", computed)
  local found = cycles(graph)
  report(#found == 0, ("lua requires: no cycle among %d modules (%d requires)"):format(#paths, n),
         found)
  print(("%d passed, %d failed"):format(passed, failed))
  os.exit(failed == 0 and 0 or 1)
end

---------------------------------------------------------------- core files

local files = lines_of("find core -type f \\( -name '*.c' -o -name '*.h' \\) | sort")
local room_of = {} -- path -> room
local problems = {}
for _, path in ipairs(files) do
  local room = path:match("^core/([^/]+)/[^/]+$")
  if path == "core/luazero.h" or path:match("^core/luazero_[%w_]+%.h$") then
    room_of[path] = "public" -- (luazero.h and the parts it includes)
  elseif room and rank[room] then
    room_of[path] = room
  else
    problems[#problems + 1] = path .. ": not in a room; move it under core/<room>/ (rooms: "
      .. table.concat(ORDER, ", ") .. ")"
  end
end
report(#problems == 0, ("core files: %d files, each in one of %d rooms"):format(#files, #ORDER),
       problems)

------------------------------------------------------------- core includes

problems = {}
local room_graph = {}
for _, room in ipairs(ORDER) do room_graph[room] = {} end
local n_includes = 0
for _, path in ipairs(files) do
  local room = room_of[path]
  local text = read(path) or ""
  local line_no = 0
  for line in (text .. "\n"):gmatch("([^\n]*)\n") do
    line_no = line_no + 1
    local name = line:match('^%s*#%s*include%s*"([^"]+)"')
    if name and room then
      n_includes = n_includes + 1
      local where = ("%s:%d: #include \"%s\""):format(path, line_no, name)
      local target
      if name == "luazero.h" or (room == "public" and name:match("^luazero_[%w_]+%.h$")) then
        target = "public"
      elseif name:match("^[^/]+/[^/]+$") and read("core/" .. name) then
        target = name:match("^([^/]+)/")
      elseif not name:find("/") and read(path:gsub("[^/]+$", "") .. name) then
        target = room -- a header beside the file
      else
        problems[#problems + 1] = where .. ": not found; name a core header as \"room/file.h\""
      end
      if target and target ~= "public" then
        if room == "public" then
          problems[#problems + 1] = where .. ": the public header includes no room"
        elseif not rank[target] then
          problems[#problems + 1] = where .. ": " .. target .. " is not a room"
        elseif rank[target] > rank[room] then
          problems[#problems + 1] = ("%s: %s includes from %s, a room above it (order: %s)"):format(
            where, room, target, table.concat(ORDER, " < "))
        end
        if rank[target] and room ~= "public" and target ~= room then
          room_graph[room][target] = true
        end
      end
    end
  end
end
report(#problems == 0, ("core includes: %d includes point down (%s)"):format(
  n_includes, table.concat(ORDER, " < ")), problems)

local room_cycles = cycles(room_graph)
report(#room_cycles == 0, "core includes: no cycle among rooms", room_cycles)

---------------------------------------------------------------- core calls

-- Which room defines each global function of libluazero, and which ones each
-- object calls: nm on the release objects (their names are the sources'
-- base names, unique across rooms).
local obj_dir = "build/obj/release/luazero"
local base_room = {}
for path, room in pairs(room_of) do
  local base = path:match("([^/]+)%.c$")
  if base and room ~= "public" then base_room[base] = room end
end
local objects = lines_of("ls " .. obj_dir .. "/*.o 2>/dev/null")
local have_nm = #lines_of("command -v nm") > 0
if #objects == 0 or not have_nm then
  print("skip core calls: no objects in " .. obj_dir .. " (build first) or no nm")
else
  problems = {}
  local defined_in, uses, stale = {}, {}, {}
  for _, obj in ipairs(objects) do
    local base = obj:match("([^/]+)%.o$")
    local room = base_room[base]
    uses[base] = room and {} or nil
    for _, l in ipairs(room and lines_of("nm " .. obj) or {}) do
      local kind, sym = l:match("^%x*%s+(%a)%s+([%w_]+)$")
      if kind == "U" then
        uses[base][#uses[base] + 1] = sym
      elseif kind and kind:match("[TDBR]") and room then
        defined_in[sym] = { room = room, base = base }
      end
    end
    if not room then stale[#stale + 1] = obj end
  end
  local n_calls = 0
  local bases = {}
  for base in pairs(uses) do bases[#bases + 1] = base end
  table.sort(bases)
  for _, base in ipairs(bases) do
    local room = base_room[base]
    for _, sym in ipairs(uses[base]) do
      local def = defined_in[sym]
      if def and room and def.base ~= base then
        n_calls = n_calls + 1
        if rank[def.room] > rank[room] then
          problems[#problems + 1] = ("%s/%s.c calls %s of %s/%s.c, a room above it"):format(
            room, base, sym, def.room, def.base)
        end
      end
    end
  end
  -- An object whose source has gone (make leaves it behind) is not read.
  if #stale > 0 then
    print("note core calls: left out, no source of that name: " .. table.concat(stale, " "))
  end
  report(#problems == 0, ("core calls: %d calls between %d objects point down"):format(
    n_calls, #objects - #stale), problems)
end

-------------------------------------------------------------- lua requires

local lua_files = lines_of("find lua models -name '*.lua' 2>/dev/null | sort")
local req_graph, n_requires, computed = require_graph(lua_files)
report(#computed == 0, "lua requires: every require names its module", computed)
local lua_cycles = cycles(req_graph)
report(#lua_cycles == 0, ("lua requires: no cycle among %d modules (%d requires)"):format(
  #lua_files, n_requires), lua_cycles)

print(("%d passed, %d failed"):format(passed, failed))
os.exit(failed == 0 and 0 or 1)
