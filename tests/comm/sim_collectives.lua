-- sim_collectives.lua — collectives on sim device buffers (run by run.sh
-- under `luazero -n 2` and mpirun, with LZ_SIM_JITTER set): all_reduce,
-- reduce_scatter and all_gather, blocking and async, each with its input
-- written by device work queued just before the call, must give bitwise
-- what the same collective gives on host buffers; so must buffers half on
-- the host, half on sim. Prints "sim collectives: all passed" on each rank,
-- or FAIL lines and exits 1.
local lz = require("luazero")
local ffi = require("ffi")
local comm = require("luazero.comm")

lz.device_init("sim")
comm.init()
local rank, size = comm.rank(), comm.size()
local failures = 0

local function same(name, host, dev)
  local d = dev:device_name() == "sim" and dev:to("cpu") or dev
  if ffi.string(host.data, host:bytes()) ~= ffi.string(d.data, d:bytes()) then
    print(("FAIL %s: rank %d: the sim result differs from the host one"):format(name, rank))
    failures = failures + 1
  end
end

-- n values in [-1, 1) that differ per rank, as an f32 host tensor.
local function values(n, seed)
  local t = lz.tensor({ n }, "f32")
  local x = seed * 2654435761 % 4294967296
  for i = 0, n - 1 do
    x = (1103515245 * x + 12345) % 2147483648
    t:set(i, x / 1073741824 - 1)
  end
  return t
end

-- The same values in dtype dt on the host, and on sim written by device work
-- still queued on the compute stream when this returns (the collective must
-- wait for it).
local function inputs(n, dt, seed)
  local src = values(n, seed)
  local host = lz.tensor({ n }, dt)
  host:copy(src)
  local dsrc = src:to("sim")
  local dev = lz.tensor({ n }, dt, "comm", "sim")
  if dt == "f32" then
    dev:fill(0)
    lz.ops.axpy(dev, 1, dsrc) -- queued
  else
    dev:copy(dsrc) -- a conversion on the device: queued
  end
  return host, dev
end

local function run(op, async, a, b, c)
  local r
  if op == "all_reduce" then r = comm.all_reduce(a, b, async)
  elseif op == "all_gather" then r = comm.all_gather(a, b, async)
  else r = comm.reduce_scatter(a, b, c, async) end
  if async then r:wait() end
end

local n = 1000003
for _, dt in ipairs({ "f32", "bf16" }) do
  for _, async in ipairs({ false, true }) do
    local tag = ("%s %s"):format(dt, async and "async " or "")
    -- all_reduce, in place
    local h, d = inputs(n, dt, rank + 1)
    run("all_reduce", async, h, "sum")
    run("all_reduce", async, d, "sum")
    same(tag .. "all_reduce", h, d)
    -- reduce_scatter: full send, this rank's shard back
    local _, len = comm.shard(n)
    local hs, ds = inputs(n, dt, rank + 7)
    local hr, dr = lz.tensor({ len }, dt), lz.tensor({ len }, dt, "comm", "sim")
    run("reduce_scatter", async, hs, hr, "avg")
    run("reduce_scatter", async, ds, dr, "avg")
    same(tag .. "reduce_scatter", hr, dr)
    -- all_gather: this rank's shard in, the full buffer out
    local hg, dg = inputs(len, dt, rank + 13)
    local hf, df = lz.tensor({ n }, dt), lz.tensor({ n }, dt, "comm", "sim")
    run("all_gather", async, hg, hf)
    run("all_gather", async, dg, df)
    same(tag .. "all_gather", hf, df)
    -- mixed: host send, sim receive; sim send, host receive
    local hm = lz.tensor({ n }, dt, "comm", "sim")
    run("all_gather", async, hg, hm)
    same(tag .. "all_gather host to sim", hf, hm)
    local hr2 = lz.tensor({ len }, dt)
    local _, ds2 = inputs(n, dt, rank + 7)
    run("reduce_scatter", async, ds2, hr2, "avg")
    same(tag .. "reduce_scatter sim to host", hr, hr2)
    for _, t in ipairs({ h, d, hs, ds, hr, dr, hg, dg, hf, df, hm, hr2, ds2 }) do t:free() end
  end
end

lz.device_synchronize()
comm.barrier()
if failures > 0 then os.exit(1) end
print(("sim collectives: all passed (%d ranks, %s)"):format(size, comm.backend()))
