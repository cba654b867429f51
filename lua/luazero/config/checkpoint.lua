-- config/checkpoint.lua — DeepSpeed's "checkpoint" block. Its writer's
-- "decoupled": true (DeepSpeed writes checkpoints from a separate process
-- while training goes on) is luazero's background save, --async-save; the
-- rest of the block is reported by name unless it asks for nothing.
--   checkpoint.read(raw, cfg, unimpl)  -- fills cfg.checkpoint = { async = bool }
local values = require("luazero.config.values")

local M = {}

local boolean, block, given = values.boolean, values.block, values.given
local asks_for_nothing, sorted_keys = values.asks_for_nothing, values.sorted_keys

M.top_keys = { checkpoint = true }

-- tag_validation: every luazero checkpoint is checked whole on load (its
-- manifest, every shard's checksum), whatever the level asked for.
local accepted = { tag_validation = true }

function M.read(raw, cfg, unimpl)
  cfg.checkpoint = { async = false }
  local ck = raw.checkpoint
  if not given(ck) then return end
  block("checkpoint", ck)
  for _, k in ipairs(sorted_keys(ck)) do
    local v = ck[k]
    if k == "writer" and given(v) then
      block("checkpoint.writer", v)
      for _, wk in ipairs(sorted_keys(v)) do
        if wk == "decoupled" then
          if given(v[wk]) then cfg.checkpoint.async = boolean("checkpoint.writer.decoupled", v[wk]) end
        elseif not asks_for_nothing(v[wk]) then
          unimpl[#unimpl + 1] = "checkpoint.writer." .. wk
        end
      end
    elseif not accepted[k] and not asks_for_nothing(v) then
      unimpl[#unimpl + 1] = "checkpoint." .. k
    end
  end
end

return M
