-- tensor_guard.lua — what tensor methods check before C touches memory: a
-- tensor whose header is gone (freed, or its arena freed), whole numbers
-- in range (indices, offsets, dimensions), and shapes whose bytes overflow.
-- Each raises a one-line error at the level of the method's caller.
local M = {}

-- Tensors Lua may no longer touch, by cdata object (weak keys): true when
-- t:free() released the header, the arena for an arena's tensor (gone once
-- the arena is freed). Methods ask here, not the freed header.
M.dead = setmetatable({}, { __mode = "k" })

-- Why an arena can no longer be used, or nil: freed, or (lz.arena_over)
-- the tensor whose memory it lies in is gone.
function M.arena_gone(a)
  if a.handle == nil then return "its arena was freed" end
  local base = a.base
  if base ~= nil and M.dead[base] and M.gone(base) then
    return "the tensor its arena lies over (lz.arena_over) was freed"
  end
end

-- Why t's header is gone, or nil.
function M.gone(t)
  local d = M.dead[t]
  if d == true then return "it was freed (t:free())" end
  if d then return M.arena_gone(d) end
end

-- t, refused when its header is gone (the error at `level`, default 3).
function M.live(t, what, level)
  local why = M.dead[t] and M.gone(t)
  if why then
    error(("luazero: %s of a freed tensor: %s; use a live tensor"):format(what, why), level or 3)
  end
  return t
end

-- v as a whole number in lo..hi (an index, offset or dimension of t), else
-- an error naming the method, the value and the range.
function M.whole_in(t, what, name, v, lo, hi)
  if type(v) == "cdata" then v = tonumber(v) end
  if type(v) ~= "number" or v ~= math.floor(v) then
    error(("luazero: %s: %s %s is not a whole number"):format(what, name, tostring(v)), 3)
  end
  if v < lo or v > hi then
    error(("luazero: %s: %s %.0f is outside %s (%s)"):format(what, name, v, t:describe(),
          hi < lo and "it has no elements" or ("%d to %d"):format(lo, hi)), 3)
  end
  return v
end

-- Bytes past which no tensor is addressed (int64_t offsets and sizes in C).
M.MAX_BYTES = 2 ^ 63

-- v as a count (of bytes, elements) for `what`: a whole number from 0 to
-- below MAX_BYTES, else an error at `level` (default 3) naming it.
function M.count(what, v, level)
  if type(v) == "cdata" then v = tonumber(v) end
  if type(v) ~= "number" or v ~= v or v < 0 or v ~= math.floor(v) or v >= M.MAX_BYTES then
    error(("luazero: %s is %s; give a whole number from 0 to below 2^63")
          :format(what, type(v) == "string" and ("%q"):format(v) or
                  type(v) == "number" and v == math.floor(v) and math.abs(v) < 1e300 and
                  ("%.0f"):format(v) or tostring(v)), level or 3)
  end
  return v
end

-- A shape: a size or a table of up to 4 sizes (whole numbers >= 0) whose
-- elements of elem_size bytes (dtype `dtype`) stay below MAX_BYTES. Returns
-- the table; errors at `level` (default 3).
function M.shape(shape, elem_size, dtype, level)
  level = level or 3
  if type(shape) == "number" then shape = { shape } end
  if type(shape) ~= "table" or #shape > 4 then
    error("luazero: a shape is a table of up to 4 sizes, e.g. {4, 64}", level)
  end
  local bytes = elem_size
  for i = 1, #shape do
    local s = shape[i]
    if type(s) ~= "number" or s < 0 or s ~= math.floor(s) or s >= M.MAX_BYTES then
      error("luazero: shape entry " .. i .. " is " .. tostring(s) ..
            "; sizes are whole numbers from 0 to 2^63", level)
    end
    bytes = bytes * s
  end
  if bytes >= M.MAX_BYTES then
    local t = {}
    for i = 1, #shape do t[i] = ("%.0f"):format(shape[i]) end
    error(("luazero: shape {%s} of %s is %.3g bytes, past the 2^63 a tensor can address; " ..
           "check the sizes"):format(table.concat(t, ", "), dtype, bytes), level)
  end
  return shape
end

return M
