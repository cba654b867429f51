-- serve.lua — a multi-rank REPL: rank 0 reads the terminal, the other ranks
-- answer its questions. When rank 0 evaluates a helper that needs every rank
-- (luazero.ui.inspect's shards, norms, mem, gather), it broadcasts a small
-- command through the collectives; the other ranks, sitting in serve.loop()
-- after their script ended, run the same helper and contribute to its
-- collectives. While rank 0 waits at the prompt it broadcasts "ping" every
-- few seconds, so no rank waits in a collective longer than that and none
-- dies of LZ_COMM_TIMEOUT while a person thinks; "quit" ends the loop.
--
--   serve.register("norms", fn)          -- fn(...) runs on every rank
--   serve.together("norms", ...)         -- in a helper, before its collectives
--   local texts = serve.collect(str)     -- every rank's string, on every rank
--   serve.loop()                         -- ranks 1..N-1: answer until "quit"
local ffi = require("ffi")
local cjson = require("cjson")
local lz = require("luazero")

local M = {}

local CMD_BYTES = 4096 -- a command's text, at most
local handlers = {}
local leading = false -- rank 0 while its REPL runs with serving peers
local cmd_buf

-- Whether this process is one of several ranks (launcher or mpirun).
function M.multi()
  local w = tonumber(os.getenv("WORLD_SIZE") or os.getenv("OMPI_COMM_WORLD_SIZE") or "1") or 1
  return w > 1
end

local function comm() return require("luazero.comm") end

function M.size() return M.multi() and comm().size() or 1 end
function M.rank() return M.multi() and comm().rank() or 0 end

-- Seconds between pings: a quarter of the collective timeout, at most 30.
function M.idle_seconds()
  local timeout = tonumber(os.getenv("LZ_COMM_TIMEOUT") or "") or 300
  return math.max(0.05, math.min(30, timeout / 4))
end

function M.register(name, fn) handlers[name] = fn end

local function buffer()
  cmd_buf = cmd_buf or lz.tensor({ CMD_BYTES / 4 + 1 }, "i32", "comm")
  return cmd_buf
end

local function send(text)
  local b = buffer()
  ffi.cast("int32_t *", b.data)[0] = #text
  ffi.copy(ffi.cast("char *", b.data) + 4, text, #text)
  comm().broadcast(b, 0)
end

local function receive()
  local b = buffer()
  comm().broadcast(b, 0)
  local n = ffi.cast("int32_t *", b.data)[0]
  return ffi.string(ffi.cast("char *", b.data) + 4, n)
end

-- The name of the global holding `v` (the other ranks hold their own
-- engine under the same name: they ran the same script): `engine` where it
-- does, else the first such name in order.
local function global_name(v)
  if rawequal(rawget(_G, "engine"), v) then return "engine" end
  local names = {}
  for k, x in pairs(_G) do
    if rawequal(x, v) and type(k) == "string" then names[#names + 1] = k end
  end
  table.sort(names)
  return names[1]
end

local function is_engine(v)
  local ok, engine = pcall(require, "luazero.zero.engine")
  return ok and type(v) == "table" and getmetatable(v) == engine.Engine
end

local function encode_args(name, ...)
  local n, a = select("#", ...), {}
  for i = 1, n do
    local v = select(i, ...)
    local t = type(v)
    if is_engine(v) then
      local g = global_name(v)
      if not g then
        error(("%s: the engine must be in a global variable (engine = zero.initialize{...}) so " ..
               "that the other ranks find theirs by its name"):format(name), 0)
      end
      a[tostring(i)] = { global = g }
    elseif t == "string" or t == "number" or t == "boolean" then
      a[tostring(i)] = { value = v }
    elseif v ~= nil then
      error(("%s: argument %d is a %s; across ranks only engines (in globals), strings, " ..
             "numbers and booleans travel"):format(name, i, t), 0)
    end
  end
  return { n = n, a = a }
end

local function decode_args(args)
  local out = {}
  for i = 1, args.n do
    local x = args.a[tostring(i)]
    if x and x.global then out[i] = rawget(_G, x.global)
    elseif x then out[i] = x.value end
  end
  return unpack(out, 1, args.n)
end

-- Called by a helper before its collectives: on rank 0 of a multi-rank
-- REPL it tells the serving ranks to run the same helper with the same
-- arguments, then hears from every rank whether it can (its engine found
-- under the global's name); one that cannot is named in the error, and no
-- rank enters the helper's collectives. Everywhere else it does nothing (a
-- script calls helpers on every rank itself).
function M.together(name, ...)
  if not leading then return end
  assert(handlers[name], "serve: no helper registered as " .. name)
  local text = cjson.encode({ op = name, args = encode_args(name, ...) })
  if #text > CMD_BYTES then
    error(("%s: the command is %d bytes; commands are at most %d"):format(name, #text, CMD_BYTES), 0)
  end
  send(text)
  for r, answer in ipairs(M.collect("ok")) do
    if answer ~= "ok" then error(("%s: rank %d: %s"):format(name, r - 1, answer), 0) end
  end
end

-- Every rank's string, on every rank (a list indexed by rank + 1).
function M.collect(text)
  local W = M.size()
  if W == 1 then return { text } end
  local c = comm()
  local mine = lz.tensor({ 1 }, "i32", "comm")
  local lens = lz.tensor({ W }, "i32", "comm")
  mine:set(0, #text)
  c.all_gather(mine, lens)
  local most = 0
  for r = 0, W - 1 do most = math.max(most, lens:get(r)) end
  local per = math.max(1, math.ceil(most / 4))
  local send_buf = lz.tensor({ per }, "i32", "comm")
  local recv_buf = lz.tensor({ per * W }, "i32", "comm")
  ffi.copy(send_buf.data, text, #text)
  c.all_gather(send_buf, recv_buf)
  local out = {}
  for r = 0, W - 1 do
    out[r + 1] = ffi.string(ffi.cast("char *", recv_buf.data) + r * per * 4, lens:get(r))
  end
  mine:free(); lens:free(); send_buf:free(); recv_buf:free()
  return out
end

------------------------------------------------------------------ rank 0

-- Rank 0 starts leading (returns whether there are ranks to lead).
function M.lead()
  leading = M.size() > 1
  return leading
end

function M.ping() if leading then send("ping") end end

function M.quit()
  if leading then
    leading = false
    send("quit")
  end
end

------------------------------------------------------------------ the others

-- Why this rank cannot run command `text` (nil: it can), and the helper
-- with its arguments: the helper registered, every engine argument found
-- under its global's name.
local function prepare(text)
  local ok, cmd = pcall(cjson.decode, text)
  if not ok or type(cmd) ~= "table" or type(cmd.args) ~= "table" then
    return "cannot read the command"
  end
  local fn = handlers[cmd.op]
  if not fn then return "no helper named " .. tostring(cmd.op) .. " on this rank" end
  for _, x in pairs(cmd.args.a or {}) do
    if type(x) == "table" and x.global and not is_engine(rawget(_G, x.global)) then
      return ("the global %s is not an engine on this rank; keep the engine in a global of " ..
              "the same name on every rank"):format(tostring(x.global))
    end
  end
  return nil, fn, cmd.args
end

-- Answers rank 0's commands until "quit": says whether it can run each
-- (together's agreement), runs it if every rank can. A helper's error is
-- reported with this rank's number (rank 0 reports its own) and the loop
-- goes on.
function M.loop()
  local rank = M.rank()
  while true do
    local text = receive()
    if text == "quit" then return end
    if text ~= "ping" then
      local why, fn, args = prepare(text)
      local answers = M.collect(why or "ok")
      local all = true
      for _, a in ipairs(answers) do all = all and a == "ok" end
      local ok, err = true, nil
      if all then ok, err = pcall(function() fn(decode_args(args)) end) end
      if not ok then
        io.stderr:write(("luazero: rank %d: %s\n"):format(rank, tostring(err)))
        io.stderr:flush()
      end
    end
  end
end

return M
