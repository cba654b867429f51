-- repl.lua — luazero's read-eval-print loop (`luazero`, `luazero -i script.lua`).
-- A line at a time: "=expr" or a bare expression prints its values
-- (luazero.ui.show: tensors, modules, the engine, the ledger, tables); an
-- incomplete chunk continues at a ">> " prompt; errors print with their
-- traceback and the loop goes on (read from a pipe or a file, any error
-- makes the exit status 1). The helpers of luazero.ui.inspect (shards,
-- norms, mem, gather, estimate) are globals.
--
-- Under `luazero -n N -i` rank 0 runs the loop and the other ranks serve its
-- helpers (luazero.ui.serve); Ctrl-D on rank 0 ends every rank.
--
-- Line editing and history come from the luazero executable
-- (luazero.lineedit, libedit); from a plain luajit the loop reads io.stdin.
local show = require("luazero.ui.show")
local serve = require("luazero.ui.serve")
local inspect = require("luazero.ui.inspect")

local M = {}

local function reader()
  local ok, le = pcall(require, "luazero.lineedit")
  if ok then return le.read, le.tty end
  return function(prompt)
    io.stdout:write(prompt)
    io.stdout:flush()
    return io.read("*l")
  end, false
end

-- Compiles a chunk: an expression first (its values are printed), then a
-- statement. Returns the function, or nil and whether the chunk is
-- incomplete, or nil and the syntax error. (The expression is select's
-- argument, not a tail call, so an error it raises keeps its line:
-- `stdin:1: boom`.)
local function compile(chunk)
  local text = chunk:sub(1, 1) == "=" and chunk:sub(2) or chunk
  local f = loadstring("return select(1, " .. text .. "\n)", "=stdin")
  if f then return f end
  local err
  f, err = loadstring(text, "=stdin")
  if f then return f end
  if err:find("'<eof>'$") then return nil, true end
  -- an expression cut short (`{1,` or `1 +` at a line's end) continues too
  local _, expr_err = loadstring("return " .. text, "=stdin")
  if expr_err and expr_err:find("'<eof>'$") then return nil, true end
  return nil, false, err
end

local function pack(...) return { n = select("#", ...), ... } end

-- The error with the traceback of the chunk's own frames (not the REPL's).
local function traceback(err)
  local tb = debug.traceback(tostring(err), 2)
  return (tb:gsub("\n%s*%[C%]: in function 'xpcall'.*$", ""))
end

local function print_values(res)
  local parts, multi = {}, false
  for i = 2, res.n do
    local ok, text = pcall(show.value, res[i])
    parts[#parts + 1] = ok and text or ("<cannot show: " .. tostring(text) .. ">")
    if parts[#parts]:find("\n") then multi = true end
  end
  print(table.concat(parts, multi and "\n" or "\t"))
end

local function install_helpers()
  for _, name in ipairs(inspect.globals) do
    if rawget(_G, name) == nil then rawset(_G, name, inspect[name]) end
  end
  if rawget(_G, "lz") == nil then rawset(_G, "lz", require("luazero")) end
end

-- opts.script_failed: the script before the loop raised (its traceback is
-- printed already).
function M.run(opts)
  opts = opts or {}
  install_helpers()
  if serve.multi() and serve.rank() ~= 0 then
    serve.loop()
    return
  end
  local read, tty = reader()
  local multi = serve.lead()
  if tty then
    local lz = require("luazero")
    print(("luazero %s REPL%s — helpers: %s; Ctrl-D quits"):format(lz.version(),
          multi and (" on rank 0 of %d"):format(serve.size()) or "",
          table.concat(inspect.globals, ", ")))
    if opts.script_failed then print("(the script failed; its globals are here)") end
  end
  if multi then
    -- os.exit at the prompt lets the serving ranks go first: they would
    -- otherwise wait for rank 0's next command until the collective timeout.
    local exit = os.exit
    os.exit = function(...) -- luacheck: ignore
      pcall(serve.quit)
      return exit(...)
    end
  end
  local idle = multi and serve.idle_seconds() or nil
  local on_idle = multi and serve.ping or nil
  -- (read from a pipe or a file, a chunk that fails, or one left incomplete
  -- at the end, makes the exit status 1, as a script's would)
  local failed = opts.script_failed or false
  local chunk = nil
  while true do
    local line = read(chunk and ">> " or "> ", idle, on_idle)
    if line == nil then break end
    chunk = chunk and (chunk .. "\n" .. line) or line
    local f, incomplete, err = compile(chunk)
    if f then
      chunk = nil
      local res = pack(xpcall(f, traceback))
      if not res[1] then
        failed = true
        io.stderr:write(tostring(res[2]), "\n")
        io.stderr:flush()
      elseif res.n > 1 then
        print_values(res)
      end
      io.stdout:flush()
    elseif not incomplete then
      chunk, failed = nil, true
      io.stderr:write(err, "\n")
      io.stderr:flush()
    end
  end
  if chunk then
    failed = true
    io.stderr:write(("input ended inside an unfinished chunk, not run: %s\n")
                    :format((chunk:gsub("\n", " "))))
  end
  if tty then io.stdout:write("\n") end
  serve.quit()
  if failed and not tty then os.exit(1) end
end

return M
