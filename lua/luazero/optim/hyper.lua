-- optim/hyper.lua — an optimizer's hyperparameters: the config's
-- optimizer.params over the defaults its declaration gives.
local M = {}

-- A table of every key in defaults, each from params where given; betas
-- also as beta1, beta2.
function M.read(params, defaults)
  params = params or {}
  local out = {}
  for k, v in pairs(defaults) do
    if params[k] == nil then out[k] = v else out[k] = params[k] end
  end
  if out.betas then out.beta1, out.beta2 = out.betas[1], out.betas[2] end
  return out
end

return M
