-- io/decimal.lua — a number as the fewest decimal digits that read back as
-- the same double (Python's repr of a finite float, without its ".0"): a
-- whole number below 2^53 without a point, another in 15 to 17 significant
-- digits. What writes numbers for people and for Python's readers uses it:
-- the CSV monitor, the chat templates' tojson, a sweep's flags.
--
--   decimal.shortest(1 / 3)   --> "0.3333333333333333"
local M = {}

-- v a number; NaN and the infinities as tostring gives them (the callers
-- spell those their own way first).
function M.shortest(v)
  if v == math.floor(v) and math.abs(v) < 2 ^ 53 then return ("%d"):format(v) end
  for digits = 15, 17 do
    local t = ("%." .. digits .. "g"):format(v)
    if tonumber(t) == v then return t end
  end
  return tostring(v)
end

return M
