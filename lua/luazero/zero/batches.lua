-- zero/batches.lua — the engine's steps over a loader: train_batch (one
-- optimizer step of accumulation micro-steps) and evaluate (the loss over
-- validation batches), Engine methods (zero/engine.lua).
--
-- Instruction data (a loader with step_targets: data/packed.lua) trains on
-- the mean over every trained target of the step's global batch, as
-- transformers' Trainer does (num_items_in_batch): each micro-batch's mean
-- loss is weighted by its share of the step's trained targets, so the
-- gradient is the same at any split into ranks and micro-batches. Without
-- it each micro-batch's mean would count alike, and a micro-batch of few
-- trained tokens as much as one of many. A token stream trains every
-- position, its micro-batches weigh alike, and nothing is weighted.
local api = require("luazero.zero.api")

local M = {}

-- Whether the loader's steps are weighted by trained targets: its rows are
-- the engine's ranks' (the loader's world the engine's).
local function weighted(self, loader)
  return loader.step_targets ~= nil and (loader.world or 1) == self.world
end

-- One optimizer step: accumulation micro-steps from batches:next_batch().
function M.train_batch(self, batches)
  api.batches(batches)
  local n = self.s.accum
  local total = weighted(self, batches) and batches:step_targets(n)
  for _ = 1, n do
    local loss = self:forward(batches:next_batch())
    if total then
      self.loss_weight = total > 0 and n * self.world * self.model.target_count / total or 0
    end
    self:backward(loss)
  end
  self.loss_weight = nil
  return self:step()
end

-- Mean loss over validation batches 1..n (each rank's part of each), over
-- the ranks; over their trained targets for instruction data.
function M.evaluate(self, loader, n)
  api.evaluate(loader, n)
  -- the same n on every rank, before any forward (each forward of stage 3
  -- gathers parameters: other counts would part the ranks' collectives)
  if self.world > 1 then
    local all = self.comm.numbers({ n })
    for r, v in ipairs(all) do
      if v[1] ~= all[1][1] then
        error(("engine:evaluate: the ranks asked for different numbers of batches (rank 0: %d, " ..
               "rank %d: %d); give every rank the same n"):format(all[1][1], r - 1, v[1]), 0)
      end
    end
  end
  local model, sum = self.model, 0
  local targets = weighted(self, loader) and 0
  model:evaluate()
  for i = 1, n do
    local loss = self:forward(loader:val_batch(i))
    if targets then
      sum, targets = sum + loss * model.target_count, targets + model.target_count
    else
      sum = sum + loss
    end
  end
  model:train()
  self.forwarded = false -- nothing to run backward on
  if self.world == 1 then
    if targets then return targets > 0 and sum / targets or 0 end
    return sum / n
  end
  -- every rank's numbers, summed in rank order (the same bits on every rank)
  local total, count = 0, 0
  for _, v in ipairs(self.comm.numbers({ targets and sum or sum / n, targets or 0 })) do
    total, count = total + v[1], count + v[2]
  end
  if targets then return count > 0 and total / count or 0 end
  return total / self.world
end

return M
