-- io/oneline.lua — a refusal stays one line whatever the user's file holds:
-- the readers (config, tokenizer.json, data, safetensors, Hugging Face
-- folders, manifests) quote what they found, and a newline or another
-- control character in it is written \NNN. Plain Lua: the manifest's
-- checker runs without the luazero library (tests/fuzz).
--
--   error(oneline.of("data: " .. path .. ": " .. msg), 0)
local M = {}

local function escape(c) return "\\" .. c:byte() end

function M.of(msg) return (msg:gsub("%c", escape)) end

return M
