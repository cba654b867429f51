-- show.lua — values as the REPL prints them: tensors (shape, dtype, a few
-- values, norm), modules (the tree of children with parameter counts), the
-- engine (stage, world, dtype, counts), the ledger (bytes per category and
-- peak), plain tables pretty-printed down to a depth limit.
--
--   local show = require("luazero.ui.show")
--   print(show.value(x))            -- any value
--   show.bytes(3 * 2^20)            -- "3.0 MiB"
--   show.count(124439808)           -- "124.44M"
local lz = require("luazero")

local M = {}

M.DEPTH = 3    -- nesting shown in plain tables
M.ITEMS = 40   -- entries shown per table level
M.VALUES = 6   -- tensor elements shown
M.CHILDREN = 6 -- children shown per module level before "... N more"

function M.bytes(n)
  n = tonumber(n) or 0
  local units = { "B", "KiB", "MiB", "GiB", "TiB" }
  local u = 1
  while math.abs(n) >= 1024 and u < #units do
    n = n / 1024
    u = u + 1
  end
  return u == 1 and ("%d B"):format(n) or ("%.1f %s"):format(n, units[u])
end

function M.count(n)
  if n >= 1e9 then return ("%.2fB"):format(n / 1e9) end
  if n >= 1e6 then return ("%.2fM"):format(n / 1e6) end
  if n >= 1e4 then return ("%.1fK"):format(n / 1e3) end
  return tostring(n)
end

-- 1234567 -> "1,234,567"
function M.thousands(n)
  local s = ("%d"):format(n)
  local sign, digits = s:match("^(-?)(%d+)$")
  return sign .. digits:reverse():gsub("(%d%d%d)", "%1,"):reverse():gsub("^,", "")
end

local function num(x)
  if x ~= x then return "nan" end
  if x == math.huge then return "inf" end
  if x == -math.huge then return "-inf" end
  return ("%.4g"):format(x)
end
M.num = num

------------------------------------------------------------------ tensors

local float_dtypes = { f32 = true, bf16 = true, f16 = true }

function M.tensor(t)
  local n = t:numel()
  local vals = {}
  local head = math.min(n, M.VALUES)
  for i = 0, head - 1 do vals[#vals + 1] = num(t:get(i)) end
  if n > head + 2 then
    vals[#vals + 1] = "..."
    vals[#vals + 1] = num(t:get(n - 2))
    vals[#vals + 1] = num(t:get(n - 1))
  else
    for i = head, n - 1 do vals[#vals + 1] = num(t:get(i)) end
  end
  local norm = ""
  if float_dtypes[t:dtype_name()] and n > 0 then
    norm = ("  norm %s"):format(num(math.sqrt(t:sq_norm())))
  end
  return ("tensor %s  %s elements, %s%s\n  [%s]"):format(t:describe(), M.thousands(n),
                                                         M.bytes(t:bytes()), norm,
                                                         table.concat(vals, ", "))
end

------------------------------------------------------------------ modules

function M.is_module(v)
  return type(v) == "table" and type(v.children) == "table" and type(v.params) == "table" and
         type(v.walk) == "function"
end

local function subtree_params(m)
  local n = 0
  m:walk(function(x) for _, p in ipairs(x.params) do n = n + p.numel end end)
  return n
end

local function class_name(m)
  local mt = getmetatable(m)
  return mt and rawget(mt, "__name") or (mt and mt.__name) or "Module"
end

local function shape_text(shape) return "[" .. table.concat(shape, ",") .. "]" end

-- The tree of children with parameter counts, down to `depth` levels.
function M.module(m, depth)
  depth = depth or 4
  local lines = {}
  local function visit(x, name, indent, level)
    local own = {}
    for _, p in ipairs(x.params) do own[#own + 1] = p.name .. shape_text(p.shape) end
    lines[#lines + 1] = ("%s%s%s  %s params%s"):format(indent, name and (name .. ": ") or "",
                                                       class_name(x), M.count(subtree_params(x)),
                                                       #own > 0 and ("  (" .. table.concat(own, ", ") .. ")") or "")
    if level >= depth then
      if #x.children > 0 then
        lines[#lines + 1] = indent .. "  ... " .. #x.children .. " children"
      end
      return
    end
    for i, c in ipairs(x.children) do
      if i > M.CHILDREN and #x.children > M.CHILDREN + 1 then
        lines[#lines + 1] = ("%s  ... %d more (%s to %s)"):format(indent, #x.children - M.CHILDREN,
                                                                  tostring(x.children[i].name),
                                                                  tostring(x.children[#x.children].name))
        break
      end
      visit(c.module, c.name and tostring(c.name) or "(inline)", indent .. "  ", level + 1)
    end
  end
  visit(m, nil, "", 1)
  return table.concat(lines, "\n")
end

------------------------------------------------------------------ engine

function M.is_engine(v)
  local ok, engine = pcall(require, "luazero.zero.engine")
  return ok and type(v) == "table" and getmetatable(v) == engine.Engine
end

function M.engine(e)
  local L = e.L
  local dtype = e.dtype .. (e.half_grads and (" (grads " .. e.s.grad_dtype .. ")") or "")
  local m = lz.mem()
  return table.concat({
    ("engine: ZeRO stage %d, world %d (this is rank %d), %s"):format(e.stage, e.world, e.rank, dtype),
    ("  %s parameters (%s padded) in %d segments; this rank's shard %s elements"):format(
      M.thousands(L.numel), M.thousands(L.full_numel), #L.segments, M.thousands(L.shard_numel)),
    ("  steps %d (%d skipped), micro-steps %d, accumulation %d%s"):format(
      e.optimizer_steps, e.skipped_steps, e.micro, e.s.accum,
      e.s.micro_batch and (", micro-batch " .. e.s.micro_batch) or ""),
    ("  on this rank: params %s, grads %s, optimizer %s"):format(M.bytes(m.params),
      M.bytes(m.grads), M.bytes(m.optimizer)),
    "  engine:plan() says what lives where, engine:estimate() the bytes per tier and the",
    "  NVMe traffic per step; shards(engine), norms(engine), mem(),",
    "  gather(engine, name) look inside",
  }, "\n")
end

------------------------------------------------------------------ ledger

local categories = {}
for _, c in ipairs(lz.category_order) do categories[c] = true end

-- lz.mem() or lz.mem_peak(): only category keys (and peak_rss), numbers.
function M.is_ledger(v)
  if type(v) ~= "table" or getmetatable(v) then return false end
  local n = 0
  for k, x in pairs(v) do
    if not (categories[k] or k == "peak_rss") or type(x) ~= "number" then return false end
    n = n + 1
  end
  return n >= 3
end

function M.ledger(v, peak)
  peak = peak or lz.mem_peak()
  local lines = { ("%-12s %12s %12s"):format("category", "bytes", "peak") }
  local total = 0
  for _, c in ipairs(lz.category_order) do
    if v[c] then
      total = total + v[c]
      lines[#lines + 1] = ("%-12s %12s %12s"):format(c, M.bytes(v[c]), M.bytes(peak[c] or 0))
    end
  end
  lines[#lines + 1] = ("%-12s %12s"):format("total", M.bytes(total))
  if v.peak_rss then lines[#lines + 1] = ("%-12s %12s"):format("peak_rss", M.bytes(v.peak_rss)) end
  return table.concat(lines, "\n")
end

------------------------------------------------------------------ tables

local function key_text(k)
  if type(k) == "string" and k:match("^[%a_][%w_]*$") then return k end
  if type(k) == "string" then return ("[%q]"):format(k) end
  return "[" .. tostring(k) .. "]"
end

local function scalar(v)
  if type(v) == "string" then return ("%q"):format(v) end
  if type(v) == "number" then return v == math.floor(v) and math.abs(v) < 2 ^ 53 and
                                    ("%d"):format(v) or ("%.6g"):format(v) end
  return tostring(v)
end

function M.table(t, depth, indent, seen)
  depth, indent, seen = depth or M.DEPTH, indent or "", seen or {}
  if seen[t] then return "<cycle " .. tostring(t) .. ">" end
  if depth <= 0 then return tostring(t) end
  seen[t] = true
  local keys, n = {}, #t
  for k in pairs(t) do
    if not (type(k) == "number" and k >= 1 and k <= n and k == math.floor(k)) then
      keys[#keys + 1] = k
    end
  end
  table.sort(keys, function(a, b)
    if type(a) == type(b) and (type(a) == "string" or type(a) == "number") then return a < b end
    return type(a) < type(b)
  end)
  local items, shown = {}, 0
  local function add(text)
    shown = shown + 1
    if shown <= M.ITEMS then items[#items + 1] = indent .. "  " .. text end
  end
  for i = 1, n do add(M.inline(t[i], depth - 1, indent .. "  ", seen)) end
  for _, k in ipairs(keys) do add(key_text(k) .. " = " .. M.inline(t[k], depth - 1, indent .. "  ", seen)) end
  seen[t] = nil
  if shown == 0 then return "{}" end
  if shown > M.ITEMS then items[#items + 1] = indent .. ("  ... %d more"):format(shown - M.ITEMS) end
  return "{\n" .. table.concat(items, ",\n") .. "\n" .. indent .. "}"
end

-- A value inside a table: tensors and modules in one line.
function M.inline(v, depth, indent, seen)
  if type(v) == "table" then
    if M.is_module(v) or M.is_engine(v) then return tostring(v) end
    local mt = getmetatable(v)
    if mt and mt.__tostring then return tostring(v) end
    return M.table(v, depth, indent, seen)
  end
  if lz.is_tensor(v) then return "tensor " .. v:describe() end
  return scalar(v)
end

------------------------------------------------------------------ any value

function M.value(v)
  if lz.is_tensor(v) then return M.tensor(v) end
  if type(v) == "table" then
    if M.is_engine(v) then return M.engine(v) end
    if M.is_module(v) then return M.module(v) end
    local mt = getmetatable(v)
    if mt and mt.__tostring then return tostring(v) end
    if M.is_ledger(v) then return M.ledger(v) end
    return M.table(v)
  end
  if type(v) == "string" then return v end
  return scalar(v)
end

return M
