-- monitor/flops.lua — flops_profiler: at profile_step, a per-module table of
-- parameters, forward FLOPs and fwd+bwd time, with each one's share, as
-- DeepSpeed's flops profiler prints it (a summary, the top modules at each
-- depth, the module tree).
--
-- FLOPs are analytic, from each module's shapes and the micro-batch B x T:
-- a module's parameters count 2 FLOPs each per token (a weight's
-- multiply-add; biases and norms as the 6N rule counts them), the tied LM
-- head 2 per token per element of the table it borrows, an embedding's
-- lookup none, and attention's scores and weighted values 4 B T^2 (heads x
-- head width). Their sum, times 3 for forward and backward, is
-- (6 (N - positions x width) + 12 layers x width x T) per token: the figure
-- bench/bench_train.lua measures MFU against. Time is measured around each
-- module's forward and backward (the hooks every container runs) over the
-- profile step's micro-batches; a container's includes its children's.
--
--   local prof = flops.attach(model, cfg.flops_profiler, { B = B, T = T, accum = 1 })
--   prof:arm()  engine:train_batch(loader)  local p = prof:finish(step, step_ms)
--   print(flops.report(p, cfg.flops_profiler))
local clock = require("luazero.clock")
local nn = require("luazero.nn")

local M = {}

-- The forward FLOPs of a module's own work (children apart), B x T tokens.
local function own_flops(m, B, T)
  local tokens, own = B * T, 0
  for _, p in ipairs(m.params or {}) do own = own + p.numel end
  local class = getmetatable(m)
  if class == nn.Embedding or class == nn.TokenEmbedding then return 0 end
  local f = 2 * tokens * own
  if class == nn.TiedHead then
    f = f + 2 * tokens * m.padded_vocab * m.embedding.n_embd
  elseif class == nn.CausalSelfAttention then
    f = f + 4 * B * T * T * m.n_embd
  elseif class == nn.GQA then
    f = f + 4 * B * T * T * m.n_head * m.head_dim
  end
  return f
end

local function own_params(m)
  local n = 0
  for _, p in ipairs(m.params or {}) do n = n + p.numel end
  return n
end

-- The module tree: { module, name, depth, params, flops, children = {...} },
-- params and flops inclusive of the children.
local function tree_of(m, name, depth, B, T)
  local node = { module = m, name = name, class = m.__name or "Module", depth = depth,
                 params = own_params(m), flops = own_flops(m, B, T), children = {} }
  for _, c in ipairs(m.children or {}) do
    local child = tree_of(c.module, c.name or "", depth + 1, B, T)
    node.params, node.flops = node.params + child.params, node.flops + child.flops
    node.children[#node.children + 1] = child
  end
  return node
end
M.tree_of = tree_of

local Profiler = {}
Profiler.__index = Profiler

-- Registers the timing hooks on the model (idle until armed). shape: the
-- micro-batch { B = , T = } and accum (micro-batches per step).
function M.attach(model, opts, shape)
  local self = setmetatable({ model = model, opts = opts, shape = shape, active = false,
                              t0 = {}, s = {} }, Profiler)
  local function start(m) if self.active then self.t0[m] = clock.now() end end
  local function stop(m)
    if self.active and self.t0[m] then
      self.s[m] = (self.s[m] or 0) + (clock.now() - self.t0[m])
      self.t0[m] = nil
    end
  end
  model:register_hook("pre_forward", start)
  model:register_hook("post_forward", stop)
  model:register_hook("pre_backward", start)
  model:register_hook("post_backward", stop)
  return self
end

function Profiler:due(step) return self.opts.enabled and step == self.opts.profile_step end

function Profiler:arm()
  self.active, self.t0, self.s = true, {}, {}
end

function Profiler:disarm() self.active = false end

-- The profile of the step just run: the tree with each node's seconds,
-- the micro-batch shape and the step's time.
function Profiler:finish(step, step_ms)
  self.active = false
  local sh = self.shape
  local root = tree_of(self.model, self.model.__name or "model", 0, sh.B, sh.T)
  local function fill(node)
    local sum = 0
    for _, c in ipairs(node.children) do sum = sum + fill(c) end
    -- a container the model runs without hooks (the root, the block list):
    -- its children's time
    node.seconds = self.s[node.module] or sum
    return node.seconds
  end
  fill(root)
  return { step = step, root = root, B = sh.B, T = sh.T, accum = sh.accum, step_ms = step_ms }
end

------------------------------------------------------------------ the report

local function si(v, unit)
  local prefixes = { { 1e12, "T" }, { 1e9, "G" }, { 1e6, "M" }, { 1e3, "K" } }
  for _, p in ipairs(prefixes) do
    if math.abs(v) >= p[1] then return ("%.2f %s%s"):format(v / p[1], p[2], unit) end
  end
  return unit == "" and ("%.0f"):format(v) or ("%.0f %s"):format(v, unit)
end

local function share(part, whole) return whole > 0 and 100 * part / whole or 0 end

-- The report's lines (a string), DeepSpeed's three parts.
function M.report(p, opts)
  local root, lines = p.root, {}
  local function add(...) lines[#lines + 1] = string.format(...) end
  local fwd, step_flops = root.flops, 3 * root.flops * p.accum
  add("-------------------------- luazero flops profiler --------------------------")
  add("profile at step %d (micro-batch %d x %d, %d per step)", p.step, p.B, p.T, p.accum)
  add("params of the model:                   %d (%s)", root.params, si(root.params, ""))
  add("fwd FLOPs per micro-batch:             %s", si(fwd, "FLOPs"))
  add("fwd+bwd FLOPs per step (3 x fwd):      %s", si(step_flops, "FLOPs"))
  add("fwd+bwd time of the modules:           %.2f ms", root.seconds * 1000)
  add("step time:                             %.2f ms", p.step_ms)
  add("FLOPS (fwd+bwd FLOPs / step time):     %s", si(step_flops / (p.step_ms / 1000), "FLOPS"))
  -- The top modules at each depth by params, FLOPs and time.
  local by_depth, max_depth = {}, 0
  local function collect(n)
    by_depth[n.depth] = by_depth[n.depth] or {}
    table.insert(by_depth[n.depth], n)
    max_depth = math.max(max_depth, n.depth)
    for _, c in ipairs(n.children) do collect(c) end
  end
  collect(root)
  local depth_limit = opts.module_depth < 0 and max_depth or math.min(opts.module_depth, max_depth)
  add("----------------------------- aggregated profile -----------------------------")
  add("top %d modules by params, FLOPs and fwd+bwd time at each depth:", opts.top_modules)
  for d = 0, depth_limit do
    -- the same class at one depth adds up (DeepSpeed aggregates by module name)
    local agg, order = {}, {}
    for _, n in ipairs(by_depth[d]) do
      local a = agg[n.class]
      if not a then
        a = { class = n.class, params = 0, flops = 0, seconds = 0 }
        agg[n.class] = a
        order[#order + 1] = a
      end
      a.params, a.flops, a.seconds = a.params + n.params, a.flops + n.flops, a.seconds + n.seconds
    end
    add("depth %d:", d)
    for _, key in ipairs({ "params", "flops", "seconds" }) do
      local sorted = {}
      for i, a in ipairs(order) do sorted[i] = a end
      table.sort(sorted, function(x, y)
        if x[key] ~= y[key] then return x[key] > y[key] end
        return x.class < y.class
      end)
      local parts = {}
      for i = 1, math.min(opts.top_modules, #sorted) do
        local a = sorted[i]
        local v = key == "seconds" and ("%.2f ms"):format(a.seconds * 1000)
                  or si(a[key], key == "flops" and "FLOPs" or "")
        parts[i] = ("%s: %s"):format(a.class, v)
      end
      add("    %-8s - %s", key == "seconds" and "time" or (key == "flops" and "FLOPs" or key),
          table.concat(parts, ", "))
    end
  end
  if opts.detailed then
    add("------------------------------ detailed profile ------------------------------")
    add("%-40s %12s %7s %14s %7s %11s %7s", "module", "params", "%", "fwd FLOPs", "%",
        "fwd+bwd ms", "%")
    local function show(n, indent)
      if n.depth > depth_limit then return end
      local name = n.depth == 0 and "model" or n.name
      local label = ("%s%s"):format(("  "):rep(indent),
                                    name == "" and n.class or ("%s (%s)"):format(name, n.class))
      add("%-40s %12d %6.2f%% %14.0f %6.2f%% %11.3f %6.2f%%", label, n.params,
          share(n.params, root.params), n.flops, share(n.flops, root.flops), n.seconds * 1000,
          share(n.seconds, root.seconds))
      for _, c in ipairs(n.children) do show(c, indent + 1) end
    end
    show(root, 0)
  end
  add("-------------------------------------------------------------------------------")
  return table.concat(lines, "\n") .. "\n"
end

return M
