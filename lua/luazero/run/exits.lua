-- run/exits.lua — how the scripts (train, eval, generate) speak and stop:
-- rank 0's lines on stdout, and an error as one line on stderr ("train: ...",
-- no traceback; LZ_DEBUG=1 adds it to a rank's own) with exit status 2 for
-- bad input (flags, files, a configuration the engine refuses) or 1 for what
-- failed on one rank alone (a collective, a rank's memory or files).
local args = require("luazero.args")
local M = {}

-- ex = exits.new({ script = "train", ranks = true, hints = {...}, at_exit = fn }):
-- ranks: the launcher's RANK and WORLD_SIZE decide who prints (else rank 0 of
-- one); hints: { needle, advice } pairs, the advice added to a message that
-- holds the needle; at_exit(): a last line to print (rank 0) before exiting.
function M.new(opts)
  local ex = { rank = 0, world = 1 }
  local prefixed = false
  if opts.ranks then
    ex.rank = tonumber(os.getenv("RANK") or "0") or 0
    ex.world = tonumber(os.getenv("WORLD_SIZE") or "1") or 1
    -- luazero -n N prefixes every line of ranks other than 0 with "[rank N] ".
    prefixed = os.getenv("LZ_SHM_NAME") ~= nil and os.getenv("LZ_RANK_OUTPUT") ~= "raw"
  end
  local hints = opts.hints or {}
  local head = opts.script .. ": %s\n"

  -- An error's one line: without the Lua location some messages carry, with
  -- a hint where one applies.
  local function one_line(msg)
    msg = tostring(msg):gsub("^[^%s:]+%.lua:%d+: ", "")
    -- a library's message that names the script already: "generate: generate: ..." once
    if msg:sub(1, #opts.script + 2) == opts.script .. ": " then msg = msg:sub(#opts.script + 3) end
    for _, h in ipairs(hints) do
      if msg:find(h[1], 1, true) then msg = msg .. "; " .. h[2] end
    end
    return msg
  end

  -- Exit status 2 (bad input) or `code`. An error every rank meets alike is
  -- shown by rank 0; a rank's own (a message starting "rank R: ", from a
  -- collective that failed there) by that rank. Under several ranks, another
  -- rank's error that may be its alone is shown after a second unless rank 0
  -- has stopped the job by then (the launcher stops the others half a second
  -- after the first rank fails).
  function ex.fail(msg, code, alone)
    msg = one_line(msg)
    local own = tonumber(msg:match("^rank (%d+): "))
    if own == ex.rank and prefixed then msg = msg:gsub("^rank %d+: ", "") end
    -- one write: the launcher relays other ranks' lines between ours
    if ex.rank == 0 or own == ex.rank then
      io.stderr:write(head:format(msg))
    elseif alone and ex.world > 1 and not own and not msg:find("failed on rank", 1, true) then
      require("luazero.clock").sleep(1)
      io.stderr:write(head:format(msg))
    end
    local line = opts.at_exit and opts.at_exit()
    if line and ex.rank == 0 then io.stderr:write(head:format(line)) end
    io.stderr:flush()
    -- A pointer to another rank's error: that rank, the cause, exits first,
    -- so `luazero -n N` returns its status (the launcher's first to fail;
    -- it stops the other ranks half a second after, this one among them,
    -- however loaded the machine). Under another launcher, a short wait.
    if ex.world > 1 and msg:find("failed on rank", 1, true) then
      require("luazero.clock").sleep(os.getenv("LZ_SHM_NAME") and 10 or 0.3)
    end
    -- luazero -i: the REPL after a script that stops here, as after one that
    -- raises (lua/main.c), then the exit status
    if rawget(_G, "LUAZERO_INTERACTIVE") then
      local ok, why = pcall(function() require("luazero.ui.repl").run({ script_failed = true }) end)
      if not ok then io.stderr:write(head:format(tostring(why))) end
      io.stdout:flush()
    end
    os.exit(code or 2)
  end

  function ex.user_error(msg) ex.fail(msg, 2) end

  -- Runs fn, turning any error it raises into a user error.
  function ex.checked(fn, ...) return args.checked(ex.user_error, fn, ...) end

  -- Runs fn, a write of an output: its failure (a full disk) is the run's,
  -- not the input's, so exit status 1.
  function ex.checked_write(fn, ...)
    local res = { pcall(fn, ...) }
    if not res[1] then ex.fail(res[2], 1) end
    return unpack(res, 2, table.maxn(res))
  end

  -- Runs fn, whose errors may be one rank's alone: exit status 1; with
  -- LZ_DEBUG=1, with their traceback.
  local debug_on = (os.getenv("LZ_DEBUG") or "0") ~= "0" and os.getenv("LZ_DEBUG") ~= ""
  function ex.checked_rank(fn, ...)
    local res = { xpcall(fn, debug_on and debug.traceback or tostring, ...) }
    if not res[1] then
      -- Out of device memory is the configuration's to fix, as is what the
      -- engine refuses to build ("initialize: ...") and a checkpoint shard
      -- whose bytes fail their hash (another try reads the same): exit 2, as
      -- bad input.
      local msg = tostring(res[2])
      local bad = msg:find("out of device memory", 1, true) or msg:find("^initialize: ") or
                  msg:find("the shard is damaged", 1, true)
      ex.fail(res[2], bad and 2 or 1, true)
    end
    return unpack(res, 2, table.maxn(res))
  end

  function ex.say(...)
    if ex.rank == 0 then
      print(...)
      io.stdout:flush()
    end
  end

  return ex
end

return M
