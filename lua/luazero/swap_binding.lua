-- swap_binding.lua — swap files: lz.swap and lz.Swap (core/io/swap.c's files,
-- read and written by I/O threads), bound by init.lua to the library.
--   local f = lz.swap(dir, bytes, "optimizer", aio)
--   f:write(0, tensor); local r = f:read(0, tensor, nil, true); r:wait(); f:close()
local ffi = require("ffi")

local M = {}

-- C: the library; check(status, level) raises its error; live(t, what,
-- level) the tensor checked alive; is_tensor(x). Returns lz.swap, lz.Swap.
function M.bind(C, check, live, is_tensor)
  -- A swap file read and written by I/O threads (core/io/swap.c). Buffers must be
  -- 4096-byte aligned: tensors of category "offload" are.
  local Swap = {}
  Swap.__index = Swap
  local SwapRequest = {}
  SwapRequest.__index = SwapRequest

  local aio_ints = { block_size = true, queue_depth = true, thread_count = true }
  local aio_flags = { single_submit = true, overlap_events = true }

  -- opts: DeepSpeed's "aio" block ({block_size=, queue_depth=, thread_count=,
  -- single_submit=, overlap_events=}); flags take true/false or 1/0.
  local function swap_opts(opts)
    local o = ffi.new("lz_swap_opts")
    C.lz_swap_opts_default(o)
    for k, v in pairs(opts or {}) do
      if aio_ints[k] then
        if type(v) ~= "number" or v ~= math.floor(v) then
          error(("swap: aio.%s is %s; it must be a whole number"):format(k, tostring(v)), 3)
        end
        o[k] = v
      elseif aio_flags[k] then
        if v == true or v == 1 then o[k] = 1
        elseif v == false or v == 0 then o[k] = 0
        else error(("swap: aio.%s is %s; it must be true or false"):format(k, tostring(v)), 3) end
      else
        error(("swap: unknown aio key '%s' (block_size, queue_depth, thread_count, " ..
               "single_submit, overlap_events)"):format(tostring(k)), 3)
      end
    end
    return o
  end

  -- lz.swap(dir, bytes, tag, opts): a new swap file in dir (tag: "optimizer",
  -- "params" or nil). Close it with :close(); ffi.gc closes a forgotten one.
  local function swap(dir, bytes, tag, opts)
    local out = ffi.new("lz_swap *[1]")
    check(C.lz_swap_open(out, dir, bytes, tag, swap_opts(opts)), 2)
    local h = ffi.gc(out[0], C.lz_swap_close)
    return setmetatable({ handle = h, path = ffi.string(C.lz_swap_path(h)),
                          pending = setmetatable({}, { __mode = "k" }) }, Swap)
  end

  local function swap_io(self, fn, offset, x, bytes, async)
    if self.handle == nil then error("swap: " .. self.path .. " is closed", 3) end
    local ptr = x
    if is_tensor(x) then
      ptr, bytes = live(x, "swap", 4).data, bytes or x:bytes()
    elseif bytes == nil then
      error("swap: give the byte count when the buffer is a pointer, not a tensor", 3)
    end
    if not async then
      check(fn(self.handle, offset, ptr, bytes, nil), 3)
      return nil
    end
    local out = ffi.new("lz_swap_req *[1]")
    check(fn(self.handle, offset, ptr, bytes, out), 3)
    -- The request keeps its buffer (and the swap file) alive until it is waited on.
    local r = setmetatable({ handle = out[0], swap = self, buffer = x }, SwapRequest)
    self.pending[r] = true
    return r
  end

  -- swap:read(offset, tensor_or_ptr, bytes, async): bytes defaults to the
  -- tensor's size. async: returns a request to :wait() on; else blocks.
  function Swap:read(offset, x, bytes, async)
    return swap_io(self, C.lz_swap_read, offset, x, bytes, async)
  end
  function Swap:write(offset, x, bytes, async)
    return swap_io(self, C.lz_swap_write, offset, x, bytes, async)
  end

  function Swap:stats()
    local h = self.handle
    if h == nil then return { path = self.path, closed = true } end
    return { path = self.path, size = tonumber(C.lz_swap_size(h)),
             direct = C.lz_swap_is_direct(h) ~= 0,
             bytes_read = tonumber(C.lz_swap_bytes_read(h)),
             bytes_written = tonumber(C.lz_swap_bytes_written(h)) }
  end

  -- Waits for outstanding requests; requests not waited on end with it.
  function Swap:close()
    local h = self.handle
    if h == nil then return end
    self.handle = nil
    for r in pairs(self.pending) do r.handle = nil end
    self.pending = {}
    ffi.gc(h, nil)
    check(C.lz_swap_close(h), 2)
  end

  function SwapRequest:wait()
    local h = self.handle
    if h == nil then
      error("swap: this request was already waited on, or its swap file closed", 2)
    end
    self.handle = nil
    self.swap.pending[self] = nil
    self.buffer = nil
    check(C.lz_swap_wait(h), 2)
  end

  function SwapRequest:done()
    return self.handle == nil or C.lz_swap_req_done(self.handle) ~= 0
  end

  return swap, Swap
end

return M
