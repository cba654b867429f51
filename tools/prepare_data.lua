-- tools/prepare_data.lua — turns text into a token file (llm.c's format,
-- byte-level vocabulary: one uint16 token per byte). Run by tools/prepare-data.
--   luazero tools/prepare_data.lua INPUT... OUTPUT.bin
-- Several inputs are concatenated in order.
local data = require("luazero.data")

local function fail(msg)
  io.stderr:write("prepare-data: ", msg, "\n")
  os.exit(2)
end

if #arg < 2 or arg[1] == "--help" then
  print("usage: tools/prepare-data INPUT.txt... OUTPUT.bin\n" ..
        "Writes a token file: 256 int32 header (magic 20240520, version 1, token count),\n" ..
        "then one uint16 token per byte of the inputs.")
  os.exit(#arg < 2 and arg[1] ~= "--help" and 2 or 0)
end

local parts = {}
for i = 1, #arg - 1 do
  local f, err = io.open(arg[i], "rb")
  if not f then fail(arg[i] .. ": cannot read it (" .. tostring(err) .. ")") end
  parts[#parts + 1] = f:read("*a") or ""
  f:close()
end
local text = table.concat(parts)
if #text == 0 then fail("the inputs are empty; give a text file with something in it") end
if #text > 2 ^ 31 - 1 then fail("more than 2^31 tokens; split the input") end
local out = arg[#arg]
local n = data.write_token_file(out, text)
print(("prepare-data: %s: %d tokens (byte level, vocab 256)"):format(out, n))
