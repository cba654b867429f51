-- a2a_lua.lua — all-to-all and groups through luazero.comm (run by run.sh
-- under `luazero -n N` and mpirun, and by tests/lua/test_comm_a2a.lua):
-- all_to_all and all_to_all_v (uneven and zero counts, given offsets, host
-- and sim buffers) against values every rank can compute, a group's
-- collectives (its average over the world's size too), and the binding's
-- argument errors. Prints "a2a lua: all
-- passed (N ranks, backend)" on each rank, or FAIL lines and exits 1.
local lz = require("luazero")
local comm = require("luazero.comm")

lz.device_init("sim")
comm.init()
local rank, size = comm.rank(), comm.size()
local failures = 0

local function fail(msg)
  print(("FAIL rank %d: %s"):format(rank, msg))
  failures = failures + 1
end

local function expect(got, want, what)
  if got ~= want then fail(("%s: got %s, expected %s"):format(what, tostring(got), tostring(want))) end
end

-- What rank p puts at element i of its send buffer.
local function value(p, i) return p * 100000 + i end

-- all_to_all: 3 elements for each rank.
local send, recv = lz.tensor({ 3 * size }, "i32"), lz.tensor({ 3 * size }, "i32")
for i = 0, 3 * size - 1 do send:set(i, value(rank, i)) end
comm.all_to_all(send, recv)
for p = 0, size - 1 do
  for j = 0, 2 do expect(recv:get(3 * p + j), value(p, 3 * rank + j), "all_to_all from rank " .. p) end
end

-- all_to_all_v: (p + q) % 3 elements from p to q (zero for some pairs),
-- packed on the send side, each part at 10 * p on the receive side.
local function cnt(p, q) return (p + q) % 3 end
local function run_v(device, async)
  local sc, rc, ro, at = {}, {}, {}, 0
  local sent_before = {}
  for q = 0, size - 1 do
    sc[q + 1], rc[q + 1], ro[q + 1] = cnt(rank, q), cnt(q, rank), 10 * q
    sent_before[q] = at
    at = at + cnt(rank, q)
  end
  local s = lz.tensor({ math.max(at, 1) }, "f32")
  for i = 0, at - 1 do s:set(i, value(rank, i)) end
  local r = lz.tensor({ 10 * size }, "f32")
  r:fill(-1)
  if device == "sim" then s, r = s:to("sim"), r:to("sim") end
  local w = comm.all_to_all_v(s, sc, r, rc, async, nil, ro)
  if async then w:wait() end
  r = device == "sim" and r:to("cpu") or r
  for p = 0, size - 1 do
    local first = 0 -- where rank p's part for this rank starts in p's send buffer
    for q = 0, rank - 1 do first = first + cnt(p, q) end
    for j = 0, 9 do
      local want = j < cnt(p, rank) and value(p, first + j) or -1
      expect(r:get(10 * p + j), want, ("all_to_all_v %s from rank %d element %d"):format(device, p, j))
    end
  end
end
run_v("cpu", false)
run_v("cpu", true)
run_v("sim", false)

-- A group: even and odd ranks.
local mine = {}
for p = rank % 2, size - 1, 2 do mine[#mine + 1] = p end
local g = comm.group(mine)
expect(g:size(), #mine, "group size")
expect(g:rank(), math.floor(rank / 2), "group rank")
expect(table.concat(g:ranks(), ","), table.concat(mine, ","), "group ranks")
local t = lz.tensor({ 5 }, "f32")
t:fill(rank)
g:all_reduce(t, "sum")
local want = 0
for _, p in ipairs(mine) do want = want + p end
expect(t:get(4), want, "group all_reduce")
-- the group's part of the world's average: its sum over the world's size
-- (a float division: the double quotient rounded once to f32)
local f32 = function(x) return tonumber(require("ffi").new("float", x)) end
t:fill(rank)
g:all_reduce(t, "avg", false, size)
expect(t:get(4), f32(want / size), "group all_reduce averaged over the world")
local half = lz.tensor({ 2 * #mine }, "f32")
local piece = lz.tensor({ 2 }, "f32")
half:fill(rank)
g:reduce_scatter(half, piece, "avg", false, size)
expect(piece:get(1), f32(want / size), "group reduce_scatter averaged over the world")
half:free(); piece:free()
local bad_ok, bad = pcall(g.all_reduce, g, t, "sum", false, size)
if bad_ok or not tostring(bad):find("the average's divisor", 1, true) then
  fail("over with op sum: " .. tostring(bad))
end
local gs, gr = lz.tensor({ #mine }, "i32"), lz.tensor({ #mine }, "i32")
for i = 0, #mine - 1 do gs:set(i, rank * 10 + i) end
g:all_to_all(gs, gr)
for k, p in ipairs(mine) do expect(gr:get(k - 1), p * 10 + g:rank(), "group all_to_all from rank " .. p) end
g:free()
local ok, err = pcall(g.all_reduce, g, t)
if ok or not tostring(err):find("this group was freed", 1, true) then fail("a freed group still ran: " .. tostring(err)) end

-- The binding's argument errors.
local too_many = {}
for k = 1, size + 1 do too_many[k] = 0 end
ok, err = pcall(comm.all_to_all_v, send, too_many, recv, too_many)
if ok or not tostring(err):find("send_counts must be a list of " .. size .. " counts", 1, true) then
  fail("wrong-length counts: " .. tostring(err))
end
ok, err = pcall(comm.group, {})
if ok or not tostring(err):find("non-empty list", 1, true) then fail("empty group: " .. tostring(err)) end

lz.device_synchronize()
comm.barrier()
if failures > 0 then os.exit(1) end
print(("a2a lua: all passed (%d ranks, %s)"):format(size, comm.backend()))
