-- luazero — the Lua package: the FFI binding of core/luazero.h, tensors,
-- the ledger, the arena, and the kernels as Lua functions. Submodules
-- (nn, optim, comm, ...) are required by name: require("luazero.nn"); the
-- binding sits below them all and loads none of them.
local ffi = require("ffi")

local lz = {}

ffi.cdef(require("luazero.cdef"))

-- This file's folder tells the repository root (lua/luazero/init.lua).
local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "."
lz.root = rawget(_G, "LUAZERO_ROOT") or (here .. "/../..")

-- Inside the luazero executable the library's symbols are already loaded;
-- from a plain luajit, find libluazero.so on package.cpath or under build/.
local function load_library()
  if pcall(function() return ffi.C.lz_version end) then return ffi.C end
  local path = package.searchpath("libluazero", package.cpath)
  if not path then
    path = lz.root .. "/build/lib/libluazero.so"
    local f = io.open(path, "rb")
    if not f then
      error("luazero: cannot find libluazero.so: build it (tools/test or make -C build) " ..
            "or add its folder to LUA_CPATH (e.g. LUA_CPATH='build/lib/?.so')", 0)
    end
    f:close()
  end
  return ffi.load(path)
end

local C = load_library()
lz.C = C
-- Elements per block of the gradient norm's partials (lz_sq_norm_blocks:
-- one double per block, NaN where no kernel took it).
lz.SQ_NORM_BLOCK = tonumber(C.lz_sq_norm_block_size())
lz.ffi = ffi

function lz.version() return ffi.string(C.lz_version()) end

-- A failing status becomes a Lua error carrying the C message.
local function check(st, level)
  if st ~= 0 then error(ffi.string(C.lz_last_error()), (level or 1) + 1) end
end
lz.check = check
function lz.last_error() return ffi.string(C.lz_last_error()) end

-------------------------------------------------------------------- dtypes

local dtypes = { f32 = C.LZ_F32, bf16 = C.LZ_BF16, f16 = C.LZ_F16, i32 = C.LZ_I32, u16 = C.LZ_U16,
                 u8 = C.LZ_U8 }
local dtype_names = {}
for k, v in pairs(dtypes) do dtype_names[tonumber(v)] = k end
lz.dtypes = dtypes

local categories = {
  params = C.LZ_MEM_PARAMS, grads = C.LZ_MEM_GRADS, optimizer = C.LZ_MEM_OPTIMIZER,
  activations = C.LZ_MEM_ACTIVATIONS, comm = C.LZ_MEM_COMM, offload = C.LZ_MEM_OFFLOAD,
  workspace = C.LZ_MEM_WORKSPACE,
}
lz.categories = categories
lz.category_order = { "params", "grads", "optimizer", "activations", "comm", "offload",
                      "workspace" }

local function dtype_of(d)
  if d == nil then return C.LZ_F32 end
  local v = dtypes[d]
  if v == nil then
    error("luazero: unknown dtype '" .. tostring(d) .. "' (f32, bf16, f16, i32, u16, u8)", 3)
  end
  return v
end

local function category_of(c)
  if c == nil then return C.LZ_MEM_WORKSPACE end
  local v = categories[c]
  if v == nil then
    error("luazero: unknown memory category '" .. tostring(c) ..
          "' (params, grads, optimizer, activations, comm, offload, workspace)", 3)
  end
  return v
end

local guard = require("luazero.tensor_guard")
local dead, gone, live, whole_in = guard.dead, guard.gone, guard.live, guard.whole_in

-- A shape table as the C int64_t[4], checked (tensor_guard.lua) for dtype dt.
local function shape_array(shape, dt)
  shape = guard.shape(shape, tonumber(C.lz_dtype_size(dt)), ffi.string(C.lz_dtype_name(dt)), 4)
  return ffi.new("int64_t[4]", shape), #shape
end

------------------------------------------------------------------- tensors

local Tensor = {}
Tensor.__index = Tensor

local tensor_ptr = ffi.typeof("lz_tensor *")
local tensor_out = ffi.typeof("lz_tensor *[1]")

-- A tensor the library allocated; ffi.gc frees it if the script forgets.
local function own(t) return ffi.gc(t, C.lz_tensor_free) end

-- Devices: "cpu", and the process's one accelerator, "sim" or "cuda".
local devices = { cpu = C.LZ_CPU, cuda = C.LZ_CUDA, sim = C.LZ_SIM }
local device_names = { [tonumber(C.LZ_CPU)] = "cpu", [tonumber(C.LZ_CUDA)] = "cuda",
                       [tonumber(C.LZ_SIM)] = "sim" }
lz.devices = devices

local function device_of(d, what)
  if d == nil then return C.LZ_CPU end
  local v = devices[d]
  if v == nil then
    error(("luazero: %s: device %q is not \"cpu\", \"sim\" or \"cuda\""):format(
      what or "tensor", tostring(d)), 3)
  end
  return v
end

local float_dtypes = { [tonumber(C.LZ_F32)] = true, [tonumber(C.LZ_BF16)] = true,
                       [tonumber(C.LZ_F16)] = true }

-- lz.tensor(shape, dtype, category, device): zero-filled. device "cpu"
-- (default), "sim" or "cuda" (after lz.device_init: device memory, on the
-- ledger's device side, zeroed on the device before it returns).
function lz.tensor(shape, dtype, category, device)
  local dev, dt = device_of(device), dtype_of(dtype)
  local dims, nd = shape_array(shape, dt)
  local out = tensor_out()
  if dev == C.LZ_CPU then
    check(C.lz_tensor_new(out, dt, nd, dims, category_of(category)), 2)
    local t = own(out[0])
    ffi.fill(t.data, C.lz_tensor_bytes(t))
    return t
  end
  check(C.lz_tensor_new_on(out, dt, nd, dims, category_of(category), dev), 2)
  local t = own(out[0])
  -- Zeroed (t:zero), then waited for: the zeros are there for work on any
  -- stream (a copy on the copy stream is not ordered after the fill).
  t:zero()
  check(C.lz_stream_synchronize(C.LZ_STREAM_COMPUTE), 2)
  return t
end

-- lz.pinned(shape, dtype): a zero-filled host tensor in pinned memory
-- (category offload, host side of the ledger) for copies to and from the
-- device; without an accelerator, an ordinary offload tensor.
function lz.pinned(shape, dtype)
  if C.lz_cuda_ready() == 0 and C.lz_sim_ready() == 0 then
    return lz.tensor(shape, dtype, "offload")
  end
  local dt = dtype_of(dtype)
  local dims, nd = shape_array(shape, dt)
  local out = tensor_out()
  check(C.lz_tensor_new_pinned(out, dt, nd, dims), 2)
  local t = own(out[0])
  ffi.fill(t.data, C.lz_tensor_bytes(t))
  return t
end

local store -- below, with Tensor:set

-- lz.from_table({1, 2, 3, ...}, shape, dtype): shape defaults to {#values}.
function lz.from_table(values, shape, dtype, category)
  if type(values) ~= "table" then
    error(("luazero: from_table: values is a %s; give a table of numbers"):format(type(values)), 2)
  end
  local t = lz.tensor(shape or { #values }, dtype, category)
  local n = t:numel()
  if #values ~= n then
    t:free()
    error(("luazero: from_table: %d values for a tensor of %d elements"):format(#values, n), 2)
  end
  for i = 1, n do store(t, i - 1, values[i], "from_table") end
  return t
end

function lz.is_tensor(x) return ffi.istype(tensor_ptr, x) end

function Tensor:numel() return tonumber(C.lz_tensor_numel(live(self, "numel"))) end
function Tensor:bytes() return tonumber(C.lz_tensor_bytes(live(self, "bytes"))) end
function Tensor:dtype_name() return dtype_names[tonumber(live(self, "dtype_name").dtype)] end
function Tensor:dim(i)
  return tonumber(self.shape[whole_in(live(self, "dim"), "dim", "dimension", i, 1, self.ndim) - 1])
end

function Tensor:sizes()
  local s = {}
  for i = 0, live(self, "sizes").ndim - 1 do s[i + 1] = tonumber(self.shape[i]) end
  return s
end

function Tensor:describe()
  local buf = ffi.new("char[128]")
  return ffi.string(C.lz_tensor_describe(live(self, "describe"), buf, 128))
end

function Tensor:device_name()
  return device_names[tonumber(live(self, "device_name").device)] or "unknown"
end

-- Scripts read and write elements of host tensors only: device memory
-- faults when the host touches it (sim) or is not there (cuda).
local function host_only(t, what, writes)
  live(t, what, 4)
  if t.device ~= C.LZ_CPU then
    error(("luazero: %s of a %s tensor %s: device memory is not %s from the host; copy it " ..
           "first (t:to(\"cpu\"))"):format(what, t:device_name(), t:describe(),
                                         writes and "writable" or "readable"), 3)
  end
end

-- A copy on `device` ("cpu", "sim" or "cuda"), same dtype and shape.
function Tensor:to(device)
  local t = lz.tensor(live(self, "to"):sizes(), self:dtype_name(), "workspace", device)
  check(C.lz_tensor_copy(t, self), 2)
  return t
end

-- Element i (0-based, flat) as a Lua number.
function Tensor:get(i)
  host_only(self, "get")
  i = whole_in(self, "get", "index", i, 0, tonumber(C.lz_tensor_numel(self)) - 1)
  local dt = self.dtype
  if dt == C.LZ_F32 then return ffi.cast("float *", self.data)[i]
  elseif dt == C.LZ_BF16 then return C.lz_bf16_to_f32(ffi.cast("uint16_t *", self.data)[i])
  elseif dt == C.LZ_F16 then return C.lz_f16_to_f32(ffi.cast("uint16_t *", self.data)[i])
  elseif dt == C.LZ_I32 then return ffi.cast("int32_t *", self.data)[i]
  elseif dt == C.LZ_U8 then return ffi.cast("uint8_t *", self.data)[i]
  else return ffi.cast("uint16_t *", self.data)[i] end
end

-- The values integer dtypes hold; others take any number.
local int_range = { [tonumber(C.LZ_I32)] = { -2 ^ 31, 2 ^ 31 - 1 },
                    [tonumber(C.LZ_U16)] = { 0, 65535 },
                    [tonumber(C.LZ_U8)] = { 0, 255 } }

-- Writes v at index i (in range) of host tensor t; a v the dtype cannot
-- hold is an error at the caller of t's method (or of from_table).
function store(t, i, v, what)
  local dt = t.dtype
  local range = int_range[tonumber(dt)]
  if type(v) ~= "number" or (range and (v ~= math.floor(v) or v < range[1] or v > range[2])) then
    error(("luazero: %s: value %s does not fit %s; give %s"):format(what, tostring(v), t:describe(),
          range and ("a whole number in %d..%d"):format(range[1], range[2]) or "a number"), 3)
  end
  if dt == C.LZ_F32 then ffi.cast("float *", t.data)[i] = v
  elseif dt == C.LZ_BF16 then ffi.cast("uint16_t *", t.data)[i] = C.lz_f32_to_bf16(v)
  elseif dt == C.LZ_F16 then ffi.cast("uint16_t *", t.data)[i] = C.lz_f32_to_f16(v)
  elseif dt == C.LZ_I32 then ffi.cast("int32_t *", t.data)[i] = v
  elseif dt == C.LZ_U8 then ffi.cast("uint8_t *", t.data)[i] = v
  else ffi.cast("uint16_t *", t.data)[i] = v end
end

function Tensor:set(i, v)
  host_only(self, "set", true)
  store(self, whole_in(self, "set", "index", i, 0, tonumber(C.lz_tensor_numel(self)) - 1), v, "set")
end

function Tensor:totable()
  host_only(self, "totable")
  local t = {}
  for i = 0, self:numel() - 1 do t[i + 1] = self:get(i) end
  return t
end

function Tensor:fill(v)
  if type(v) ~= "number" then
    error(("luazero: fill: value %s is not a number"):format(tostring(v)), 2)
  end
  check(C.lz_fill(live(self, "fill"), v), 2)
  return self
end

function Tensor:zero()
  if live(self, "zero").device == C.LZ_CPU then
    ffi.fill(self.data, C.lz_tensor_bytes(self))
  elseif float_dtypes[tonumber(self.dtype)] then
    check(C.lz_fill(self, 0), 2)
  else
    local zeros = lz.tensor(self:sizes(), self:dtype_name(), "workspace")
    check(C.lz_tensor_copy(self, zeros), 2)
    zeros:free()
  end
  return self
end

-- src of a copy: a live tensor.
local function source(src, what)
  if not ffi.istype(tensor_ptr, src) then
    error(("luazero: %s: src is a %s, not a tensor"):format(what, type(src)), 3)
  end
  return live(src, what)
end

-- Copies (and converts between f32, bf16 and f16) from src.
function Tensor:copy(src)
  check(C.lz_tensor_copy(live(self, "copy"), source(src, "copy")), 2)
  return self
end

-- Copies from src across devices and dtypes at once (copy refuses both):
-- the conversion runs on the host, where it rounds as the devices' do.
function Tensor:convert(src)
  live(self, "convert")
  source(src, "convert")
  if self.dtype == src.dtype or self.device == src.device then return self:copy(src) end
  local host = lz.tensor(src:sizes(), self:dtype_name(), "workspace")
  if src.device == C.LZ_CPU then
    host:copy(src)
  else
    local raw = src:to("cpu")
    host:copy(raw)
    raw:free()
  end
  self:copy(host)
  host:free()
  return self
end

-- A view of `shape` starting at element `offset` (0-based), sharing storage.
function Tensor:view(offset, shape)
  offset = whole_in(live(self, "view"), "view", "offset", offset, 0, self:numel())
  local dims, nd = shape_array(shape, self.dtype)
  local out = tensor_out()
  check(C.lz_tensor_view(out, self, offset, nd, dims), 2)
  return own(out[0])
end

function Tensor:reshape(shape) return self:view(0, shape) end

-- A view of `shape` in `dtype` over this tensor's bytes from byte `at`: a
-- buffer that holds parts of several dtypes (a swap-file region). The view
-- shares the memory and must not outlive it.
function Tensor:view_bytes(at, dtype, shape)
  local dt = dtype_of(dtype)
  local dims, nd = shape_array(shape, dt)
  local n = 1
  for i = 0, nd - 1 do n = n * tonumber(dims[i]) end
  if at < 0 or at % tonumber(C.lz_dtype_size(dt)) ~= 0 or
     at + n * tonumber(C.lz_dtype_size(dt)) > self:bytes() then
    error(("view_bytes: %d elements of %s at byte %d do not fit the tensor's %d bytes at an " ..
           "offset aligned to the element"):format(n, dtype, at, self:bytes()), 2)
  end
  local out = tensor_out()
  check(C.lz_tensor_wrap(out, ffi.cast("char *", self.data) + at, dt, nd, dims), 2)
  out[0].device = self.device -- the memory's device (wrap assumes the host's)
  return own(out[0])
end

function Tensor:sq_norm()
  local out = ffi.new("double[1]")
  check(C.lz_sq_norm(live(self, "sq_norm"), out), 2)
  return out[0]
end

-- Frees now (tensors hold memory outside the Lua heap: free big ones
-- explicitly). Again, or on an arena's tensor: nothing.
function Tensor:free()
  if dead[self] == nil and self.flags == 0 then
    dead[self] = true
    ffi.gc(self, nil)
    C.lz_tensor_free(self)
  end
end

function Tensor:__tostring()
  if dead[self] and gone(self) then return "tensor (freed)" end
  if self.device ~= C.LZ_CPU then
    return ("tensor %s on %s"):format(self:describe(), self:device_name())
  end
  local n = self:numel()
  local parts = {}
  local show = math.min(n, 8)
  for i = 0, show - 1 do parts[#parts + 1] = ("%.6g"):format(self:get(i)) end
  if n > show then parts[#parts + 1] = "..." end
  return ("tensor %s [%s]"):format(self:describe(), table.concat(parts, ", "))
end

Tensor.__len = Tensor.numel

ffi.metatype("lz_tensor", Tensor)
lz.Tensor = Tensor

--------------------------------------------------------------------- arena

local Arena = {}
Arena.__index = Arena

-- lz.arena(bytes, category, device): device "cpu" (default), "sim" or
-- "cuda": an arena in that device's memory, whose tensors live there.
function lz.arena(bytes, category, device)
  guard.count("arena: bytes", bytes)
  local out = ffi.new("lz_arena *[1]")
  check(C.lz_arena_new_on(out, bytes, category_of(category or "activations"),
                          device_of(device, "arena")), 2)
  return setmetatable({ handle = ffi.gc(out[0], C.lz_arena_free) }, Arena)
end

-- Bytes an arena gives a tensor of `numel` elements of `dtype` (default
-- f32): its size rounded up to LZ_ARENA_ALIGN. Arena sizes are sums of these.
lz.ARENA_ALIGN = tonumber(C.LZ_ARENA_ALIGN)
function lz.arena_bytes(numel, dtype)
  local bytes = guard.count("arena_bytes: numel", numel) * tonumber(C.lz_dtype_size(dtype_of(dtype)))
  bytes = guard.count("arena_bytes: the bytes", math.ceil(bytes / lz.ARENA_ALIGN) * lz.ARENA_ALIGN)
  return bytes
end

-- An arena over bytes [offset, offset + bytes) of tensor t's memory (offset
-- a multiple of lz.ARENA_ALIGN): no memory of its own, so arenas whose lifetimes do not
-- overlap can share one buffer. t must outlive it. Over a device tensor the
-- arena's tensors live on that device.
function lz.arena_over(t, offset, bytes)
  local n = live(t, "arena_over"):bytes()
  offset = whole_in(t, "arena_over", "byte offset", offset, 0, n)
  bytes = whole_in(t, "arena_over", "bytes", bytes, 0, n)
  whole_in(t, "arena_over", "end byte", offset + bytes, 0, n)
  local out = ffi.new("lz_arena *[1]")
  check(C.lz_arena_wrap(out, ffi.cast("char *", t.data) + offset, bytes), 2)
  return setmetatable({ handle = ffi.gc(out[0], C.lz_arena_free), base = t }, Arena)
end

local function arena_handle(a)
  if a.handle == nil then error("luazero: this arena was freed (a:free()); make a new one", 3) end
  if guard.arena_gone(a) then
    error("luazero: the tensor this arena lies over (lz.arena_over) was freed; " ..
          "free the arena before its tensor", 3)
  end
  return a.handle
end

-- Its tensors live until the next reset, and are refused once it is freed.
function Arena:tensor(shape, dtype)
  local dt = dtype_of(dtype)
  local dims, nd = shape_array(shape, dt)
  local out = tensor_out()
  check(C.lz_arena_tensor(arena_handle(self), out, dt, nd, dims), 2)
  local t = out[0]
  dead[t] = self
  return t
end

function Arena:reset() check(C.lz_arena_reset(arena_handle(self)), 2) end
-- Gives back the bytes taken since arena:used() said `used`: the tensors
-- made since are dead, the earlier ones live on.
function Arena:rewind(used) check(C.lz_arena_rewind(arena_handle(self), used), 2) end
function Arena:used() return tonumber(C.lz_arena_used(arena_handle(self))) end
function Arena:peak() return tonumber(C.lz_arena_peak(arena_handle(self))) end
function Arena:capacity() return tonumber(C.lz_arena_capacity(arena_handle(self))) end

function Arena:free()
  if self.handle ~= nil then
    ffi.gc(self.handle, nil)
    C.lz_arena_free(self.handle)
    self.handle = nil
  end
end

-------------------------------------------------------------------- ledger

-- { params = bytes, grads = bytes, ... } now, or at peak.
function lz.mem()
  local m = {}
  for name, cat in pairs(categories) do m[name] = tonumber(C.lz_mem_current(cat)) end
  return m
end

function lz.mem_peak()
  local m = {}
  for name, cat in pairs(categories) do m[name] = tonumber(C.lz_mem_peak(cat)) end
  return m
end

-- All categories together: bytes held now, and the most held at once (on
-- the host and the device; lz.mem_device_total_peak: the device's alone).
function lz.mem_total() return tonumber(C.lz_mem_total_current()) end
function lz.mem_total_peak() return tonumber(C.lz_mem_total_peak()) end
function lz.mem_device_total_peak() return tonumber(C.lz_mem_device_total_peak()) end

-- Nanoseconds the sim device's host<->device copies have taken so far.
function lz.sim_copy_ns() return tonumber(C.lz_sim_copy_ns()) end

-- mkdir -p path: true, or nil and the reason.
function lz.mkdir(path)
  if C.lz_ckpt_mkdir(path) ~= 0 then return nil, ffi.string(C.lz_last_error()) end
  return true
end

-- A whole file's bytes; nil and the reason when it cannot be read.
function lz.read_file(path)
  local f, err = io.open(path, "rb")
  if not f then return nil, err end
  local s = f:read("*a")
  f:close()
  return s
end

-- The process's peak resident set (VmHWM) in bytes; 0 where /proc has none.
-- This process's peak resident memory (VmHWM), less the pages of the other
-- ranks' shared memory it maps for collectives (see lz_mem_shared_peer_rss):
-- those are theirs. It subtracts the peer pages mapped now: ones first
-- touched after the peak make it read low, ones freed since make it read
-- high; once a run's buffers are in place (after its first step) it is exact.
function lz.peak_rss()
  local s = lz.read_file("/proc/self/status")
  if not s then return 0 end
  local kb = s:match("VmHWM:%s*(%d+)")
  if not kb then return 0 end
  local own = tonumber(kb) * 1024 - tonumber(C.lz_mem_shared_peer_rss())
  return own > 0 and own or 0
end

function lz.mem_reset_peak() C.lz_mem_reset_peak() end

-- The device side of the ledger: { params = bytes, ... } now, or at peak.
function lz.mem_device()
  local m = {}
  for name, cat in pairs(categories) do m[name] = tonumber(C.lz_mem_device_current(cat)) end
  return m
end

function lz.mem_device_peak()
  local m = {}
  for name, cat in pairs(categories) do m[name] = tonumber(C.lz_mem_device_peak(cat)) end
  return m
end

------------------------------------------------------------ devices

-- lz.sim.init(): the simulated accelerator (core/devices/sim*.c: the cpu kernels on
-- memory the host cannot touch, on asynchronous streams; docs/devices.md).
lz.sim = {}
function lz.sim.init() check(C.lz_sim_init(), 2) end
function lz.sim.ready() return C.lz_sim_ready() ~= 0 end
-- Bytes of device memory a device has (nil where it is not known).
function lz.device_capacity(name)
  if name == "sim" and lz.sim.ready() then return tonumber(C.lz_sim_capacity()) end
  return nil
end

-- lz.device_init(name, index): "cpu" (nothing to do), "sim", or "cuda"
-- (GPU `index`, default LOCAL_RANK or 0). One accelerator per process.
function lz.device_init(name, index)
  if name == "cpu" then return end
  if name == "sim" then
    check(C.lz_sim_init(), 2)
  elseif name == "cuda" then
    check(C.lz_cuda_init(index or tonumber(os.getenv("LOCAL_RANK") or "0") or 0), 2)
  else
    error(("luazero: device_init: device %q is not \"cpu\", \"sim\" or \"cuda\""):format(
      tostring(name)), 2)
  end
end

-- Waits for all streams of the initialized accelerator.
function lz.device_synchronize() check(C.lz_device_synchronize(), 2) end

local streams = { compute = C.LZ_STREAM_COMPUTE, comm = C.LZ_STREAM_COMM,
                  copy = C.LZ_STREAM_COPY }
local function stream_of(name)
  local s = streams[name or "compute"]
  if s == nil then
    error(("luazero: stream %q is not \"compute\", \"comm\" or \"copy\""):format(
      tostring(name)), 3)
  end
  return s
end

-- lz.copy_async(dst, src, stream): a copy across devices (same dtype and
-- element count) queued on stream "compute" (default), "comm" or "copy".
-- A host source must stay alive and unchanged until the stream passes it.
function lz.copy_async(dst, src, stream)
  check(C.lz_tensor_copy_async(live(dst, "copy_async"), live(src, "copy_async"),
                               stream_of(stream)), 2)
end

function lz.stream_synchronize(stream) check(C.lz_stream_synchronize(stream_of(stream)), 2) end

-- lz.event(): e:record(stream) marks the work queued on stream so far;
-- e:wait_on(stream) makes stream wait for it (the host does not);
-- e:synchronize() waits on the host; e:query() is true once reached.
local Event = {}
Event.__index = Event
function lz.event()
  local out = ffi.new("lz_event *[1]")
  check(C.lz_event_new(out), 2)
  return setmetatable({ handle = ffi.gc(out[0], C.lz_event_free) }, Event)
end
local function event_handle(e)
  if e.handle == nil then error("luazero: this event was freed", 3) end
  return e.handle
end
function Event:record(stream)
  check(C.lz_event_record(event_handle(self), stream_of(stream)), 2)
  return self
end
function Event:wait_on(stream)
  check(C.lz_stream_wait_event(stream_of(stream), event_handle(self)), 2)
  return self
end
function Event:synchronize() check(C.lz_event_synchronize(event_handle(self)), 2) end
function Event:query()
  local done = ffi.new("int[1]")
  check(C.lz_event_query(event_handle(self), done), 2)
  return done[0] ~= 0
end
function Event:free()
  if self.handle ~= nil then
    C.lz_event_free(ffi.gc(self.handle, nil))
    self.handle = nil
  end
end

-- Bytes queued across devices since the start (or the last reset):
-- { h2d = n, d2h = n }.
function lz.copy_bytes()
  return { h2d = tonumber(C.lz_device_copy_bytes(0)), d2h = tonumber(C.lz_device_copy_bytes(1)) }
end
function lz.copy_bytes_reset() C.lz_device_copy_bytes_reset() end

------------------------------------------------------------------ cuda

-- lz.cuda.init(device): loads libluazero_cuda.so and selects the GPU; raises
-- the library's error ("cuda: no usable GPU on this machine (...); run with
-- --device cpu") where there is none. lz.cuda.available(): true, or false
-- and that reason, without raising.
lz.cuda = {}
function lz.cuda.init(device)
  check(C.lz_cuda_init(device or 0), 2)
end
function lz.cuda.available()
  if C.lz_cuda_ready() ~= 0 then return true end
  if C.lz_cuda_init(0) == 0 then return true end
  return false, ffi.string(C.lz_last_error())
end
function lz.cuda.ready() return C.lz_cuda_ready() ~= 0 end
function lz.cuda.device() return C.lz_cuda_device() end
function lz.cuda.synchronize() check(C.lz_cuda_synchronize(), 2) end

---------------------------------------------------------------- machine

function lz.threads(n)
  if n then check(C.lz_threads_set(n), 2) end
  return C.lz_threads_get()
end

function lz.cpu_has(feature) return C.lz_cpu_has(feature) ~= 0 end

-- How bf16 GEMMs run on this machine: "native (avx512_bf16)", "f32 (...)".
function lz.bf16_matmul()
  local what = ffi.new("const char *[1]")
  check(C.lz_bf16_matmul_path(what), 2)
  return ffi.string(what[0])
end

-- How bf16 training's attention runs here: "native avx512_bf16 tiles",
-- "f32 tiles (...)" (LZ_BF16_ATTENTION overrides).
function lz.bf16_attention()
  local what = ffi.new("const char *[1]")
  check(C.lz_bf16_attention_path(what), 2)
  return ffi.string(what[0])
end

-- The CPU code paths that decide a run's bits here (docs/zero.md,
-- "Determinism"): the form the hot loops run in, oneDNN's instruction set
-- for the GEMMs; with opts.adamw8bit the 8-bit update's form (the same
-- bits in every form: said, not a difference), with opts.bf16 the bf16 GEMM
-- and attention paths (opts.brief: "native" or "f32" alone, not why).
-- "kernels avx512f, GEMMs oneDNN ...".
function lz.cpu_path(opts)
  local parts = { "kernels " .. ffi.string(C.lz_cpu_kernels()),
                  "GEMMs oneDNN " .. ffi.string(C.lz_gemm_isa()) }
  if opts and opts.adamw8bit then
    local what = ffi.new("const char *[1]")
    check(C.lz_adamw8bit_form(what), 2)
    parts[#parts + 1] = "AdamW8bit " .. ffi.string(what[0])
  end
  if opts and opts.bf16 then
    local mm, at = lz.bf16_matmul(), lz.bf16_attention()
    if opts.brief then mm, at = mm:match("^%S+"), at:match("^%S+") end
    parts[#parts + 1] = "bf16 matmul " .. mm
    parts[#parts + 1] = "bf16 attention " .. at
  end
  return table.concat(parts, ", ")
end

-- The executable running this script (to start more of it: train runs,
-- tools). A rebuild while it runs unlinks the old file: name the new one.
function lz.executable()
  pcall(ffi.cdef, "long readlink(const char *path, char *buf, size_t len);")
  local buf = ffi.new("char[4096]")
  local n = tonumber(ffi.C.readlink("/proc/self/exe", buf, 4095))
  if n <= 0 then error("luazero: cannot read /proc/self/exe", 2) end
  return (ffi.string(buf, n):gsub(" %(deleted%)$", ""))
end

function lz.xxh64(ptr, bytes, seed)
  return C.lz_hash_xxh64(ptr, bytes, seed or 0)
end

-- Streaming xxh64: h:update(ptr, bytes) ...; h:digest() (uint64); h:free().
local Hasher = {}
Hasher.__index = Hasher
function lz.hasher(seed)
  local out = ffi.new("lz_hasher *[1]")
  check(C.lz_hasher_new(out, seed or 0), 2)
  return setmetatable({ h = ffi.gc(out[0], C.lz_hasher_free) }, Hasher)
end
function Hasher:update(ptr, bytes) check(C.lz_hasher_update(self.h, ptr, bytes), 2) end
function Hasher:digest() return C.lz_hasher_digest(self.h) end
function Hasher:free()
  if self.h then C.lz_hasher_free(ffi.gc(self.h, nil)); self.h = nil end
end

------------------------------------------------------ swap (the NVMe tier)

lz.swap, lz.Swap = require("luazero.swap_binding").bind(C, check, live, lz.is_tensor)

-------------------------------------------------------------------- kernels

-- lz.ops.<name>(...) calls lz_<name>, its arguments checked (op_args.lua);
-- a failing status becomes an error.
lz.ops = require("luazero.op_args").ops(C, require("luazero.cdef"), dead, gone)

function lz.adamw_args(t) return ffi.new("lz_adamw_args", t) end
function lz.lion_args(t) return ffi.new("lz_lion_args", t) end

return lz
