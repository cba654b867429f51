-- sweep.lua — hyperparameter sweeps over scripts/train.lua (or another
-- script taking --flags): expand a sweep file into runs, run each as its own
-- job through the launcher (up to K at once, cores shared), record every
-- run's status, and summarise in results.csv, results.md and loss.png.
-- docs/sweeps.md describes the sweep file and the outputs.
--
--   local sweep = require("luazero.ui.sweep")
--   local spec = sweep.load("sweeps/example.lua")
--   local runs = sweep.expand(spec)        -- { {id, flags, swept, ranks}, ... }
--   sweep.run(spec, runs, { out = "sweep-out", jobs = 2, retry_failed = false })
local bit = require("bit")
local ffi = require("ffi")
local cjson = require("cjson")
local lz = require("luazero")
local atomic = require("luazero.io.atomic")
local decimal = require("luazero.io.decimal")

local M = {}

M.PLOT = { width = 900, height = 560 }

-- The names a sweep makes in its --out folder (io/paths.lua): runs/<id>/
-- (command.txt, status.json, metrics.jsonl, stdout.log, loss.dat), the
-- results and the plot.
M.OUT_NAMES = { "^runs$", "^results%.csv$", "^results%.md$", "^loss%.gp$", "^loss%.png$" }

pcall(ffi.cdef, [[
int posix_spawnp(int *pid, const char *file, const void *file_actions, const void *attrp,
                 char *const argv[], char *const envp[]);
int waitpid(int pid, int *status, int options);
int poll(void *fds, unsigned long nfds, int timeout);
extern char **environ;
]])
pcall(ffi.cdef, "int getpid(void);")
-- (SIGINT and SIGTERM held while the sweep runs, so it stops its runs and
-- writes the results of the finished ones; each run starts with none held)
pcall(ffi.cdef, [[
typedef struct { unsigned long val[16]; } lz_sigset_t;
int sigemptyset(lz_sigset_t *set);
int sigaddset(lz_sigset_t *set, int sig);
int sigismember(const lz_sigset_t *set, int sig);
int sigprocmask(int how, const lz_sigset_t *set, lz_sigset_t *old);
int sigpending(lz_sigset_t *set);
int sigtimedwait(const lz_sigset_t *set, void *info, const void *timeout);
int posix_spawnattr_init(void *attr);
int posix_spawnattr_destroy(void *attr);
int posix_spawnattr_setsigmask(void *attr, const lz_sigset_t *mask);
int posix_spawnattr_setflags(void *attr, short flags);
int kill(int pid, int sig);
]])
local SIGINT, SIGTERM, SIG_BLOCK, SIG_SETMASK = 2, 15, 0, 2
M.SIGNAL_NAMES = { [SIGINT] = "SIGINT", [SIGTERM] = "SIGTERM" } -- what stops a sweep
local POSIX_SPAWN_SETSIGMASK = 0x08

local function fail(msg) error("sweep: " .. msg, 0) end

local function q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

local function sleep_ms(ms) ffi.C.poll(nil, 0, ms) end

local function now()
  return require("luazero.clock").now()
end

------------------------------------------------------------------ the sweep file

local function is_list(t)
  if type(t) ~= "table" then return false end
  local n = 0
  for _ in pairs(t) do n = n + 1 end
  return n == #t
end

-- The flags that name files a run reads: a relative one is read from the
-- current folder, else from the sweep file's folder (as script is), and
-- one in neither is refused now rather than failing every run.
local INPUTS = { data = true, val_data = true, init = true, tokenizer = true, config = true,
                 model_config = true, resume = true }
local function input_beside(path, where, k, v)
  if not INPUTS[(tostring(k):gsub("-", "_"))] or type(v) ~= "string" or v:sub(1, 1) == "/" then
    return v
  end
  local exists = require("luazero.io.fs").exists
  if exists(v) then return v end
  local here = path:match("^(.*)/[^/]*$")
  if here and exists(here .. "/" .. v) then return here .. "/" .. v end
  fail(("%s: %s: %s is not there (looked in the current folder%s)"):format(path, where, v,
       here and " and in " .. here or ""))
end

local function check_value(where, k, v)
  local t = type(v)
  if t ~= "string" and t ~= "number" and t ~= "boolean" then
    fail(("%s: %s must be a string, number or boolean (got a %s)"):format(where, k, t))
  end
end

-- Reads and checks a sweep file: a Lua chunk returning
-- { name, ranks, script, base, grid, runs, plot }.
function M.load(path)
  local chunk, err = loadfile(path)
  if not chunk then fail(("%s: %s"):format(path, err)) end
  local ok, spec = pcall(chunk)
  if not ok then fail(("%s: %s"):format(path, tostring(spec))) end
  if type(spec) ~= "table" then
    fail(("%s must return a table ({ grid = {...}, runs = {...}, base = {...} }); got a %s")
         :format(path, type(spec)))
  end
  local known = { name = true, ranks = true, script = true, base = true, grid = true, runs = true,
                  plot = true }
  for k in pairs(spec) do
    if not known[k] then
      fail(("%s: unknown key '%s' (name, ranks, script, base, grid, runs, plot)"):format(path, tostring(k)))
    end
  end
  if spec.grid == nil and spec.runs == nil then
    fail(("%s: give a grid ({ lr = {1e-3, 3e-4} }) or a list of runs ({ {lr = 1e-3}, ... }), or both")
         :format(path))
  end
  spec.name = spec.name or path:match("([^/]+)%.lua$") or "sweep"
  -- (the name is a folder inside --out's parent: one plain name)
  if type(spec.name) ~= "string" or not spec.name:match("^[%w%._%-]+$") or
     spec.name:match("^%.+$") then
    fail(("%s: name must be a plain folder name (letters, digits, . _ -; got %s)")
         :format(path, type(spec.name) == "string" and ("'" .. spec.name .. "'") or
                 type(spec.name)))
  end
  -- script: a path to a script taking --flags, from the current folder, else
  -- from the sweep file's folder (as sweeps/example.lua finds its data)
  if spec.script ~= nil then
    if type(spec.script) ~= "string" or spec.script == "" then
      fail(("%s: script must be the path of a Lua script (got %s)"):format(path,
           tostring(spec.script)))
    end
    spec.script_named = spec.script
    local exists = require("luazero.io.fs").exists
    local here = path:match("^(.*)/[^/]*$")
    if not exists(spec.script) and spec.script:sub(1, 1) ~= "/" and here and
       exists(here .. "/" .. spec.script) then
      spec.script = here .. "/" .. spec.script
    end
    if not exists(spec.script) then
      fail(("%s: script %s is not there (looked in the current folder%s)"):format(path,
           spec.script, here and " and in " .. here or ""))
    end
  end
  spec.ranks = spec.ranks or 1
  if type(spec.ranks) ~= "number" or spec.ranks < 1 or spec.ranks ~= math.floor(spec.ranks) then
    fail(("%s: ranks must be a whole number >= 1 (got %s)"):format(path, tostring(spec.ranks)))
  end
  spec.base = spec.base or {}
  if type(spec.base) ~= "table" then
    fail(("%s: base must be a table of flags ({ steps = 100 })"):format(path))
  end
  if spec.base.ranks ~= nil then
    fail(("%s: base.ranks: ranks is the sweep's, not a flag of the script; give it at the top " ..
          "level (ranks = 2) or in grid or runs"):format(path))
  end
  for k, v in pairs(spec.base) do
    check_value(path .. ": base", k, v)
    spec.base[k] = input_beside(path, "base." .. tostring(k), k, v)
  end
  for k, vs in pairs(spec.grid or {}) do
    if not is_list(vs) or #vs == 0 then
      fail(("%s: grid.%s must be a non-empty list of values ({1e-3, 3e-4})"):format(path, tostring(k)))
    end
    for i, v in ipairs(vs) do
      check_value(path .. ": grid", k, v)
      vs[i] = input_beside(path, ("grid.%s[%d]"):format(tostring(k), i), k, v)
    end
  end
  if spec.runs ~= nil and not is_list(spec.runs) then
    fail(("%s: runs must be a list of tables ({ {lr = 1e-3}, {lr = 3e-4} })"):format(path))
  end
  for i, r in ipairs(spec.runs or {}) do
    if type(r) ~= "table" then fail(("%s: runs[%d] must be a table of flags"):format(path, i)) end
    for k, v in pairs(r) do
      check_value(("%s: runs[%d]"):format(path, i), k, v)
      r[k] = input_beside(path, ("runs[%d].%s"):format(i, tostring(k)), k, v)
    end
  end
  spec.plot = spec.plot or {}
  if type(spec.plot) ~= "table" then
    fail(("%s: plot must be a table ({ width = 900, height = 500 }); got a %s"):format(path,
         type(spec.plot)))
  end
  for k, v in pairs(spec.plot) do
    if k ~= "width" and k ~= "height" then
      fail(("%s: plot.%s is not a key of plot (width, height)"):format(path, tostring(k)))
    end
    if type(v) ~= "number" or v ~= math.floor(v) or v < 64 or v > 16384 then
      fail(("%s: plot.%s must be a whole number of pixels, 64 to 16384 (got %s)"):format(path, k,
           tostring(v)))
    end
  end
  spec.source = path
  return spec
end

------------------------------------------------------------------ runs

local function flag_name(k) return (tostring(k):gsub("_", "-")) end

-- A value as a flag's text: a whole number without a point, another
-- number in the fewest digits that read back the same (tostring keeps 14:
-- 1/3 would reach the run as another number, and 0.3 and
-- 0.30000000000000004 would be one run).
local function value_text(v)
  if type(v) ~= "number" then return tostring(v) end
  return decimal.shortest(v)
end

M.value_text = value_text

local function sorted_keys(t)
  local ks = {}
  for k in pairs(t) do ks[#ks + 1] = k end
  table.sort(ks, function(a, b) return flag_name(a) < flag_name(b) end)
  return ks
end

-- A stable id: the values the run's own grid combination or runs entry
-- sets (its keys: another entry's keys leave it be) as a slug, then 8 hex
-- digits of a hash of every flag (so two runs never share an id).
local function run_id(flags, own_keys, ranks, script)
  local parts = {}
  for _, k in ipairs(own_keys) do
    if k == "ranks" then parts[#parts + 1] = "ranks" .. ranks
    elseif flags[k] ~= nil then parts[#parts + 1] = flag_name(k) .. value_text(flags[k]) end
  end
  local slug = table.concat(parts, "_"):gsub("[^%w%.%-_]", "")
  -- (a script of the sweep's own is part of the hash: another script's runs
  -- are other runs; the default's ids stay as they were)
  local all = { "ranks=" .. ranks, script and ("script=" .. script) or nil }
  for _, k in ipairs(sorted_keys(flags)) do all[#all + 1] = flag_name(k) .. "=" .. value_text(flags[k]) end
  local text = table.concat(all, "\n")
  local h = require("bit").tohex(lz.xxh64(ffi.cast("const char *", text), #text, 0), 8)
  if slug == "" then return h end
  return slug:sub(1, 80) .. "-" .. h
end

-- t's keys as the flags they name (micro_batch and ["micro-batch"] are one
-- flag, --micro-batch); a table that gives one flag both ways is refused.
local function as_flags(t, where)
  local out, from = {}, {}
  for k, v in pairs(t or {}) do
    local n = flag_name(k)
    if from[n] ~= nil then
      local a, b = tostring(from[n]), tostring(k)
      if b < a then a, b = b, a end
      fail(("%s gives --%s twice (%s and %s); give it once"):format(where, n, a, b))
    end
    out[n], from[n] = v, k
  end
  return out
end

-- Every run: the grid's product (keys in name order) and then the listed
-- runs, each on top of base (a key as either spelling: as_flags). A key
-- "ranks" sets the run's ranks.
function M.expand(spec)
  local where = spec.source and (spec.source .. ": ") or ""
  local base = as_flags(spec.base, where .. "base")

  local grid = spec.grid and as_flags(spec.grid, where .. "grid")
  local combos = {}
  if grid then
    local keys = sorted_keys(grid)
    local function rec(i, acc)
      if i > #keys then
        local c = {}
        for k, v in pairs(acc) do c[k] = v end
        combos[#combos + 1] = c
        return
      end
      for _, v in ipairs(grid[keys[i]]) do
        acc[keys[i]] = v
        rec(i + 1, acc)
      end
      acc[keys[i]] = nil
    end
    rec(1, {})
  end
  for i, r in ipairs(spec.runs or {}) do
    combos[#combos + 1] = as_flags(r, ("%sruns[%d]"):format(where, i))
  end
  -- The swept keys: whatever the grid or a run sets.
  local swept_set = {}
  for _, c in ipairs(combos) do for k in pairs(c) do swept_set[k] = true end end
  local swept_keys = sorted_keys(swept_set)
  local runs, seen = {}, {}
  for _, c in ipairs(combos) do
    local flags = {}
    for k, v in pairs(base) do flags[k] = v end
    local ranks = spec.ranks
    for k, v in pairs(c) do
      if k == "ranks" then ranks = v else flags[k] = v end
    end
    if flags.log ~= nil then
      fail(("%s--log is the sweep's own (each run's runs/<id>/metrics.jsonl); remove it from the " ..
            "sweep file"):format(where))
    end
    if type(ranks) ~= "number" or ranks < 1 or ranks ~= math.floor(ranks) then
      fail(("%sranks must be a whole number >= 1 (got %s)"):format(where,
           type(ranks) == "string" and ("the string '%s'"):format(ranks) or tostring(ranks)))
    end
    local swept = {}
    for _, k in ipairs(swept_keys) do swept[k] = k == "ranks" and ranks or flags[k] end
    local id = run_id(flags, sorted_keys(c), ranks, spec.script_named)
    if not seen[id] then
      seen[id] = true
      runs[#runs + 1] = { id = id, flags = flags, swept = swept, ranks = ranks }
    end
  end
  M.swept_keys = swept_keys
  return runs, swept_keys
end

-- "lr=0.001 stage=3": a run's label in the plot and the progress lines.
function M.label(run, swept_keys)
  local parts = {}
  for _, k in ipairs(swept_keys) do
    if run.swept[k] ~= nil then parts[#parts + 1] = flag_name(k) .. "=" .. value_text(run.swept[k]) end
  end
  return #parts > 0 and table.concat(parts, " ") or run.id
end

------------------------------------------------------------------ files

local read_file = lz.read_file

-- Whole or not at all (io/atomic.lua); a failure stops the sweep.
local function write_file(path, text)
  local ok, err = pcall(atomic.write, path, text)
  if not ok then fail(tostring(err)) end
end

local function mkdir(path)
  local ok = os.execute("mkdir -p " .. q(path))
  if ok ~= 0 and ok ~= true then fail(("cannot create the folder %s"):format(path)) end
end

local function cpus()
  local p = io.popen("nproc 2>/dev/null")
  local n = p and tonumber(p:read("*l") or "")
  if p then p:close() end
  return n or 1
end

------------------------------------------------------------------ metrics

-- What a run's metrics log says: final loss, last validation loss, mean
-- tokens/s (the first step, warming up, left out), peak ledger bytes and
-- peak RSS of rank 0 (the rank that logs), and the loss curve.
function M.metrics(path)
  local out = { curve = {} }
  local f = io.open(path, "r")
  if not f then return out end
  local tps, n_tps = 0, 0
  for line in f:lines() do
    local ok, r = pcall(cjson.decode, line)
    if ok and type(r) == "table" and r.step then
      out.curve[#out.curve + 1] = { r.step, r.loss }
      out.final_loss = r.loss
      out.steps = r.step
      if r.val_loss then out.val_loss = r.val_loss end
      if r.step > 1 and r.tokens_per_s then
        tps, n_tps = tps + r.tokens_per_s, n_tps + 1
      end
      out.first_tps = out.first_tps or r.tokens_per_s
      if type(r.mem) == "table" then
        local total = 0
        for _, c in ipairs(lz.category_order) do total = total + (r.mem[c] or 0) end
        out.peak_mem = math.max(out.peak_mem or 0, total)
        out.peak_rss = math.max(out.peak_rss or 0, r.mem.peak_rss or 0)
      end
    end
  end
  f:close()
  out.tokens_per_s = n_tps > 0 and tps / n_tps or out.first_tps
  return out
end

local function last_lines(text, n)
  local lines = {}
  for l in (text or ""):gmatch("[^\n]+") do
    if l:match("%S") then lines[#lines + 1] = l end
  end
  local first = math.max(1, #lines - n + 1)
  return table.concat(lines, "\n", first)
end

------------------------------------------------------------------ jobs

local function spawn(cmd)
  local argv = ffi.new("char *[4]")
  local strs = { "/bin/sh", "-c", cmd }
  local keep = {}
  for i, s in ipairs(strs) do
    keep[i] = ffi.new("char[?]", #s + 1, s)
    argv[i - 1] = keep[i]
  end
  argv[3] = nil
  local pid = ffi.new("int[1]")
  -- (the run starts with no signal held, whatever the sweep holds)
  local attr, none = ffi.new("char[1024]"), ffi.new("lz_sigset_t")
  ffi.C.sigemptyset(none)
  ffi.C.posix_spawnattr_init(attr)
  ffi.C.posix_spawnattr_setsigmask(attr, none)
  ffi.C.posix_spawnattr_setflags(attr, POSIX_SPAWN_SETSIGMASK)
  local rc = ffi.C.posix_spawnp(pid, "/bin/sh", nil, attr, argv, ffi.C.environ)
  ffi.C.posix_spawnattr_destroy(attr)
  if rc ~= 0 then fail(("cannot start a job (posix_spawnp error %d): %s"):format(rc, cmd)) end
  return pid[0]
end

-- SIGINT or SIGTERM sent to the sweep while it holds them (taken off the
-- pending set), or nil.
local function stop_signal()
  local pending = ffi.new("lz_sigset_t")
  ffi.C.sigpending(pending)
  for _, sig in ipairs({ SIGINT, SIGTERM }) do
    if ffi.C.sigismember(pending, sig) == 1 then
      local one = ffi.new("lz_sigset_t")
      ffi.C.sigemptyset(one)
      ffi.C.sigaddset(one, sig)
      ffi.C.sigtimedwait(one, nil, ffi.new("long[2]", 0, 0))
      return sig
    end
  end
end

-- nil while the job runs; else exit code (128 + signal when killed).
local function reap(pid)
  local st = ffi.new("int[1]")
  local r = ffi.C.waitpid(pid, st, 1) -- WNOHANG
  if r == 0 then return nil end
  if r < 0 then return 255 end
  local s = st[0]
  if bit.band(s, 0x7f) == 0 then return bit.band(bit.rshift(s, 8), 0xff) end
  return 128 + bit.band(s, 0x7f)
end

local function command(spec, run, dir, threads)
  local script = spec.script or (lz.root .. "/scripts/train.lua")
  local args = {}
  for _, k in ipairs(sorted_keys(run.flags)) do
    local v = run.flags[k]
    if v ~= false then
      args[#args + 1] = "--" .. flag_name(k)
      if v ~= true then args[#args + 1] = q(value_text(v)) end
    end
  end
  -- (LZ_PARENT_PID: the run stops when the sweep does, killed or not)
  return ("LZ_PARENT_PID=%d OMP_NUM_THREADS=%d exec %s %s %s %s --log %s > %s 2> %s"):format(
    ffi.C.getpid(), threads, q(lz.executable()), run.ranks > 1 and ("-n " .. run.ranks) or "", q(script),
    table.concat(args, " "), q(dir .. "/metrics.jsonl"), q(dir .. "/stdout.log"),
    q(dir .. "/stderr.log"))
end

-- Runs what is not finished; returns the records of every run and, when a
-- SIGINT or SIGTERM stopped the sweep, that signal: the runs it cut off
-- (SIGTERM sent to each) keep no record, so the same command runs them again.
-- opts: out (folder), jobs (at once), retry_failed, say (progress function).
function M.run(spec, runs, opts)
  local out, jobs = opts.out, math.max(1, opts.jobs or 1)
  local say = opts.say or print
  mkdir(out .. "/runs")
  local max_ranks = 1
  for _, r in ipairs(runs) do max_ranks = math.max(max_ranks, r.ranks) end
  local threads = math.max(1, math.floor(cpus() / (math.min(jobs, #runs) * max_ranks)))
  local records, queue = {}, {}
  local n = #runs
  for k, r in ipairs(runs) do
    local dir = out .. "/runs/" .. r.id
    local prev = read_file(dir .. "/status.json")
    local ok, rec = pcall(cjson.decode, prev or "")
    if prev and ok and (rec.status == "ok" or (rec.status == "failed" and not opts.retry_failed)) then
      records[k] = rec
      say(("[%d/%d] %s  skipped (%s before)"):format(k, n, r.id, rec.status))
    else
      queue[#queue + 1] = k
    end
  end
  local running, active, stopped = {}, 0, nil
  local hold, before = ffi.new("lz_sigset_t"), ffi.new("lz_sigset_t")
  ffi.C.sigemptyset(hold)
  ffi.C.sigaddset(hold, SIGINT)
  ffi.C.sigaddset(hold, SIGTERM)
  ffi.C.sigprocmask(SIG_BLOCK, hold, before)
  while #queue > 0 or active > 0 do
    while #queue > 0 and active < jobs do
      local k = table.remove(queue, 1)
      local r = runs[k]
      local dir = out .. "/runs/" .. r.id
      mkdir(dir)
      os.remove(dir .. "/metrics.jsonl")
      local cmd = command(spec, r, dir, threads)
      write_file(dir .. "/command.txt", cmd .. "\n")
      running[spawn(cmd)] = { k = k, t0 = now(), dir = dir }
      active = active + 1
      say(("[%d/%d] %s  started: %s (%d rank%s, %d thread%s each)"):format(k, n, r.id,
          M.label(r, M.swept_keys or {}), r.ranks, r.ranks == 1 and "" or "s", threads,
          threads == 1 and "" or "s"))
    end
    sleep_ms(100)
    if not stopped then
      stopped = stop_signal()
      if stopped then
        say(("sweep %s: %s: stopping %d running run%s (each is run again by the same " ..
             "command), %d not started"):format(spec.name, M.SIGNAL_NAMES[stopped], active,
             active == 1 and "" or "s", #queue))
        queue = {}
        for pid in pairs(running) do ffi.C.kill(pid, SIGTERM) end
      end
    end
    for pid, job in pairs(running) do
      local code = reap(pid)
      if code and stopped then
        running[pid] = nil
        active = active - 1
        say(("[%d/%d] %s  stopped"):format(job.k, n, runs[job.k].id))
      elseif code then
        running[pid] = nil
        active = active - 1
        local r = runs[job.k]
        local m = M.metrics(job.dir .. "/metrics.jsonl")
        local rec = {
          id = r.id, flags = r.flags, swept = r.swept, ranks = r.ranks,
          status = code == 0 and "ok" or "failed", exit_code = code,
          seconds = now() - job.t0, final_loss = m.final_loss, val_loss = m.val_loss,
          tokens_per_s = m.tokens_per_s, peak_mem = m.peak_mem, peak_rss = m.peak_rss,
          steps = m.steps,
        }
        if code ~= 0 then
          rec.error = last_lines(read_file(job.dir .. "/stderr.log"), 5)
          if rec.error == "" then rec.error = ("exited with code %d, nothing on stderr"):format(code) end
        end
        write_file(job.dir .. "/status.json", cjson.encode(rec) .. "\n")
        records[job.k] = rec
        say(("[%d/%d] %s  %s in %.1f s%s"):format(job.k, n, r.id, rec.status, rec.seconds,
            code == 0 and (rec.final_loss and (": loss %.4f"):format(rec.final_loss) or "")
            or (" (exit %d): %s"):format(code, (rec.error:gsub("\n", " | ")))))
      end
    end
  end
  ffi.C.sigprocmask(SIG_SETMASK, before, nil)
  return records, stopped
end

------------------------------------------------------------------ results

local function fmt(v, pattern)
  if v == nil or v == cjson.null then return "" end
  return pattern and pattern:format(v) or value_text(v)
end

local function columns(swept_keys)
  local cols = { { "id", function(r) return r.id end } }
  for _, k in ipairs(swept_keys) do
    cols[#cols + 1] = { flag_name(k), function(r) return fmt(r.swept and r.swept[k]) end }
  end
  local more = {
    { "status", function(r) return r.status end },
    { "final_loss", function(r) return fmt(r.final_loss, "%.4f") end },
    { "val_loss", function(r) return fmt(r.val_loss, "%.4f") end },
    { "tokens_per_s", function(r) return fmt(r.tokens_per_s, "%.0f") end },
    { "peak_mem_mib", function(r) return fmt(r.peak_mem and r.peak_mem / 2 ^ 20, "%.1f") end },
    { "peak_rss_mib", function(r) return fmt(r.peak_rss and r.peak_rss / 2 ^ 20, "%.1f") end },
    { "seconds", function(r) return fmt(r.seconds, "%.1f") end },
    { "error", function(r) return r.error or "" end },
  }
  for _, c in ipairs(more) do cols[#cols + 1] = c end
  return cols
end

local function csv_cell(s)
  s = tostring(s)
  if s:find('[,"\n]') then return '"' .. s:gsub('"', '""') .. '"' end
  return s
end

function M.write_results(spec, runs, records, swept_keys, out)
  local cols = columns(swept_keys)
  local csv, md = {}, {}
  local head = {}
  for _, c in ipairs(cols) do head[#head + 1] = c[1] end
  csv[1] = table.concat(head, ",")
  md[1] = ("# Sweep %s\n\n%d runs from %s; peak memory is rank 0's (ledger, RSS).\n")
          :format(spec.name, #runs, spec.source or "?")
  md[2] = "| " .. table.concat(head, " | ") .. " |"
  md[3] = "|" .. ("---|"):rep(#cols)
  for k = 1, #runs do
    local r = records[k]
    if r then
      local cells_csv, cells_md = {}, {}
      for _, c in ipairs(cols) do
        local v = c[2](r)
        cells_csv[#cells_csv + 1] = csv_cell(v)
        cells_md[#cells_md + 1] = tostring(v):gsub("|", "\\|"):gsub("\n", "<br>")
      end
      csv[#csv + 1] = table.concat(cells_csv, ",")
      md[#md + 1] = "| " .. table.concat(cells_md, " | ") .. " |"
    end
  end
  write_file(out .. "/results.csv", table.concat(csv, "\n") .. "\n")
  md[#md + 1] = "\n![loss curves](loss.png)"
  write_file(out .. "/results.md", table.concat(md, "\n") .. "\n")
end

------------------------------------------------------------------ the plot

local function gnuplot_terminal()
  local p = io.popen("gnuplot -e 'set terminal pngcairo' 2>&1 && echo LZ_OK")
  local text = p and p:read("*a") or ""
  if p then p:close() end
  if text:find("LZ_OK") and not text:find("unknown") then return "pngcairo" end
  p = io.popen("gnuplot -e 'set terminal png' 2>&1 && echo LZ_OK")
  text = p and p:read("*a") or ""
  if p then p:close() end
  if text:find("LZ_OK") and not text:find("unknown") then return "png" end
end

-- loss.png: one line per successful run, labelled with its swept values.
-- Returns the path, or nil and why not.
function M.plot(spec, runs, records, swept_keys, out)
  local width = spec.plot.width or M.PLOT.width
  local height = spec.plot.height or M.PLOT.height
  local series = {}
  for k, r in ipairs(runs) do
    local rec = records[k]
    if rec and rec.status == "ok" then
      local m = M.metrics(out .. "/runs/" .. r.id .. "/metrics.jsonl")
      if #m.curve > 0 then
        local lines = {}
        for _, p in ipairs(m.curve) do lines[#lines + 1] = ("%d %.9g"):format(p[1], p[2]) end
        local dat = out .. "/runs/" .. r.id .. "/loss.dat"
        write_file(dat, table.concat(lines, "\n") .. "\n")
        series[#series + 1] = { dat = dat, label = M.label(r, swept_keys) }
      end
    end
  end
  if #series == 0 then return nil, "no successful run logged a loss" end
  local term = gnuplot_terminal()
  if not term then
    return nil, "gnuplot with a png terminal is missing (apt-get install gnuplot-nox)"
  end
  local png = out .. "/loss.png"
  local gp = {
    ("set terminal %s size %d,%d"):format(term, width, height),
    ("set output %q"):format(png),
    ("set title %q noenhanced"):format("sweep " .. spec.name .. ": training loss"),
    "set xlabel 'step'", "set ylabel 'loss'", "set grid", "set key inside top right noenhanced box opaque",
  }
  local plots = {}
  for _, s in ipairs(series) do
    plots[#plots + 1] = ("%q using 1:2 with lines linewidth 2 title %q"):format(s.dat, s.label)
  end
  gp[#gp + 1] = "plot " .. table.concat(plots, ", \\\n     ")
  write_file(out .. "/loss.gp", table.concat(gp, "\n") .. "\n")
  local p = io.popen(("gnuplot %s 2>&1"):format(q(out .. "/loss.gp")))
  local text = p:read("*a")
  local ok = p:close()
  if not ok then return nil, "gnuplot failed: " .. text end
  return png
end

return M
