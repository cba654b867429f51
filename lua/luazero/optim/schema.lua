-- optim/schema.lua — an optimizer's config schema: the kinds a
-- hyperparameter can be, and reading a config's optimizer.params against
-- the schema an optimizer file declares. Checks raise config/values.lua's
-- one-line "config: " errors naming the key.
--
--   params = { { "lr", "number", min = 0, default = 1e-3 },
--              { "betas", "betas", default = { 0.9, 0.999 } },
--              { "momentum", "number", min = 0, below = 1, default = 0.9 } }
local cjson = require("cjson")
local values = require("luazero.config.values")

local M = {}

local fail, show, given = values.fail, values.show, values.given

-- kind -> check(key, value, declaration): the value, or a "config: " error.
M.KINDS = {
  -- a number >= min (default 0), and below `below` when the schema gives it
  number = function(key, v, d)
    local min = d.min or 0
    if d.below == nil then return values.number_at_least(key, v, min) end
    if type(v) ~= "number" or v ~= v or v < min or v >= d.below then
      fail("%s must be a number in [%s, %s) (got %s)", key, show(min), show(d.below), show(v))
    end
    return v
  end,
  -- Adam's and Lion's (beta1, beta2)
  betas = function(key, b)
    if type(b) ~= "table" or #b ~= 2 or type(b[1]) ~= "number" or type(b[2]) ~= "number" or
       b[1] < 0 or b[1] >= 1 or b[2] < 0 or b[2] >= 1 then
      fail("%s must be a list of two numbers in [0, 1), e.g. [0.9, 0.999] (got %s)", key,
           type(b) == "table" and cjson.encode(b) or show(b))
    end
    return { b[1], b[2] }
  end,
  boolean = function(key, v) return values.boolean(key, v) end,
  -- a whole number >= min (default 0), and below `below` when given
  count = function(key, v, d)
    local min = d.min or 0
    if not values.is_whole(v) or v < min or (d.below and v >= d.below) then
      fail("%s must be a whole number in [%s, %s) (got %s)", key, show(min),
           d.below and show(d.below) or "inf", show(v))
    end
    return v
  end,
  -- one of the strings the declaration's `values` lists (after the
  -- declaration's `prefix`, where given: "torch." of torch's dtype names)
  choice = function(key, v, d)
    local bare = v
    if d.prefix and type(v) == "string" and v:sub(1, #d.prefix) == d.prefix then
      bare = v:sub(#d.prefix + 1)
    end
    for _, x in ipairs(d.values or {}) do
      if bare == x then return bare end
    end
    local q = {}
    for i, x in ipairs(d.values or {}) do q[i] = cjson.encode(x) end
    fail("%s must be one of %s (got %s)", key, table.concat(q, ", "), show(v))
  end,
}

-- A declaration's error (the optimizer file's, not the user's config):
-- origin names the file.
local function bad(origin, fmt, ...)
  error(("optim: %s: " .. fmt):format(origin, ...), 0)
end

-- Checks a declared params list; returns the defaults table it declares
-- (key -> default) and the key -> declaration map.
function M.check(params, origin)
  if type(params) ~= "table" then bad(origin, "params must be a list of { key, kind, default = ... }") end
  local defaults, by_key = {}, {}
  for i, d in ipairs(params) do
    local key, kind = d[1], d[2]
    if type(key) ~= "string" or not M.KINDS[kind] then
      bad(origin, "params[%d] must be { key, kind, ... } with kind number, betas, boolean, count or choice " ..
          "(got %s, %s)", i, tostring(key), tostring(kind))
    end
    if d.default == nil then bad(origin, "params[%d] (%s) has no default", i, key) end
    M.KINDS[kind]("optim: " .. origin .. ": default of " .. key, d.default, d)
    defaults[key], by_key[key] = values.deep_copy(d.default), d
  end
  return defaults, by_key
end

-- The config's optimizer.params p over class (a registered optimizer):
-- its defaults, each declared key checked where given; the class's
-- read_config(p, key, type_name, unimplemented) reads its other keys and
-- returns the block's extra fields. A key neither declared nor accepted is
-- reported through unimplemented(name) unless it asks for nothing: false,
-- or the value the class's `quiet` gives for it. Returns params, extra.
function M.read(class, p, key, type_name, unimplemented)
  local out = values.deep_copy(class.defaults)
  for _, d in ipairs(class.params) do
    local v = p[d[1]]
    if given(v) then out[d[1]] = M.KINDS[d[2]](key .. d[1], v, d) end
  end
  local extra = class.read_config and class.read_config(p, key, type_name, unimplemented) or {}
  local accepted, quiet = class.accepted or {}, class.quiet or {}
  -- (a misspelling of a parameter is refused, whatever its value:
  -- weight_deacy is no decay, "nestrov": false leaves Nesterov on)
  local known = {}
  for _, d in ipairs(class.params) do known[d[1]] = true end
  for k in pairs(accepted) do known[k] = true end
  for k in pairs(quiet) do known[k] = true end
  for _, k in ipairs(values.sorted_keys(p)) do
    local v = p[k]
    local asks_nothing
    if quiet[k] ~= nil then asks_nothing = v == quiet[k] else asks_nothing = v == false end
    if out[k] == nil and not accepted[k] then
      values.refuse_misspelt(k, known, key, quiet)
      if not asks_nothing then unimplemented(key .. k) end
    end
  end
  return out, extra
end

-- The master weights' format torchao's bf16_stochastic_round flag in p asks
-- for: "bf16" (no fp32 master, the bf16 parameters updated through
-- stochastic rounding: zero/plan.lua, zero/states.lua) or nil (the fp32
-- master). For the read_config of every optimizer that accepts the flag.
function M.master_format(p, key)
  local sround = given(p.bf16_stochastic_round) and
                 values.boolean(key .. "bf16_stochastic_round", p.bf16_stochastic_round)
  return sround and "bf16" or nil
end

-- "lr 0.001 betas (0.9, 0.999) eps 1e-08": params in the schema's order
-- (the rest sorted), for start-up lines and checkpoint summaries.
function M.describe(params, schema)
  local parts, seen = {}, {}
  local function add(k, v)
    seen[k] = true
    if type(v) == "table" then
      local xs = {}
      for i, x in ipairs(v) do xs[i] = type(x) == "number" and ("%g"):format(x) or tostring(x) end
      v = "(" .. table.concat(xs, ", ") .. ")"
    elseif type(v) == "number" then
      v = ("%g"):format(v)
    end
    parts[#parts + 1] = k .. " " .. tostring(v)
  end
  for _, d in ipairs(schema or {}) do
    if params[d[1]] ~= nil then add(d[1], params[d[1]]) end
  end
  for _, k in ipairs(values.sorted_keys(params)) do
    if not seen[k] then add(k, params[k]) end
  end
  return table.concat(parts, " ")
end

return M
