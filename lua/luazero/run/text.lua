-- run/text.lua — token ids read back as text with a tokenizer: an id past
-- the tokenizer's vocabulary (a model's may be larger) shows as <id>. Used
-- by scripts/train.lua's sample and scripts/generate.lua's completions.
--
-- Each run of ids the tokenizer has is decoded in one call, as the
-- tokenizer decodes a sequence: a SentencePiece decoder strips the space of
-- the first piece only, and a character's bytes split over byte-fallback
-- pieces join again (one id at a time lost every space and broke those
-- characters).
local M = {}

function M.decode(tok, ids)
  local size = type(tok.vocab_size) == "function" and tok:vocab_size() or tok.vocab_size
  local parts, run = {}, {}
  local function flush()
    if #run > 0 then parts[#parts + 1] = tok:decode(run); run = {} end
  end
  for _, id in ipairs(ids) do
    if id < size then
      run[#run + 1] = id
    else
      flush()
      parts[#parts + 1] = ("<%d>"):format(id)
    end
  end
  flush()
  return table.concat(parts)
end

return M
