-- trainer.lua — one optimizer step of a model: gradient accumulation over
-- micro-batches, then clipping and the update; and validation loss.
-- The model gives forward(x, y) -> mean loss, backward(scale), zero_grad();
-- the batches come from anything with next_batch() -> inputs, targets.
local Trainer = {}
Trainer.__index = Trainer

-- opts: model, optimizer (AdamW), lr (a function of the 1-based step),
-- grad_accum (micro-batches per step, default 1), batches (next_batch()).
function Trainer.new(opts)
  return setmetatable({
    model = opts.model, optimizer = opts.optimizer, lr = opts.lr,
    grad_accum = opts.grad_accum or 1, batches = opts.batches, step_count = 0,
  }, Trainer)
end

-- Returns the step's mean loss, its learning rate and the gradient norm
-- before clipping.
function Trainer:step()
  local model, n = self.model, self.grad_accum
  self.step_count = self.step_count + 1
  model:zero_grad()
  local loss = 0
  for _ = 1, n do
    local x, y = self.batches:next_batch()
    loss = loss + model:forward(x, y)
    model:backward(1 / n)
  end
  local lr = self.lr(self.step_count)
  local norm = self.optimizer:step(lr)
  return loss / n, lr, norm
end

-- Mean loss over validation batches 1..n of `loader` (val_batch(i)).
function Trainer:evaluate(loader, n)
  local model, sum = self.model, 0
  model:evaluate()
  for i = 1, n do sum = sum + model:forward(loader:val_batch(i)) end
  model:train()
  return sum / n
end

return Trainer
