-- scripts/sweep.lua — runs a hyperparameter sweep: every run of a sweep file
-- as its own job through the launcher, then results.csv, results.md and
-- loss.png. Finished runs are skipped when the sweep runs again.
--   luazero scripts/sweep.lua sweeps/example.lua [--jobs K] [--out DIR] [--retry-failed]
-- The sweep file and the outputs: docs/sweeps.md.
local sweep = require("luazero.ui.sweep")

local usage = [[
usage: luazero scripts/sweep.lua SWEEP.lua [--jobs K] [--out DIR] [--retry-failed] [--list]
  --jobs K         runs at once (default 1); the cores are shared among them
  --out DIR        where runs/<id>/, results.csv, results.md and loss.png go
                   (default sweeps-out/<the sweep's name>)
  --retry-failed   run again the runs that failed before (finished ones are skipped)
  --list           print the runs and their ids, run nothing]]

local function user_error(msg)
  io.stderr:write("sweep: ", msg, "\n")
  os.exit(2)
end

local function main(argv)
  local file, opts, given = nil, { jobs = 1 }, {}
  local i = 1
  while i <= #argv do
    local a = argv[i]
    -- (--name=value as train.lua takes it)
    local name, inline = a:match("^(%-%-[%w-]+)=(.*)$")
    if name then a = name end
    if a == "--help" or a == "-h" then
      print(usage)
      return
    elseif a == "--jobs" or a == "--out" then
      if given[a] then user_error(a .. " given twice; give it once") end
      given[a] = true
      local v = inline or argv[i + 1]
      if v == nil then user_error(a .. " needs a value") end
      if inline then i = i - 1 end
      if a == "--jobs" then
        opts.jobs = tonumber(v)
        if not opts.jobs or opts.jobs < 1 or opts.jobs ~= math.floor(opts.jobs) then
          user_error(("--jobs must be a whole number >= 1 (got '%s')"):format(v))
        end
      else
        opts.out = v
      end
      i = i + 1
    elseif a == "--retry-failed" then
      opts.retry_failed = true
    elseif a == "--list" then
      opts.list = true
    elseif a:sub(1, 2) == "--" then
      user_error(("unknown flag %s (--help lists them)"):format(a))
    elseif file then
      user_error(("one sweep file at a time (got %s and %s)"):format(file, a))
    else
      file = a
    end
    i = i + 1
  end
  if not file then user_error("give a sweep file (luazero scripts/sweep.lua sweeps/example.lua)") end
  local ok, spec = pcall(sweep.load, file)
  if not ok then user_error(tostring(spec):gsub("^sweep: ", "")) end
  local runs, swept, why
  ok, runs, swept = pcall(sweep.expand, spec)
  if not ok then user_error(tostring(runs):gsub("^sweep: ", "")) end
  if opts.list then
    for k, r in ipairs(runs) do print(("%d %s  %s"):format(k, r.id, sweep.label(r, swept))) end
    return
  end
  opts.out = opts.out or ("sweeps-out/" .. spec.name)
  -- Every file it touches (io/paths.lua): --out must not write over the sweep file.
  local p = require("luazero.io.paths").new():read("the sweep file", file)
  p:write_in("--out", opts.out, sweep.OUT_NAMES)
  ok, why = pcall(p.check, p)
  if not ok then user_error(why) end
  print(("sweep %s: %d runs, %d at once, into %s"):format(spec.name, #runs, opts.jobs, opts.out))
  io.stdout:flush()
  opts.say = function(line)
    print(line)
    io.stdout:flush()
  end
  local records, stopped = sweep.run(spec, runs, opts)
  sweep.write_results(spec, runs, records, swept, opts.out)
  local png, why = sweep.plot(spec, runs, records, swept, opts.out)
  local n_ok, n_failed, n_left = 0, 0, 0
  for k = 1, #runs do
    if not records[k] then n_left = n_left + 1
    elseif records[k].status == "ok" then n_ok = n_ok + 1 else n_failed = n_failed + 1 end
  end
  if stopped then
    -- (the finished runs' results written; the rest run on the next call)
    print(("sweep %s: stopped by %s: %d ok, %d failed, %d not run; %s/results.csv; the same " ..
           "command runs the rest"):format(spec.name, sweep.SIGNAL_NAMES[stopped],
           n_ok, n_failed, n_left, opts.out))
    os.exit(128 + stopped)
  end
  print(("sweep %s: %d ok, %d failed; %s/results.csv, %s/results.md, %s"):format(spec.name,
        n_ok, n_failed, opts.out, opts.out, png or ("no plot: " .. why)))
  -- (nothing to compare: the sweep itself failed, as a script's caller sees)
  if n_ok == 0 and n_failed > 0 then
    local first = records[1] and records[1].error or ""
    io.stderr:write(("sweep %s: every run failed (the first: %s); see %s/runs/<id>/stderr.log\n")
                    :format(spec.name, (first:gsub("\n", " | ")), opts.out))
    os.exit(1)
  end
end

main(arg)
