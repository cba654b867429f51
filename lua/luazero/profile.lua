-- profile.lua — where a training step's time goes: the wall time of every
-- kernel call (each function of lz.ops), of the tensor calls that convert,
-- copy, zero and take norms, and of the engine's phases that are not
-- kernels (gradient reduction, the loss and norm exchange, parameter
-- gathers, zeroing, the optimizer's own Lua, data loading), per optimizer
-- step, after a first step of warm-up.
--
--   local profile = require("luazero.profile")
--   local p = profile.attach(engine)  -- wraps lz.ops, the tensor calls, the engine
--   for i = 1, 4 do engine:train_batch(loader) end  -- the first one is warm-up
--   print(p:format())                 -- the table; p:report() is the same as data
--   p:write_json("profile.json")
--   p:detach()                        -- everything as it was
--
-- While attached, lz.ops' entries, lz.Tensor's copy/zero/fill/sq_norm, the
-- engine's phase methods and each module's forward/backward are wrappers
-- that time the call; detached, the originals are back and cost nothing.
-- Modules call kernels through the `ops` table each time, so wrapping its
-- entries reaches every call. Results do not change: each wrapper calls
-- the original with the same arguments, save linear_backward, whose three
-- independent parts (dX, dW, the bias gradient) are timed as three calls
-- of the same kernel, each with the other outputs absent.
--
-- Time is exclusive: a kernel inside a phase counts for the kernel, the
-- phase keeps the rest; what no row claims inside forward, backward and
-- the step is the Lua glue. The rows add up to the step's time.
-- GEMM rows (matmul, linear forward, dX, dW) are split by the module that
-- ran them (the part of its path after the block number: self_attn.o_proj,
-- mlp.c_fc, lm_head), dtype and shape M x N x K, with the GFLOP/s reached;
-- the tensor calls' rows carry the GB/s they moved.
-- On a device the wrappers synchronise around each call (host time would
-- only say when the work was queued): the step is slower, the split right.
local lz = require("luazero")
local clock = require("luazero.clock")

local M = {}

local now = clock.now

-- Engine methods and the row their own time goes to (zero/engine.lua;
-- those the engine has not are its gatherer's, zero/gather.lua, or its
-- reducer's, zero/reduce.lua).
M.phases = {
  forward = "Lua glue (forward)", backward = "Lua glue (backward)",
  step = "optimizer step (rest)",
  grads_ready = "gradient reduction", flush_bucket = "gradient reduction",
  wait_all = "gradient reduction", pull_grads = "gradient reduction",
  exchange = "loss and grad-norm exchange",
  gather = "parameter gather", pre_forward = "parameter gather", post_forward = "parameter gather",
  pre_backward = "parameter gather", post_backward = "gradient reduction",
  pre_recompute = "parameter gather", post_recompute = "parameter gather",
  gather_params = "parameter gather (after the step)",
  zero_grad = "zero gradients",
}

-- Where a tensor call's row says it ran: the innermost phase's name, or
-- "model" inside forward and backward.
local context_of = {
  forward = "model", backward = "model", step = "optimizer", exchange = "grad norm",
  zero_grad = "zero gradients", gather_params = "parameter gather",
}

M.GLUE = "Lua glue (step)"
M.DATA = "data loading"

local current -- the attached profiler, or nil

local Profile = {}
Profile.__index = Profile

-- Frames: { key, t0, child } where child is the time spent in calls inside
-- it that have a row of their own.
function Profile:push(key, ctx)
  local s = self.stack
  s[#s + 1] = { key = key, t0 = now(), child = 0, ctx = ctx or (s[#s] and s[#s].ctx) }
end

function Profile:pop()
  local s = self.stack
  local f = table.remove(s)
  local dt = now() - f.t0
  self:add(f.key, dt - f.child, 1, 0)
  local parent = s[#s]
  if parent then parent.child = parent.child + dt end
end

-- One row's record: calls, seconds, FLOPs (GEMMs) or bytes moved (tensor
-- calls; 0 for kernels).
function Profile:add(key, seconds, calls, flops, gemm)
  local r = self.rows[key]
  if not r then
    r = { calls = 0, s = 0, flops = 0, gemm = gemm or false }
    self.rows[key] = r
  end
  r.calls, r.s, r.flops = r.calls + calls, r.s + seconds, r.flops + flops
end

-- A leaf call: fn(...) timed, its time given to key and taken from the frame
-- it ran in.
function Profile:leaf(key, flops, gemm, fn, ...)
  local sync = self.sync
  if sync then sync() end
  local t0 = now()
  local out = fn(...)
  if sync then sync() end
  local dt = now() - t0
  self:add(key, dt, 1, flops, gemm)
  local top = self.stack[#self.stack]
  if top then top.child = top.child + dt end
  return out
end

-------------------------------------------------------------- the wrappers

-- The module path after the block number (model.layers.3.mlp.up_proj ->
-- mlp.up_proj), or the whole path outside the blocks.
function M.label(path)
  if not path or path == "" then return "model" end
  local after = path:match("^.*%.%d+%.(.+)$")
  if after then return after end
  if path:match("%.%d+$") then return "block" end
  return path
end

local function gemm_key(self, part, dt, m, n, k)
  return ("GEMM %s %s %s %dx%dx%d"):format(self.labels[#self.labels] or "model", part, dt, m, n,
                                            k)
end

---------------------------------------------- bytes per parameter per step

-- The passes over every parameter's elements outside forward and backward:
-- the tensor calls in these contexts, and the optimizer kernels.
local PARAM_PASSES = { ["zero gradients"] = true, ["grad norm"] = true, optimizer = true }

-- An optimizer kernel (an op named *_step): what each tensor argument moves
-- per element, from its declaration (luazero.cdef): a const one is read (1),
-- one updated in place is read and written (2), the working copy is
-- written only (1).
local function step_moves(name)
  local decl = require("luazero.cdef"):match("lz_status lz_" .. name .. "%(([^)]*)%)")
  local moves = {}
  for p in (decl or ""):gmatch("[^,]+") do
    if not p:find("lz_tensor", 1, true) then break end
    local pname = p:match("([%w_]+)%s*$")
    moves[#moves + 1] = (p:find("const", 1, true) or pname == "working") and 1 or 2
  end
  return moves
end

-- Bytes moved in pass `what`; elements: the parameters an optimizer call
-- updated (the count the bytes are per); touched: the elements a tensor
-- call moved (its share of a whole pass over the parameters).
function Profile:param_pass(what, bytes, elements, touched)
  local pb = self.pbytes
  pb[what] = (pb[what] or 0) + bytes
  if elements then pb.elements = (pb.elements or 0) + elements end
  if touched then self.ptouched[what] = (self.ptouched[what] or 0) + touched end
end

-- The wrapped kernels: GEMMs with their FLOPs (the experts' grouped ones
-- too), linear_backward and moe_gemm_backward in their parts.
local function wrap_ops(self, ops)
  local wrapped = {}
  for _, name in ipairs(require("luazero.op_args").names) do
    local orig = rawget(ops, name)
    self.saved_ops[name] = orig
    local fn
    if name == "matmul" then
      fn = function(c, a, b, ta, tb, alpha, beta)
        if not self.active then return orig(c, a, b, ta, tb, alpha, beta) end
        local mrows = c:dim(1)
        local n, k = c:numel() / mrows, a:numel() / mrows
        self:leaf(gemm_key(self, "matmul", a:dtype_name(), mrows, n, k), 2 * mrows * n * k, true,
                  orig, c, a, b, ta, tb, alpha, beta)
      end
    elseif name == "linear_forward" then
      fn = function(y, x, w, b)
        if not self.active then return orig(y, x, w, b) end
        local n_out = w:dim(1)
        local n_in = w:numel() / n_out
        local rows = x:numel() / n_in
        self:leaf(gemm_key(self, "fwd", x:dtype_name(), rows, n_out, n_in), 2 * rows * n_out * n_in,
                  true, orig, y, x, w, b)
      end
    elseif name:match("^linear_backward") then
      -- (..., the _norm variant's write flag and partials, passed on)
      fn = function(dx, dw, db, dy, x, w, ...)
        if not self.active then return orig(dx, dw, db, dy, x, w, ...) end
        local n_out = w:dim(1)
        local n_in = w:numel() / n_out
        local rows, dt = x:numel() / n_in, x:dtype_name()
        local flops = 2 * rows * n_out * n_in
        if dx then
          self:leaf(gemm_key(self, "dX", dt, rows, n_in, n_out), flops, true, orig, dx, nil, nil,
                    dy, x, w, ...)
        end
        if dw then
          self:leaf(gemm_key(self, "dW", dt, n_out, n_in, rows), flops, true, orig, nil, dw, nil,
                    dy, x, w, ...)
        end
        if db then
          self:leaf(name .. " (bias gradient)", 0, false, orig, nil, nil, db, dy, x, w, ...)
        end
      end
    elseif name:match("_step$") then
      local moves = step_moves(name)
      fn = function(...)
        if not self.active then return orig(...) end
        local bytes = 0
        for i, k in ipairs(moves) do
          local t = select(i, ...)
          if t ~= nil then bytes = bytes + k * t:bytes() end
        end
        self:param_pass("optimizer", bytes, (...):numel())
        self:leaf(name, 0, false, orig, ...)
      end
    elseif name:match("^moe_gemm") then
      -- the experts' grouped GEMM: every expert's rows, so the FLOPs of one
      -- GEMM over all of them (w [E, D, C] or [E, P, D, C])
      local backward = name:match("backward") ~= nil
      fn = function(...)
        if not self.active then return orig(...) end
        local a = { ... }
        local x, w = a[backward and 4 or 2], a[backward and 5 or 3]
        local nd = tonumber(w.ndim)
        local D, C = w:dim(nd - 1), w:dim(nd)
        local rows, dt = x:numel() / C, x:dtype_name()
        local flops = 2 * rows * D * C
        if not backward then
          return self:leaf(gemm_key(self, "fwd", dt, rows, D, C) .. " grouped", flops, true, orig, ...)
        end
        local dx, dw, n = a[1], a[2], select("#", ...)
        if dx then
          self:leaf(gemm_key(self, "dX", dt, rows, C, D) .. " grouped", flops, true, orig, dx, nil,
                    unpack(a, 3, n))
        end
        if dw then
          self:leaf(gemm_key(self, "dW", dt, D, C, rows) .. " grouped", flops, true, orig, nil, dw,
                    unpack(a, 3, n))
        end
      end
    elseif name == "sq_norm_blocks" then
      -- the gradient norm's pass over the blocks no kernel took (NaN)
      fn = function(t, blocks, out)
        if not self.active then return orig(t, blocks, out) end
        local n, read, B = t:numel(), 0, lz.SQ_NORM_BLOCK
        for k = 0, math.ceil(n / B) - 1 do
          if blocks[k] ~= blocks[k] then read = read + math.min(B, n - B * k) end
        end
        local top = self.stack[#self.stack]
        local ctx = top and top.ctx or "model"
        if PARAM_PASSES[ctx] then self:param_pass(("sq_norm (%s)"):format(ctx), 4 * read, nil, read) end
        local key = ("sq_norm_blocks (%s)"):format(ctx)
        return self:leaf(key, 4 * read, false, orig, t, blocks, out)
      end
    else
      fn = function(...)
        if not self.active then return orig(...) end
        self:leaf(name, 0, false, orig, ...)
      end
    end
    wrapped[name] = fn
  end
  for name, fn in pairs(wrapped) do rawset(ops, name, fn) end
end

local dtype_short = { f32 = "f32", bf16 = "bf16", f16 = "f16" }

local function wrap_tensor(self)
  local T = lz.Tensor
  local function ctx_of()
    local top = self.stack[#self.stack]
    return top and top.ctx or "model"
  end
  for _, name in ipairs({ "copy", "zero", "fill", "sq_norm" }) do
    local orig = T[name]
    self.saved_tensor[name] = orig
    local keys = {}
    T[name] = function(t, a)
      if not self.active then return orig(t, a) end
      local key
      if name == "copy" then
        local from, to = a:dtype_name(), t:dtype_name()
        local what = from == to and "copy" or ("convert %s->%s"):format(dtype_short[from] or from,
                                                                       dtype_short[to] or to)
        key = ("tensor %s (%s)"):format(what, ctx_of())
      else
        local c = ctx_of()
        key = keys[c]
        if not key then
          key = ("tensor %s (%s)"):format(name, c)
          keys[c] = key
        end
      end
      -- bytes moved: read and written (copy), written (zero, fill), read (sq_norm)
      local bytes = t:bytes()
      if name == "copy" then bytes = bytes + a:bytes() end
      if PARAM_PASSES[ctx_of()] then
        self:param_pass((key:gsub("^tensor ", "")), bytes, nil, t:numel())
      end
      return self:leaf(key, bytes, false, orig, t, a)
    end
  end
end

-- The end of a frame: popped, its label dropped, an error raised again,
-- else the call's results passed on (no table: this runs around every
-- module call).
local function leave(self, key, label, ok, ...)
  if key then self:pop() end
  if label then self.labels[#self.labels] = nil end
  if not ok then error((...), 0) end
  return ...
end

-- orig wrapped: while a step runs, timed as a frame (key: its row, ctx: what
-- tensor calls inside it say, label: the module GEMMs inside it name).
local function framed(self, orig, key, ctx, label)
  return function(...)
    if not self.active then return orig(...) end
    if label then self.labels[#self.labels + 1] = label end
    if key then self:push(key, ctx) end
    return leave(self, key, label, pcall(orig, ...))
  end
end

-- A method of obj (engine or module) timed as a frame; its original field
-- (nil: the class's) kept for detach.
local function wrap_method(self, obj, name, key, ctx, label)
  local orig = obj[name]
  if type(orig) ~= "function" then return end
  self.saved_fields[#self.saved_fields + 1] = { obj, name, rawget(obj, name) }
  obj[name] = framed(self, orig, key, ctx, label)
end

-- After a step: the frames closed, its time counted (not the warm-up's),
-- the batches' next_batch back.
function Profile:end_step(t0, batches, raw, warmup, keep, ok, ...)
  if self.sync then self.sync() end
  while #self.stack > 0 do self:pop() end
  local dt = now() - t0
  self.active = false
  if raw ~= nil then batches.next_batch = raw or nil end
  if warmup then
    self.warm, self.rows, self.pbytes, self.ptouched = 1, keep, {}, {}
  else
    self.steps, self.step_s = self.steps + 1, self.step_s + dt
  end
  if not ok then error((...), 0) end
  return ...
end

--------------------------------------------------------------- attach

-- Starts profiling `engine` (a ZeRO engine): every train_batch after the
-- first is counted. opts.sync: a function called around each timed call
-- (default: lz.device_synchronize when the engine computes on a device).
function M.attach(engine, opts)
  opts = opts or {}
  if current then
    error("profile: a profiler is attached already; detach it before attaching another", 2)
  end
  local self = setmetatable({
    engine = engine, rows = {}, stack = {}, labels = {}, steps = 0, warm = 0, step_s = 0,
    pbytes = {}, ptouched = {},
    saved_ops = {}, saved_tensor = {}, saved_fields = {}, active = false,
    sync = opts.sync or (engine.dev and engine.dev ~= "cpu" and lz.device_synchronize or nil),
  }, Profile)
  current = self
  wrap_ops(self, lz.ops)
  wrap_tensor(self)
  for name, key in pairs(M.phases) do
    local owner = engine
    if owner[name] == nil then
      owner = engine.gatherer and engine.gatherer[name] and engine.gatherer or engine.reducer
    end
    wrap_method(self, owner, name, key, context_of[name] or key)
  end
  -- each module labels the GEMMs it runs; a child without a name of its
  -- own (the packed q/k/v projection, a LoRA wrapper's base) by its class
  local function visit(m, path, label)
    wrap_method(self, m, "forward", nil, nil, label)
    wrap_method(self, m, "backward", nil, nil, label)
    for _, c in ipairs(m.children) do
      local cpath = c.name and (path == "" and c.name or path .. "." .. c.name) or path
      visit(c.module, cpath, c.name and M.label(cpath) or label .. "." .. (c.module.__name or "part"))
    end
  end
  visit(engine.model, "", "model")
  -- lz.Tensor is a metatype's __index table: code the JIT compiled before
  -- may call the methods it found there, bypassing the wrappers; flushing
  -- the traces makes every call site look them up again.
  jit.flush()
  -- train_batch: the step's frame; its batches' next_batch a frame of its own.
  local train_batch = engine.train_batch
  self.saved_fields[#self.saved_fields + 1] = { engine, "train_batch", rawget(engine, "train_batch") }
  engine.train_batch = function(eng, batches, ...)
    -- raw: the batches' own next_batch field (false: none, nil: no batches table)
    local raw
    if type(batches) == "table" and batches.next_batch then
      raw = rawget(batches, "next_batch") or false
      batches.next_batch = framed(self, batches.next_batch, M.DATA, M.DATA)
    end
    -- the warm-up step's rows go to a table that is dropped after it
    local warmup, keep = self.warm == 0, self.rows
    if warmup then self.rows = {} end
    self.active, self.stack, self.labels = true, {}, {}
    if self.sync then self.sync() end
    self:push(M.GLUE, "optimizer")
    return self:end_step(self.stack[1].t0, batches, raw, warmup, keep,
                         pcall(train_batch, eng, batches, ...))
  end
  return self
end

-- Everything back as it was before attach.
function Profile:detach()
  if current ~= self then return end
  for name, fn in pairs(self.saved_ops) do rawset(lz.ops, name, fn) end
  for name, fn in pairs(self.saved_tensor) do lz.Tensor[name] = fn end
  for i = #self.saved_fields, 1, -1 do
    local s = self.saved_fields[i]
    s[1][s[2]] = s[3]
  end
  self.saved_fields, self.active = {}, false
  current = nil
  jit.flush() -- no trace keeps calling a wrapper (see attach)
end

function M.attached() return current end

--------------------------------------------------------------- the report

-- { steps, step_ms, rows = { {name, calls, ms, pct, gflops (GEMMs), gemm} ...
-- largest first }, gemm_pct, gemm_gflops, other_pct, sum_ms }: per step,
-- over the steps after the warm-up.
function Profile:report()
  local n = self.steps
  local out = { steps = n, rows = {} }
  if n == 0 then return out end
  local step_ms = self.step_s / n * 1000
  out.step_ms = step_ms
  local sum, gemm_s, gemm_flops, parts = 0, 0, 0, {}
  for key, r in pairs(self.rows) do
    local ms = r.s / n * 1000
    local row = { name = key, calls = r.calls / n, ms = ms, pct = 100 * ms / step_ms,
                  gemm = r.gemm }
    if r.gemm then
      row.gflops = r.s > 0 and r.flops / r.s / 1e9 or 0
      gemm_s, gemm_flops = gemm_s + r.s, gemm_flops + r.flops
      local part = key:match("^GEMM %S+ (%S+)")
      local pt = parts[part] or { part = part, s = 0, flops = 0 }
      parts[part], pt.s, pt.flops = pt, pt.s + r.s, pt.flops + r.flops
    elseif r.flops > 0 then
      row.gbs = r.s > 0 and r.flops / r.s / 1e9 or 0
    end
    sum = sum + ms
    out.rows[#out.rows + 1] = row
  end
  table.sort(out.rows, function(a, b)
    if a.gemm ~= b.gemm then return a.gemm end
    return a.ms > b.ms
  end)
  out.sum_ms = sum
  out.param_bytes = self:param_bytes_report()
  out.gemm_pct = 100 * gemm_s / self.step_s
  out.gemm_gflops = gemm_s > 0 and gemm_flops / gemm_s / 1e9 or 0
  out.other_pct = 100 - out.gemm_pct
  -- the GEMMs by part: forward, dX, dW, plain matmul
  out.gemm_parts = {}
  for _, part in ipairs({ "fwd", "dX", "dW", "matmul" }) do
    local pt = parts[part]
    if pt then
      out.gemm_parts[#out.gemm_parts + 1] = { part = part, ms = pt.s / n * 1000,
        pct = 100 * pt.s / self.step_s, gflops = pt.s > 0 and pt.flops / pt.s / 1e9 or 0 }
    end
  end
  return out
end

-- Bytes each parameter moved per step in the passes over all of them (the
-- optimizer's kernels, zeroing the gradients, their norm, conversions in
-- the step): { per_param, minimum, parts = { {name, per_param, passes} ... } },
-- or nil without an optimizer kernel seen. passes (the tensor calls'
-- parts): the share of a whole pass over the parameters the part moved
-- (zeroing that skips the gradients backward writes is less than one). The minimum is one
-- pass: the optimizer's own reads and writes (its states, the gradient,
-- the master and the working copy), each once.
function Profile:param_bytes_report()
  local pb, n = self.pbytes, self.pbytes.elements
  if not n or n == 0 then return nil end
  local out, total = { parts = {} }, 0
  for what, bytes in pairs(pb) do
    if what ~= "elements" then
      local touched = self.ptouched[what]
      out.parts[#out.parts + 1] = { name = what, per_param = bytes / n,
                                    passes = touched and touched / n }
      total = total + bytes
    end
  end
  table.sort(out.parts, function(a, b) return a.per_param > b.per_param end)
  out.per_param, out.minimum = total / n, pb.optimizer / n
  return out
end

-- The report as text: one table, then the summary line. opts.peak: {
-- f32 =, bf16 = } GFLOP/s of the GEMM yardstick, to show each GEMM's share
-- of it.
function Profile:format(opts)
  local rep = self:report()
  if rep.steps == 0 then
    return "profile: no step after the warm-up step was timed (run at least 2 steps)"
  end
  local peak = opts and opts.peak
  local lines = { ("profile: %d step%s after the warm-up, %.1f ms per step")
                  :format(rep.steps, rep.steps == 1 and "" or "s", rep.step_ms) }
  lines[#lines + 1] = ("%-52s %8s %10s %7s %9s"):format("op or phase", "calls", "ms/step", "%",
                                                       "GFLOP/s")
  for _, r in ipairs(rep.rows) do
    local g = ""
    if r.gbs then g = ("%9.1f GB/s"):format(r.gbs) end
    if r.gflops then
      g = ("%9.1f"):format(r.gflops)
      local dt = r.name:match("^GEMM %S+ %S+ (%S+)")
      if peak and (peak[dt] or 0) > 0 then g = g .. (" %4.0f%%"):format(100 * r.gflops / peak[dt]) end
    end
    lines[#lines + 1] = ("%-52s %8.1f %10.2f %6.1f%% %s"):format(r.name, r.calls, r.ms, r.pct, g)
  end
  lines[#lines + 1] = ("%-52s %8s %10.2f %6.1f%%"):format("sum of the rows", "", rep.sum_ms,
                                                         100 * rep.sum_ms / rep.step_ms)
  lines[#lines + 1] = ("GEMMs %.1f%% of the step at %.1f GFLOP/s, everything else %.1f%%")
                      :format(rep.gemm_pct, rep.gemm_gflops, rep.other_pct)
  local parts = {}
  for i, pt in ipairs(rep.gemm_parts) do
    parts[i] = ("%s %.1f%% at %.1f"):format(pt.part, pt.pct, pt.gflops)
  end
  lines[#lines + 1] = "GEMMs by part (% of the step at GFLOP/s): " .. table.concat(parts, ", ")
  local pb = rep.param_bytes
  if pb then
    local each = {}
    for i, pt in ipairs(pb.parts) do
      each[i] = ("%s %.1f"):format(pt.name, pt.per_param)
      if pt.passes then each[i] = each[i] .. (" in %.2f pass"):format(pt.passes) end
    end
    lines[#lines + 1] = ("bytes per parameter per step: %.1f (%s); minimum %.1f (one pass: " ..
                         "the optimizer's own reads and writes)")
                        :format(pb.per_param, table.concat(each, ", "), pb.minimum)
  end
  -- Which kernels ran the bf16 work on this machine (the start-up line's words).
  local bf16_gemm, bf16_attention = false, false
  for _, r in ipairs(rep.rows) do
    bf16_gemm = bf16_gemm or r.name:find("^GEMM %S+ %S+ bf16 ") ~= nil
    bf16_attention = bf16_attention or r.name:find("^attention_bf16_") ~= nil
  end
  local chosen = {}
  if bf16_gemm then chosen[#chosen + 1] = "matmul " .. lz.bf16_matmul() end
  if bf16_attention then chosen[#chosen + 1] = "attention " .. lz.bf16_attention() end
  if #chosen > 0 then lines[#lines + 1] = "bf16 kernels: " .. table.concat(chosen, "; ") end
  return table.concat(lines, "\n")
end

-- The report as JSON, written to path whole or not at all (io/atomic.lua);
-- an error naming the path when it cannot be.
function Profile:write_json(path)
  require("luazero.io.atomic").write(path, require("cjson").encode(self:report()) .. "\n")
end

M.Profile = Profile
return M
