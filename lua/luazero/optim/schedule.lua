-- optim/schedule.lua — learning-rate schedules as functions of the 1-based step.
local M = {}

-- Linear warmup from lr/warmup to lr over `warmup` steps, then cosine decay
-- to min_lr at step `total` (llm.c, nanoGPT). min_lr defaults to lr / 10.
function M.warmup_cosine(lr, warmup, total, min_lr)
  min_lr = min_lr or lr * 0.1
  return function(step)
    if step <= warmup then return lr * step / warmup end
    if step >= total then return min_lr end
    local ratio = (step - warmup) / (total - warmup)
    return min_lr + 0.5 * (1 + math.cos(math.pi * ratio)) * (lr - min_lr)
  end
end

return M
