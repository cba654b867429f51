-- run/text.lua — token ids read back as text with a tokenizer: an id past
-- the tokenizer's vocabulary (a model's may be larger) shows as <id>. Used
-- by scripts/train.lua's sample and scripts/generate.lua's completions.
local M = {}

function M.decode(tok, ids)
  local size = type(tok.vocab_size) == "function" and tok:vocab_size() or tok.vocab_size
  local parts = {}
  for i, id in ipairs(ids) do
    parts[i] = id < size and tok:decode({ id }) or ("<%d>"):format(id)
  end
  return table.concat(parts)
end

return M
