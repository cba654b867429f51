-- inspect.lua — looking inside a live engine and at memory, from the REPL
-- (where these are globals) or a script:
--
--   shards(engine)          which rank owns which range of which parameter
--   norms(engine)           dtype and norm per buffer and per parameter, per rank
--   mem()                   the ledger per category per rank (current, peak)
--   gather(engine, name)    a whole parameter (working copy) as a tensor
--   estimate{model = "gpt2-xl", world = 8}   tools/estimate's table
--
-- shards, norms and mem gather from every rank: in a script every rank calls
-- them; in `luazero -n N -i` rank 0's REPL calls them and the other ranks
-- join through luazero.ui.serve. The engine may be left out when exactly one
-- global holds one. Each returns a report: its fields hold the numbers,
-- tostring() (what the REPL prints) lays them out.
local cjson = require("cjson")
local lz = require("luazero")
local serve = require("luazero.ui.serve")
local show = require("luazero.ui.show")
local optimizers = require("luazero.optim.registry")

local M = {}

local Report = {}
Report.__index = Report
Report.__tostring = function(r) return r.text end

local function report(fields, text)
  fields.text = text
  return setmetatable(fields, Report)
end

local function is_engine(v) return show.is_engine(v) end

-- The engine argument, or the only engine among the globals.
local function the_engine(engine, fn)
  if engine ~= nil then
    if not is_engine(engine) then
      error(("%s: expected an engine (from luazero.zero.initialize), got a %s"):format(fn, type(engine)), 0)
    end
    return engine
  end
  local found, name
  for k, v in pairs(_G) do
    if is_engine(v) then
      if found and found ~= v then
        error(("%s: several engines in globals (%s, %s); say which: %s(%s)"):format(fn, name, k,
              fn, name), 0)
      end
      found, name = v, k
    end
  end
  if not found then
    error(("%s: no engine given and none in the globals; pass one: %s(engine)"):format(fn, fn), 0)
  end
  return found
end

local function pad(s, n) return s .. (" "):rep(math.max(0, n - #s)) end

------------------------------------------------------------------ shards

-- This rank's pieces: for each parameter, the range of its flattened
-- elements that lies in this rank's slice.
local function my_shards(engine)
  local rank, out = engine.rank, { rank = engine.rank, params = {} }
  local padding = 0
  for _, seg in ipairs(engine.L.segments) do
    local lo, hi = rank * seg.slice, (rank + 1) * seg.slice
    local covered = 0
    for _, e in ipairs(seg.entries) do
      local a, b = math.max(lo, e.seg_offset), math.min(hi, e.seg_offset + e.numel)
      if b > a then
        out.params[#out.params + 1] = { e.entry.name, a - e.seg_offset, b - e.seg_offset }
        covered = covered + (b - a)
      end
    end
    padding = padding + seg.slice - covered
  end
  out.shard = engine.L.shard_numel
  out.padding = padding
  local b = engine:state_bytes()
  out.bytes = { params = b.params, grads = b.grads, optimizer = b.optimizer }
  return out
end

local owns = {
  [0] = "every rank holds everything; slices are where stages 1-3 would cut",
  [1] = "a rank owns the optimizer states of its slices",
  [2] = "a rank owns the optimizer states and gradients of its slices",
  [3] = "a rank owns the optimizer states, gradients and parameters of its slices",
}

-- Every rank's report (mine(), JSON through the collectives), indexed by
-- rank + 1.
local function every_rank(mine)
  local ranks = {}
  for _, text in ipairs(serve.collect(cjson.encode(mine()))) do
    local r = cjson.decode(text)
    ranks[r.rank + 1] = r
  end
  return ranks
end

-- The helper `name` on every rank together: its engine and every rank's
-- report(engine). pattern: nil, or a part of parameter names to show.
local function engine_reports(name, engine, pattern, report)
  if pattern ~= nil and type(pattern) ~= "string" then
    error(("%s: the pattern is %s %s; give a part of a parameter's name as a string, or " ..
           "none for all"):format(name, type(pattern), tostring(pattern)), 0)
  end
  engine = the_engine(engine, name)
  serve.together(name, engine, pattern)
  return engine, every_rank(function() return report(engine) end)
end

-- The line a pattern that names no parameter gets.
local function no_match(name, pattern)
  return ("(no parameter's name contains '%s': %s(engine) lists them all)"):format(pattern, name)
end

function M.shards(engine, pattern)
  local ranks
  engine, ranks = engine_reports("shards", engine, pattern, my_shards)
  local lines = { ("ZeRO stage %d, world %d: %s"):format(engine.stage, engine.world,
                                                        owns[engine.stage]) }
  for _, r in ipairs(ranks) do
    lines[#lines + 1] = ("rank %d: %s elements in its shard (%s padding); params %s, grads %s, " ..
                         "optimizer %s"):format(r.rank, show.thousands(r.shard),
                         show.thousands(r.padding), show.bytes(r.bytes.params),
                         show.bytes(r.bytes.grads), show.bytes(r.bytes.optimizer))
  end
  -- One line per parameter: each rank's range [from, to) of its elements.
  local per_param, order, shapes = {}, {}, {}
  for _, e in ipairs(engine.model.param_table) do
    shapes[e.name] = e
    order[#order + 1] = e.name
    per_param[e.name] = {}
  end
  for _, r in ipairs(ranks) do
    for _, p in ipairs(r.params) do
      local list = per_param[p[1]]
      list[#list + 1] = { rank = r.rank, from = p[2], to = p[3] }
    end
  end
  local width = 0
  for _, name in ipairs(order) do width = math.max(width, #name) end
  local rows = {}
  for _, name in ipairs(order) do
    if not pattern or name:find(pattern, 1, true) then
      local e = shapes[name]
      local parts = {}
      for _, piece in ipairs(per_param[name]) do
        parts[#parts + 1] = ("r%d [%d, %d)"):format(piece.rank, piece.from, piece.to)
        rows[#rows + 1] = { param = name, rank = piece.rank, from = piece.from, to = piece.to }
      end
      lines[#lines + 1] = ("%s %-12s %s"):format(pad(name, width),
                                                 "[" .. table.concat(e.shape, ",") .. "]",
                                                 table.concat(parts, "  "))
    end
  end
  if pattern and #rows == 0 then lines[#lines + 1] = no_match("shards", pattern) end
  return report({ stage = engine.stage, world = engine.world, ranks = ranks, rows = rows },
                table.concat(lines, "\n"))
end

------------------------------------------------------------------ norms

local function norm_of(t) return math.sqrt(t:sq_norm()) end

local function my_norms(engine)
  local out = { rank = engine.rank, buffers = {}, params = {} }
  local function buf(name, t)
    if t then
      out.buffers[#out.buffers + 1] = { name, t:dtype_name(), t:numel(), norm_of(t) }
    end
  end
  local P = engine:plan()
  engine:settle_grads() -- (zeros where the next backward writes)
  buf("params (" .. P.params.extent .. ")", engine.work)
  if not P.master.alias then buf("master (fp32)", engine.master) end
  buf("grads (" .. P.grads.extent .. ")", engine.grads)
  if not P.opt_grads.alias and engine.ograds then buf("grads (host, f32)", engine.ograds) end
  local opt, st = engine.optimizer, engine.states
  -- (block-scaled states, 8-bit AdamW's: the norms of the values they stand
  -- for, which visit_states gives)
  local scaled = next(st.blocks or {}) ~= nil
  if not scaled then
    for i, name in ipairs(opt.states) do buf(opt.name .. " " .. name, st.s[i]) end
  end
  if P:swapped("optimizer") or scaled then
    -- The optimizer states are in swap files: one pass over their sub-groups.
    local tier = P:swapped("optimizer") and P.optimizer.tier or "values"
    local sq, n = {}, 0
    engine:visit_states(false, function(_, p, ...)
      local views = { p, ... }
      for i, t in ipairs(views) do sq[i] = (sq[i] or 0) + t:sq_norm() end
      n = n + p:numel()
    end)
    if st.has_master and P:swapped("optimizer") then
      out.buffers[#out.buffers + 1] = { "master (fp32, " .. tier .. ")", "f32", n, math.sqrt(sq[1]) }
    end
    for i, name in ipairs(opt.states) do
      out.buffers[#out.buffers + 1] = { opt.name .. " " .. name .. " (" .. tier .. ")",
                                        st.dtypes[i], n, math.sqrt(sq[i + 1]) }
    end
  end
  -- Each parameter's part in this rank's slices (of the working copy), as
  -- a squared norm: the ranks' parts add up to the whole.
  local rank = engine.rank
  for _, seg in ipairs(engine.L.segments) do
    local lo, hi = rank * seg.slice, (rank + 1) * seg.slice
    for _, e in ipairs(seg.entries) do
      local a, b = math.max(lo, e.seg_offset), math.min(hi, e.seg_offset + e.numel)
      local sq = 0
      if b > a then
        if P.params.extent == "full" then
          sq = engine.work:view(seg.full_offset + a, { b - a }):sq_norm()
        else
          local slice, stage = engine:shard_slice(seg) -- (staged from NVMe there)
          sq = slice:view(a - lo, { b - a }):sq_norm()
          engine:release_slice(stage)
        end
      end
      out.params[#out.params + 1] = sq
    end
  end
  return out
end

function M.norms(engine, pattern)
  local ranks
  engine, ranks = engine_reports("norms", engine, pattern, my_norms)
  local lines = { "buffers per rank:" }
  for _, r in ipairs(ranks) do
    for _, b in ipairs(r.buffers) do
      lines[#lines + 1] = ("  rank %d  %-16s %-5s %14s elements  norm %s"):format(r.rank, b[1], b[2],
                           show.thousands(b[3]), show.num(b[4]))
    end
  end
  lines[#lines + 1] = ("parameters (working copy, %s): norm, then each rank's part of it:")
                      :format(engine.wdt)
  local params, i, width, shown = {}, 0, 0, 0
  for _, seg in ipairs(engine.L.segments) do
    for _, e in ipairs(seg.entries) do width = math.max(width, #e.entry.name) end
  end
  for _, seg in ipairs(engine.L.segments) do
    for _, e in ipairs(seg.entries) do
      i = i + 1
      local total, parts, per_rank = 0, {}, {}
      for _, r in ipairs(ranks) do
        total = total + r.params[i]
        per_rank[r.rank] = math.sqrt(r.params[i])
        parts[#parts + 1] = ("r%d %s"):format(r.rank, show.num(math.sqrt(r.params[i])))
      end
      local name = e.entry.name
      params[#params + 1] = { name = name, dtype = engine.wdt, norm = math.sqrt(total),
                              ranks = per_rank }
      if not pattern or name:find(pattern, 1, true) then
        shown = shown + 1
        lines[#lines + 1] = ("  %s %-9s | %s"):format(pad(name, width), show.num(math.sqrt(total)),
                                                      table.concat(parts, "  "))
      end
    end
  end
  if pattern and shown == 0 then lines[#lines + 1] = "  " .. no_match("norms", pattern) end
  return report({ ranks = ranks, params = params }, table.concat(lines, "\n"))
end

------------------------------------------------------------------ memory


function M.mem(...)
  if select("#", ...) > 0 then
    error("mem: takes no argument (it reports every rank's memory)", 0)
  end
  serve.together("mem")
  local ranks = every_rank(function()
    return { rank = serve.rank(), current = lz.mem(), peak = lz.mem_peak(),
             peak_rss = lz.peak_rss(), device = lz.mem_device(), device_peak = lz.mem_device_peak() }
  end)
  local head = { ("%-12s"):format("category") }
  for _, r in ipairs(ranks) do head[#head + 1] = ("%24s"):format(("rank %d: now / peak"):format(r.rank)) end
  local lines = { table.concat(head, " ") }
  local function row(label, f)
    local cells = { ("%-12s"):format(label) }
    for _, r in ipairs(ranks) do cells[#cells + 1] = ("%24s"):format(f(r)) end
    lines[#lines + 1] = table.concat(cells, " ")
  end
  for _, c in ipairs(lz.category_order) do
    row(c, function(r) return show.bytes(r.current[c]) .. " / " .. show.bytes(r.peak[c]) end)
  end
  row("total", function(r)
    local t = 0
    for _, c in ipairs(lz.category_order) do t = t + r.current[c] end
    return show.bytes(t)
  end)
  row("peak_rss", function(r) return show.bytes(r.peak_rss) end)
  -- The device's own ledger, where a rank computes on an accelerator.
  local on_device = false
  for _, r in ipairs(ranks) do
    for _, c in ipairs(lz.category_order) do
      if (r.device_peak[c] or 0) > 0 then on_device = true end
    end
  end
  if on_device then
    lines[#lines + 1] = "device memory:"
    for _, c in ipairs(lz.category_order) do
      row(c, function(r) return show.bytes(r.device[c]) .. " / " .. show.bytes(r.device_peak[c]) end)
    end
  end
  return report({ ranks = ranks }, table.concat(lines, "\n"))
end

------------------------------------------------------------------ gather

local function find_entry(engine, name, fn)
  if type(name) ~= "string" then
    error(("%s: give a parameter name, e.g. %s(engine, \"h.0.attn.c_attn.weight\")"):format(fn, fn), 0)
  end
  local hits = {}
  for _, seg in ipairs(engine.L.segments) do
    for _, e in ipairs(seg.entries) do
      local n = e.entry.name
      if n == name then return seg, e end
      if n:sub(-#name - 1) == "." .. name then hits[#hits + 1] = { seg, e } end
    end
  end
  if #hits == 1 then return hits[1][1], hits[1][2] end
  local some = {}
  for i, seg in ipairs(engine.L.segments) do
    if i > 4 then break end
    some[#some + 1] = seg.entries[1].entry.name
  end
  if #hits > 1 then
    error(("%s: '%s' matches %d parameters (%s, ...); give more of the name"):format(fn, name,
          #hits, hits[1][2].entry.name), 0)
  end
  error(("%s: no parameter '%s' (names look like %s; shards(engine) lists them)"):format(fn, name,
        table.concat(some, ", ")), 0)
end

-- The parameter as a new tensor of its shape, in the working dtype
-- (category workspace; t:free() when done).
function M.gather(engine, name)
  engine = the_engine(engine, "gather")
  local seg, e = find_entry(engine, name, "gather")
  local out = lz.tensor(e.shape, engine.wdt, "workspace")
  local flat = out:view(0, { e.numel })
  if engine:plan().params.extent == "full" then
    flat:copy(engine.work:view(seg.full_offset + e.seg_offset, { e.numel }))
  elseif seg.persistent then
    flat:copy(seg.persistent:view(e.seg_offset, { e.numel }))
  else
    serve.together("gather", engine, name)
    local full = lz.tensor({ seg.padded }, engine.wdt, "workspace")
    local slice, stage = engine:shard_slice(seg) -- (staged from NVMe when it lives there)
    require("luazero.comm").all_gather(slice, full)
    engine:release_slice(stage)
    flat:copy(full:view(e.seg_offset, { e.numel }))
    full:free()
  end
  return out
end

------------------------------------------------------------------ estimate

-- tools/estimate with flags from a table: {model = "gpt2-xl", world = 8,
-- budget = "12GiB"}; the same text (run as the tool itself).
function M.estimate(opts)
  if type(opts) ~= "table" then
    error("estimate: give a table of tools/estimate's flags, e.g. estimate{model = \"gpt2-xl\", " ..
          "world = 8}", 0)
  end
  local argv, keys = {}, {}
  for k in pairs(opts) do keys[#keys + 1] = k end
  table.sort(keys)
  local function q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end
  for _, k in ipairs(keys) do
    argv[#argv + 1] = q("--" .. tostring(k):gsub("_", "-")) .. " " .. q(opts[k])
  end
  local cmd = ("%s %s %s 2>&1"):format(q(lz.executable()), q(lz.root .. "/tools/estimate.lua"),
                                       table.concat(argv, " "))
  local p = assert(io.popen(cmd))
  local text = p:read("*a")
  local ok = p:close()
  text = text:gsub("\n$", "")
  if not ok then error(text, 0) end
  return report({ opts = opts }, text)
end

------------------------------------------------------------------ checkpoints on disk

-- ckpt(dir [, "norms"]): a checkpoint on disk (a step folder, or a folder
-- whose `latest` names one) through luazero.checkpoint: the manifest's
-- summary and the shard table (which rank's file holds which canonical
-- ranges), with per-tensor norms of the fp32 master when asked. The report's
-- `checkpoint` field is the open checkpoint (:tensor(name), :norms(), ...).
function M.ckpt(dir, what)
  if type(dir) ~= "string" then
    error("ckpt: give a checkpoint folder, e.g. ckpt(\"runs/ckpt\")", 0)
  end
  local ck = require("luazero.checkpoint").open(dir)
  local sm, shards = ck:summary(), ck:shard_table()
  local lines = {
    ("checkpoint %s: model %s, world %d, stage %d, %s; %s parameters in %d tensors")
      :format(sm.dir, tostring(sm.model), sm.world_size, sm.stage, tostring(sm.dtype),
              show.thousands(sm.numel), sm.params),
    ("step %d (global %d, skipped %d)%s; %d shard%s, %s raw, %s compressed (%.2fx)")
      :format(sm.optimizer_steps, sm.global_steps, sm.skipped_steps,
              sm.loss_scale and (", loss scale " .. sm.loss_scale) or "", sm.shards,
              sm.shards == 1 and "" or "s", show.bytes(sm.raw_bytes),
              show.bytes(sm.compressed_bytes), sm.ratio),
    ("optimizer %s; states %s"):format(optimizers.describe(sm.optimizer, sm.optimizer_from),
                                       sm.states_text),
    ("%-28s %5s %14s %12s %12s  %s"):format("shard", "rank", "elements", "raw",
                                           "compressed", "canonical ranges"),
  }
  for _, r in ipairs(shards) do
    local ranges = {}
    for i, x in ipairs(r.ranges) do
      if i > 3 then ranges[#ranges + 1] = ("... (%d ranges)"):format(#r.ranges); break end
      ranges[#ranges + 1] = ("[%d, %d)"):format(x[1], x[2])
    end
    lines[#lines + 1] = ("%-28s %5d %14s %12s %12s  %s"):format(r.file, r.rank,
      show.thousands(r.elems), show.bytes(r.raw_bytes), show.bytes(r.compressed_bytes),
      table.concat(ranges, " "))
  end
  local fields = { checkpoint = ck, summary = sm, shards = shards }
  if what == "norms" then
    fields.norms = ck:norms()
    lines[#lines + 1] = ("%-40s %-16s %14s"):format("tensor", "shape", "norm (master)")
    for _, t in ipairs(fields.norms) do
      lines[#lines + 1] = ("%-40s %-16s %14.6g"):format(t.name,
        "[" .. table.concat(t.shape, ", ") .. "]", t.norm)
    end
  elseif what ~= nil then
    error(("ckpt: unknown option %q (\"norms\" adds per-tensor norms)"):format(tostring(what)), 0)
  end
  return report(fields, table.concat(lines, "\n"))
end

------------------------------------------------------------------ registry

for _, name in ipairs({ "shards", "norms", "mem", "gather" }) do serve.register(name, M[name]) end

-- The names the REPL makes global.
M.globals = { "shards", "norms", "mem", "gather", "estimate", "ckpt" }

return M
