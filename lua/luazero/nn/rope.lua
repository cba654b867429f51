-- nn/rope.lua — the inverse frequencies of rotary position embeddings, one
-- table shared by every attention layer of a model (nn/gqa.lua reads
-- inv_freq, and on_device: a copy made once where the activations live).
local lz = require("luazero")

local Rope = {}
Rope.__index = Rope

-- freqs: head_dim / 2 numbers (models/llama.lua's inv_freq).
function Rope.new(freqs)
  return setmetatable({ inv_freq = lz.from_table(freqs, { #freqs }, "f32", "workspace") }, Rope)
end

function Rope:free()
  if self.inv_freq then self.inv_freq:free() end
  if self.on_device then self.on_device:free() end
  self.inv_freq, self.on_device = nil, nil
end

return Rope
