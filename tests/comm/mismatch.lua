-- mismatch.lua — ranks that call different collectives (under the shm
-- launcher): every rank fails at the collective where they part, naming
-- both calls, and no rank returns a peer's data as if it were its own.
-- With a case named (under mpirun), that case alone: a rank that finds a
-- message of another collective fails, and the job ends. Each
-- case runs on a communicator of its own (a group of all ranks), since a
-- failure leaves a communicator unusable. Prints "case NAME ok" per case
-- on every rank, then "mismatch: all passed".
--   luazero -n W tests/comm/mismatch.lua
local ffi = require("ffi")
local lz = require("luazero")
local comm = require("luazero.comm")

local rank, W = comm.rank(), comm.size()
local function ranks()
  local t = {}
  for r = 0, W - 1 do t[#t + 1] = r end
  return t
end
local function vec(n, dtype)
  local t = lz.tensor({ n }, dtype)
  local p = ffi.cast("float *", t.data)
  if dtype == nil then for i = 0, n - 1 do p[i] = rank + 1 end end
  return t
end

-- run(g) makes the calls of this rank on group g; want: the words the
-- error must hold on every rank. With a case named (arg[1]: the mpi
-- backend, whose job a failed rank ends), that case alone, and its error
-- printed as it is.
local only = arg[1]
local function case(name, run, want)
  if only then
    if name ~= only then return end
    local ok, err = pcall(run, comm.world())
    print(ok and ("case " .. name .. ": rank " .. rank .. " returned without an error") or
          ("case " .. name .. ": " .. tostring(err)))
    os.exit(ok and 0 or 1)
  end
  local g = comm.group(ranks())
  local ok, err = pcall(run, g)
  if ok then error(name .. ": rank " .. rank .. " returned without an error") end
  err = tostring(err)
  for _, w in ipairs(want) do
    if not err:find(w, 1, true) then
      error(name .. ": rank " .. rank .. "'s error lacks '" .. w .. "': " .. err)
    end
  end
  -- the group is unusable after it: a later call says so
  local ok2, err2 = pcall(function() g:barrier() end)
  if ok2 or not tostring(err2):find("unusable", 1, true) then
    error(name .. ": the group stayed usable after the mismatch: " .. tostring(err2))
  end
  print("case " .. name .. " ok")
end

local last = W - 1
case("kind", function(g)
  if rank == last then g:all_gather(vec(4), vec(4 * W))
  else g:all_reduce(vec(4 * W), "sum") end
end, { "the ranks called different collectives", "all_reduce (sum) of " .. 4 * W .. " f32",
       "all_gather of " .. 4 * W .. " f32" })

case("count", function(g)
  g:all_reduce(vec(rank == last and 16 or 8), "sum")
end, { "all_reduce (sum) of 8 f32", "all_reduce (sum) of 16 f32" })

case("op", function(g)
  g:all_reduce(vec(8), rank == last and "max" or "sum")
end, { "all_reduce (max) of 8 f32", "all_reduce (sum) of 8 f32" })

case("root", function(g)
  g:broadcast(vec(8), rank == last and 0 or last)
end, { "broadcast of 8 f32 from rank 0", "broadcast of 8 f32 from rank " .. last })

-- A rank whose call moves nothing passes no barrier: its next call meets
-- the others' first one, and the call numbers say so.
case("skipped", function(g)
  g:all_reduce(vec(rank == last and 0 or 8), "sum")
  g:all_reduce(vec(8), "sum")
end, { "#1 is all_reduce", "#2 is all_reduce" })

case("save on one rank", function(g)
  if rank == 0 then g:all_gather(vec(4), vec(4 * W)) end -- a save's gather
  g:barrier()
end, { "barrier", "all_gather of " .. W * 4 .. " f32" })

comm.barrier()
print("mismatch: all passed")
