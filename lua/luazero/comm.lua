-- luazero.comm — collectives on tensors for scripts. One communicator per
-- process, made on first use from the environment (the automatic choice;
-- LZ_BACKEND overrides), or explicitly with comm.init(NAME), NAME one of
-- comm.backends() (the C table, core/comm/backends.c) or "auto".
--
--   local comm = require("luazero.comm")
--   comm.all_reduce(grads, "avg")                  -- in place, blocking
--   local w = comm.all_reduce(grads, "sum", true)  -- asynchronous: w:wait()
--   comm.reduce_scatter(full, shard, "sum")        -- shard = comm.shard(numel)
--   comm.all_gather(shard, full)
--   comm.broadcast(t, 0); comm.barrier()
--   comm.mean(x)                                   -- a number's mean over the ranks
--   comm.numbers({ a, b })                         -- every rank's numbers, on every rank
--   comm.all_to_all(send, recv)                    -- send:numel() / size() to each rank
--   comm.all_to_all_v(send, { 3, 0 }, recv, { 2, 5 }) -- elements to / from each rank
--   local g = comm.group({ 0, 1 })                 -- ranks of this communicator
--   g:all_reduce(t); g:all_to_all_v(...); g:free() -- every collective, on the group
--   g:reduce_scatter(full, shard, "avg", false, 4) -- the group's part of a 4-rank average
-- comm.world() is the process's communicator as such an object (comm.X(...)
-- is comm.world():X(...)), for code that takes a communicator or a group.
local bit = require("bit")
local ffi = require("ffi")
local lz = require("luazero")

local C, check = lz.C, lz.check

local comm = {}

local reduce_ops = { sum = C.LZ_RED_SUM, avg = C.LZ_RED_AVG, max = C.LZ_RED_MAX }
local kinds = { "all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier", "all_to_all" }

local handle -- lz_comm *, freed by comm.finalize() or when the Lua state closes

-- The backends this build knows, in the table's order: a list of
-- { name =, about =, available = bool, moves = { [device name] = bool } }.
function comm.backends()
  local t = {}
  for i = 0, C.lz_comm_backend_count() - 1 do
    local bits, moves = C.lz_comm_backend_moves_at(i), {}
    for name, dev in pairs(lz.devices) do
      moves[name] = bit.band(bits, bit.lshift(1, tonumber(dev))) ~= 0
    end
    t[#t + 1] = {
      name = ffi.string(C.lz_comm_backend_name_at(i)),
      about = ffi.string(C.lz_comm_backend_about_at(i)),
      available = C.lz_comm_backend_available_at(i) ~= 0,
      moves = moves,
    }
  end
  return t
end

function comm.init(backend)
  -- The name is checked even when a communicator is up: a bad one is always refused.
  if backend ~= nil and type(backend) ~= "string" then
    error("comm.init: backend must be a name (got " .. type(backend) .. ")", 2)
  end
  local b = ffi.new("lz_comm_backend[1]")
  if C.lz_comm_backend_parse(backend or "auto", b) ~= 0 then
    error("comm.init: " .. lz.last_error(), 2)
  end
  if handle ~= nil then return comm end
  local out = ffi.new("lz_comm *[1]")
  check(C.lz_comm_init(out, b[0]), 2)
  handle = ffi.gc(out[0], C.lz_comm_free)
  return comm
end

local function get()
  if handle == nil then comm.init() end
  return handle
end

function comm.finalize()
  if handle ~= nil then
    local h = handle
    handle = nil
    ffi.gc(h, nil)
    check(C.lz_comm_free(h), 2)
  end
end

function comm.rank() return C.lz_comm_rank(get()) end
function comm.size() return C.lz_comm_size(get()) end
function comm.backend() return ffi.string(C.lz_comm_backend_name(get())) end

-- This rank's (or `rank`'s) shard of `count` elements: offset (0-based), length.
function comm.shard(count, rank)
  local off, len = ffi.new("int64_t[1]"), ffi.new("int64_t[1]")
  C.lz_comm_shard(count, comm.size(), rank or comm.rank(), off, len)
  return tonumber(off[0]), tonumber(len[0])
end

-- Bytes this rank sent, per kind (nccl-tests bus volume, see luazero.h).
function comm.bytes()
  local h, t = get(), {}
  for i, k in ipairs(kinds) do t[k] = tonumber(C.lz_comm_bytes(h, i - 1)) end
  return t
end
function comm.bytes_reset() C.lz_comm_bytes_reset(get()) end

------------------------------------------------------------------ handles

local Work = {}
Work.__index = Work

-- Waits for the operation; returns its first tensor. The tensors stay
-- referenced by the handle until then, so the collector cannot free them.
function Work:wait()
  if self.ptr ~= nil then
    local p = self.ptr
    self.ptr = nil
    check(C.lz_work_wait(p), 2)
  end
  return self.keep[1]
end

function Work:test()
  if self.ptr == nil then return true end
  local done = ffi.new("int[1]")
  check(C.lz_work_test(self.ptr, done), 2)
  return done[0] ~= 0
end

local work_out = ffi.typeof("lz_work *[1]")

local function run(async, f, ...)
  if not async then
    check(f(nil), 3)
    return (...)
  end
  local out = work_out()
  check(f(out), 3)
  return setmetatable({ ptr = out[0], keep = { ... } }, Work)
end

local function op_of(op, fn)
  local v = reduce_ops[op or "sum"]
  if v == nil then error(fn .. ": unknown reduce op '" .. tostring(op) .. "' (sum, avg, max)", 3) end
  return v
end

local function tensor_arg(t, fn, name)
  if not lz.is_tensor(t) then error(fn .. ": " .. name .. " must be a tensor", 3) end
  return t
end

-------------------------------------------------------------- collectives

-- A communicator: the process's one (comm.world()) or a group of its ranks
-- (comm.group). Each collective returns its result tensor, or a handle
-- (with :wait(), :test()) when `async` is true.
local Comm = {}
Comm.__index = Comm

function Comm:handle()
  if self.get then return self.get() end
  if self.ptr == nil then error("comm: this group was freed", 3) end
  return self.ptr
end

-- Bytes this rank sent in this group, per kind (as comm.bytes).
function Comm:bytes()
  local h, t = self:handle(), {}
  for i, k in ipairs(kinds) do t[k] = tonumber(C.lz_comm_bytes(h, i - 1)) end
  return t
end

function Comm:rank() return C.lz_comm_rank(self:handle()) end
function Comm:size() return C.lz_comm_size(self:handle()) end

-- This rank's (or `rank`'s) shard of `count` elements: offset (0-based), length.
function Comm:shard(count, rank)
  local off, len = ffi.new("int64_t[1]"), ffi.new("int64_t[1]")
  C.lz_comm_shard(count, self:size(), rank or self:rank(), off, len)
  return tonumber(off[0]), tonumber(len[0])
end

-- The ranks of the parent communicator this one's ranks are (1-based list).
function Comm:ranks()
  local h, t = self:handle(), {}
  for r = 0, C.lz_comm_size(h) - 1 do t[#t + 1] = C.lz_comm_parent_rank(h, r) end
  return t
end

-- over (optional, op "avg" only): the number of ranks the average divides
-- by, when it is not this communicator's size — a group's part of its
-- parent's average, the sum divided before its one rounding, so the bits
-- are the parent's avg where the other ranks add zeros.
local function over_of(op, over, fn)
  if over == nil then return nil end
  if op ~= "avg" or type(over) ~= "number" or over < 1 or over % 1 ~= 0 then
    error(("%s: over (%s) is the average's divisor: a whole number >= 1, with op \"avg\" (got op %s)")
          :format(fn, tostring(over), tostring(op)), 3)
  end
  return over
end

function Comm:all_reduce(t, op, async, over)
  tensor_arg(t, "comm.all_reduce", "t")
  local o, h = op_of(op, "comm.all_reduce"), self:handle()
  local n = over_of(op, over, "comm.all_reduce")
  if n then
    return run(async, function(w)
      return C.lz_comm_all_reduce_avg_over(h, t.data, t:numel(), t.dtype, n, w)
    end, t)
  end
  return run(async, function(w) return C.lz_comm_all_reduce(h, t.data, t:numel(), t.dtype, o, w) end, t)
end

-- recv holds this rank's shard of send (comm.shard(send:numel())); over as
-- in all_reduce.
function Comm:reduce_scatter(send, recv, op, async, over)
  tensor_arg(send, "comm.reduce_scatter", "send")
  tensor_arg(recv, "comm.reduce_scatter", "recv")
  local _, len = self:shard(send:numel())
  if recv:numel() ~= len or recv.dtype ~= send.dtype then
    error(("comm.reduce_scatter: recv is %s; expected %d elements of send's dtype (this rank's shard of %s)")
          :format(recv:describe(), len, send:describe()), 2)
  end
  local o, h = op_of(op, "comm.reduce_scatter"), self:handle()
  local n = over_of(op, over, "comm.reduce_scatter")
  return run(async, function(w)
    if n then
      return C.lz_comm_reduce_scatter_avg_over(h, send.data, recv.data, send:numel(), send.dtype,
                                               n, w)
    end
    return C.lz_comm_reduce_scatter(h, send.data, recv.data, send:numel(), send.dtype, o, w)
  end, recv, send)
end

-- send holds this rank's shard of recv (comm.shard(recv:numel())).
function Comm:all_gather(send, recv, async)
  tensor_arg(send, "comm.all_gather", "send")
  tensor_arg(recv, "comm.all_gather", "recv")
  local _, len = self:shard(recv:numel())
  if send:numel() ~= len or recv.dtype ~= send.dtype then
    error(("comm.all_gather: send is %s; expected %d elements of recv's dtype (this rank's shard of %s)")
          :format(send:describe(), len, recv:describe()), 2)
  end
  local h = self:handle()
  return run(async, function(w)
    return C.lz_comm_all_gather(h, send.data, recv.data, recv:numel(), recv.dtype, w)
  end, recv, send)
end

function Comm:broadcast(t, root, async)
  tensor_arg(t, "comm.broadcast", "t")
  local h = self:handle()
  return run(async, function(w)
    return C.lz_comm_broadcast(h, t.data, t:numel(), t.dtype, root or 0, w)
  end, t)
end

function Comm:barrier() check(C.lz_comm_barrier(self:handle()), 2) end

-- Every rank's numbers `vals` (a list, as many on every rank), gathered on
-- every rank as doubles: all[r + 1][i] is rank r's vals[i].
function Comm:numbers(vals)
  local K, W = #vals, self:size()
  -- (a double as two i32s: no f64 tensors)
  local send = lz.tensor({ 2 * K }, "i32", "workspace")
  local recv = lz.tensor({ 2 * K * W }, "i32", "workspace")
  local d = ffi.cast("double *", send.data)
  for i = 1, K do d[i - 1] = vals[i] end
  self:all_gather(send, recv)
  local a, all = ffi.cast("double *", recv.data), {}
  for r = 0, W - 1 do
    all[r + 1] = {}
    for i = 1, K do all[r + 1][i] = a[r * K + i - 1] end
  end
  send:free(); recv:free()
  return all
end

-- The mean over the ranks of the number x each holds, summed in rank order
-- (every rank gets the same bits).
function Comm:mean(x)
  local sum = 0
  for _, v in ipairs(self:numbers({ x })) do sum = sum + v[1] end
  return sum / self:size()
end

-- send and recv of the same numel and dtype, a multiple of size(): the
-- k-th 1/size() of send goes to rank k, the k-th of recv comes from it.
function Comm:all_to_all(send, recv, async)
  tensor_arg(send, "comm.all_to_all", "send")
  tensor_arg(recv, "comm.all_to_all", "recv")
  local n, W = send:numel(), self:size()
  if recv:numel() ~= n or recv.dtype ~= send.dtype or n % W ~= 0 then
    error(("comm.all_to_all: send is %s and recv %s; both need the same dtype and numel, a multiple of the %d ranks")
          :format(send:describe(), recv:describe(), W), 2)
  end
  local h = self:handle()
  return run(async, function(w)
    return C.lz_comm_all_to_all(h, send.data, recv.data, n / W, send.dtype, w)
  end, recv, send)
end

-- counts: a list of size() element counts; offsets (optional): where each
-- rank's part starts (0-based), else the parts one after another. Returns
-- the int64 arrays and the elements they reach.
local function counts_arg(counts, offsets, W, fn, name)
  if type(counts) ~= "table" or #counts ~= W then
    error(("%s: %s_counts must be a list of %d counts, one per rank"):format(fn, name, W), 3)
  end
  local c, o, reach, at = ffi.new("int64_t[?]", W), ffi.new("int64_t[?]", W), 0, 0
  for k = 1, W do
    local n, off = counts[k], offsets and offsets[k] or at
    if type(n) ~= "number" or n < 0 or n % 1 ~= 0 or type(off) ~= "number" or off < 0 or off % 1 ~= 0 then
      error(("%s: %s_counts[%d] = %s, offset %s: counts and offsets are whole numbers >= 0")
            :format(fn, name, k, tostring(n), tostring(off)), 3)
    end
    c[k - 1], o[k - 1] = n, off
    at = off + n
    if n > 0 and at > reach then reach = at end
  end
  return c, o, reach
end

-- The token exchange of expert parallelism: send_counts[k] elements to rank
-- k - 1, recv_counts[k] from it (1-based lists of size() entries), at the
-- offsets given or packed. Every rank calls it, with zeros where it has
-- nothing; counts that two ranks disagree on fail on every rank.
function Comm:all_to_all_v(send, send_counts, recv, recv_counts, async, send_offsets, recv_offsets)
  tensor_arg(send, "comm.all_to_all_v", "send")
  tensor_arg(recv, "comm.all_to_all_v", "recv")
  local W, fn = self:size(), "comm.all_to_all_v"
  local sc, so, sreach = counts_arg(send_counts, send_offsets, W, fn, "send")
  local rc, ro, rreach = counts_arg(recv_counts, recv_offsets, W, fn, "recv")
  if recv.dtype ~= send.dtype or sreach > send:numel() or rreach > recv:numel() then
    error(("comm.all_to_all_v: send is %s and recv %s; they need one dtype and at least %d and %d elements")
          :format(send:describe(), recv:describe(), sreach, rreach), 2)
  end
  local h = self:handle()
  return run(async, function(w)
    return C.lz_comm_all_to_all_v(h, send.data, sc, so, recv.data, rc, ro, send.dtype, w)
  end, recv, send)
end

-- A group of this communicator's ranks (0-based), collective: every rank
-- calls it with the list of the group it joins. Free groups before their
-- parent (g:free(), or the collector).
function Comm:group(ranks)
  if type(ranks) ~= "table" or #ranks == 0 then
    error("comm.group: ranks must be a non-empty list of ranks (0-based)", 2)
  end
  local list = ffi.new("int[?]", #ranks)
  for i, r in ipairs(ranks) do
    if type(r) ~= "number" or r % 1 ~= 0 then
      error(("comm.group: ranks[%d] = %s is not a rank"):format(i, tostring(r)), 2)
    end
    list[i - 1] = r
  end
  local out = ffi.new("lz_comm *[1]")
  check(C.lz_comm_group_new(self:handle(), list, #ranks, out), 2)
  return setmetatable({ ptr = ffi.gc(out[0], C.lz_comm_free), parent = self }, Comm)
end

function Comm:free()
  if self.get then error("comm: free the process's communicator with comm.finalize()", 2) end
  if self.ptr ~= nil then
    local p = self.ptr
    self.ptr = nil
    ffi.gc(p, nil)
    check(C.lz_comm_free(p), 2)
  end
end

-- The process's communicator as an object; comm.X(...) is comm.world():X(...).
local world = setmetatable({ get = get }, Comm)
function comm.world() return world end

for _, name in ipairs({ "all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all",
                        "all_to_all_v", "group", "ranks", "mean", "numbers" }) do
  local method = Comm[name]
  comm[name] = function(...) return method(world, ...) end
end
function comm.barrier() check(C.lz_comm_barrier(get()), 2) end

return comm
