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
local bit = require("bit")
local ffi = require("ffi")
local lz = require("luazero")

local C, check = lz.C, lz.check

local comm = {}

local reduce_ops = { sum = C.LZ_RED_SUM, avg = C.LZ_RED_AVG, max = C.LZ_RED_MAX }
local kinds = { "all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier" }

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

-- Each returns its result tensor, or a handle (with :wait(), :test()) when
-- `async` is true.
function comm.all_reduce(t, op, async)
  tensor_arg(t, "comm.all_reduce", "t")
  local o, h = op_of(op, "comm.all_reduce"), get()
  return run(async, function(w) return C.lz_comm_all_reduce(h, t.data, t:numel(), t.dtype, o, w) end, t)
end

-- recv holds this rank's shard of send (comm.shard(send:numel())).
function comm.reduce_scatter(send, recv, op, async)
  tensor_arg(send, "comm.reduce_scatter", "send")
  tensor_arg(recv, "comm.reduce_scatter", "recv")
  local _, len = comm.shard(send:numel())
  if recv:numel() ~= len or recv.dtype ~= send.dtype then
    error(("comm.reduce_scatter: recv is %s; expected %d elements of send's dtype (this rank's shard of %s)")
          :format(recv:describe(), len, send:describe()), 2)
  end
  local o, h = op_of(op, "comm.reduce_scatter"), get()
  return run(async, function(w)
    return C.lz_comm_reduce_scatter(h, send.data, recv.data, send:numel(), send.dtype, o, w)
  end, recv, send)
end

-- send holds this rank's shard of recv (comm.shard(recv:numel())).
function comm.all_gather(send, recv, async)
  tensor_arg(send, "comm.all_gather", "send")
  tensor_arg(recv, "comm.all_gather", "recv")
  local _, len = comm.shard(recv:numel())
  if send:numel() ~= len or recv.dtype ~= send.dtype then
    error(("comm.all_gather: send is %s; expected %d elements of recv's dtype (this rank's shard of %s)")
          :format(send:describe(), len, recv:describe()), 2)
  end
  local h = get()
  return run(async, function(w)
    return C.lz_comm_all_gather(h, send.data, recv.data, recv:numel(), recv.dtype, w)
  end, recv, send)
end

function comm.broadcast(t, root, async)
  tensor_arg(t, "comm.broadcast", "t")
  local h = get()
  return run(async, function(w)
    return C.lz_comm_broadcast(h, t.data, t:numel(), t.dtype, root or 0, w)
  end, t)
end

function comm.barrier() check(C.lz_comm_barrier(get()), 2) end

return comm
