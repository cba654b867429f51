-- run/outputs.lua — where the scripts write, checked before any work: a
-- path a run would empty that is one of its inputs, a folder --save cannot
-- create, write or fill, a file that cannot be opened; and the --log file,
-- written one checked record at a time. ex: a luazero.run.exits.
local ffi = require("ffi")
local cjson = require("cjson")
local lz = require("luazero")
local M = {}

local function cannot_write(flag, path, why)
  return ("%s %s: cannot write it (%s)"):format(flag, path, why)
end

-- Whether `path` could be written (io/atomic.lua's temporary beside it made
-- and removed; the file itself untouched); nil and the reason when not.
function M.writable(path)
  local ok, err = pcall(function() require("luazero.io.atomic").open(path):abort() end)
  if ok then return true end
  return nil, tostring(err):match("%((.-)%)") or tostring(err)
end

-- The records of a metrics log a run resumed at step `first` keeps: those
-- of earlier steps (and a restart's record from before them), not the end
-- record nor the steps the resumed run trains again.
local function kept_before(line, first)
  local ok, rec = pcall(cjson.decode, line)
  if not ok or type(rec) ~= "table" or rec.event == "end" then return false end
  local at = rec.step or rec.resumed_from_step
  return at == nil or (type(at) == "number" and at < first)
end

-- JSON has no NaN or inf: a record's numbers that are not finite (a
-- diverged step's loss) are written null rather than stopping the write.
local json_line = cjson.new()
json_line.encode_invalid_numbers("null")

-- --log FILE: one write per record, checked; a failed one is cut back to
-- the last complete record, so the file stays JSON Lines, and stops the run
-- (exit 1). append: a resumed or restarted run adds to the file, once
-- keep_before(first) has cut it back to the steps before its first.
function M.open_log(ex, path, append)
  local jsonl = require("luazero.jsonl")
  local log, err = jsonl.open(path, { append = append })
  if not log then ex.user_error(cannot_write("--log", path, err)) end
  return {
    write = function(rec, what)
      local ok, werr = log:write(json_line.encode(rec) .. "\n")
      if not ok then
        ex.fail(("--log %s: writing %s failed (%s); the file ends at the record before it; " ..
                 "free space there or log elsewhere"):format(path, what, werr), 1)
      end
    end,
    keep_before = function(first)
      log:close()
      local kept, dropped = {}, 0
      for line in io.lines(path) do
        if kept_before(line, first) then kept[#kept + 1] = line .. "\n"
        else dropped = dropped + 1 end
      end
      if dropped > 0 then
        local ok, werr = pcall(function()
          local w = require("luazero.io.atomic").open(path)
          w:write(table.concat(kept))
          w:commit()
        end)
        if not ok then ex.fail(("--log %s: %s"):format(path, tostring(werr)), 1) end
      end
      log = jsonl.open(path, { append = true })
      if not log then ex.fail(cannot_write("--log", path, "reopening it"), 1) end
      return #kept, dropped
    end,
    close = function() log:close() end,
  }
end

-- A file written at the end (--profile-json): an unwritable path fails
-- before the steps; an earlier file stays as it is until then.
function M.check_writable(ex, flag, path)
  local ok, err = M.writable(path)
  if not ok then
    ex.user_error(("%s: cannot write %s (%s); give a path in a writable folder")
                  :format(flag, path, err))
  end
end

-- --save DIR: everything a save will need, before step 1 (a run with
-- --save-every 0 saves only at its end): a folder that can be created and
-- written, no other run saving there (checkpoint/lock.lua), free space for
-- one checkpoint (fp32 master, Adam m and v: 12 bytes a parameter). Every
-- rank checks, so all stop alike. (The zstd
-- level's range is declared with its flag.)
pcall(ffi.cdef, "int getpid(void);")
function M.check_save_target(ex, flags, n_params, cfg)
  if not flags.save then return end
  local dir = flags.save:gsub("(.)/+$", "%1")
  -- The folders mkdir -p makes (deepest first): removed again when the
  -- folder is refused, so a refused --save leaves nothing behind.
  local exists = require("luazero.io.fs").exists
  local made_dirs, there = {}, dir
  while not exists(there) do
    made_dirs[#made_dirs + 1] = there
    local up = there:match("^(.*)/[^/]*$")
    there = up and (up == "" and "/" or up) or "."
  end
  local function refuse(msg)
    -- (a folder made here goes whole: the lock a claim left in it too)
    if #made_dirs > 0 then
      require("luazero.checkpoint.lock").release(dir)
      os.remove(dir .. "/.lock")
    end
    for _, d in ipairs(made_dirs) do os.remove(d) end
    ex.user_error(msg)
  end
  local made, why = lz.mkdir(dir)
  if not made then refuse(("--save %s: %s"):format(dir, (why:gsub("^checkpoint: ", "")))) end
  local probe = ("%s/.write-check-%d-%d"):format(dir, ex.rank, tonumber(ffi.C.getpid()))
  local wrote, err = M.writable(probe)
  if not wrote then
    refuse(("--save %s: cannot write in it (%s); give a writable folder"):format(dir,
           err))
  end
  -- Rank 0 claims the folder now (another run saving there is refused
  -- before step 1) and clears what dead saves left, so the space they held
  -- counts as free.
  if ex.rank == 0 then
    local ok, claim_err = pcall(require("luazero.checkpoint.save").claim, dir)
    if not ok then ex.user_error(tostring(claim_err):gsub("^checkpoint: ", "--save ")) end
  end
  local free = require("luazero.io.fs").free_bytes(dir)
  if free then
    -- (a 16-bit export beside each checkpoint: 4 bytes a parameter of
    -- scratch and 2 of output more)
    local per = 12
    if cfg and cfg.zero_optimization.gather_16bit_weights_on_model_save then per = 18 end
    local need = n_params * per + 2 ^ 20
    if free < need then
      refuse(("--save %s: %.1f MiB free, one checkpoint needs about %.1f MiB (%d parameters " ..
              "x %d bytes%s); free space there or save elsewhere")
             :format(dir, free / 2 ^ 20, need / 2 ^ 20, n_params, per, per > 12 and
                     ", its 16-bit export included" or ""))
    end
  end
end

return M
