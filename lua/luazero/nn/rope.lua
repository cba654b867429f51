-- nn/rope.lua — the inverse frequencies of rotary position embeddings, one
-- table shared by every attention layer of a model (nn/gqa.lua reads
-- inv_freq, and on_device: a copy made once where the activations live).
--
-- LongRoPE (Phi-3's 128k sizes) has two sets: the short one (inv_freq) for
-- sequences up to original_max positions, the long one past that, as
-- transformers picks them by the largest position + 1 of a forward; its
-- attention factor scales cos and sin (scale).
local lz = require("luazero")

local Rope = {}
Rope.__index = Rope

-- freqs: rotary_dim / 2 numbers (models/llama.lua's inv_freq). opts (nil:
-- none): long (the long set, as many numbers), original_max (the longest
-- sequence the short set serves), scale (cos and sin multiplied by it).
function Rope.new(freqs, opts)
  opts = opts or {}
  local self = setmetatable({ inv_freq = lz.from_table(freqs, { #freqs }, "f32", "workspace"),
                              scale = opts.scale, original_max = opts.original_max }, Rope)
  if opts.long then
    assert(#opts.long == #freqs and opts.original_max, "rope: long needs as many freqs and original_max")
    self.long = { inv_freq = lz.from_table(opts.long, { #freqs }, "f32", "workspace") }
  end
  return self
end

-- The set for a forward whose largest position + 1 is seq_len (nil: the
-- short one): a table with inv_freq and on_device.
function Rope:set_for(seq_len)
  if self.long and seq_len and seq_len > self.original_max then return self.long end
  return self
end

function Rope:free()
  for _, set in ipairs({ self, self.long or {} }) do
    if set.inv_freq then set.inv_freq:free() end
    if set.on_device then set.on_device:free() end
    set.inv_freq, set.on_device = nil, nil
  end
end

return Rope
