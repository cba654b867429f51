-- tests/ref/safetensors_open.lua — opens each safetensors FILE given with
-- luazero's reader and prints one line per file: "ok N" (its tensors) or
-- "refused MESSAGE". Run by tests/ref/test_safetensors.py.
local safetensors = require("luazero.checkpoint.safetensors")
for _, path in ipairs(arg) do
  local ok, st = pcall(safetensors.open, path)
  if ok then
    print(("ok %d"):format(#st.names))
    st:close()
  else
    print("refused " .. tostring(st):gsub("\n", "\\n"))
  end
end
