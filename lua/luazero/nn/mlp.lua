-- nn/mlp.lua — GPT-2's feed-forward: c_fc (C -> 4C), GELU (tanh), c_proj (4C -> C).
local lz = require("luazero")
local Module = require("luazero.nn.module")
local Linear = require("luazero.nn.linear")

local ops = lz.ops
local MLP = Module:extend("MLP")

-- proj_std: init std of c_proj, scaled down for the residual stream.
function MLP.new(n_embd, proj_std)
  local self = setmetatable({}, MLP):init()
  self.n_hidden = 4 * n_embd
  self:add("c_fc", Linear.new(n_embd, self.n_hidden))
  self:add("c_proj", Linear.new(self.n_hidden, n_embd, { std = proj_std }))
  return self
end

function MLP:forward(x)
  local h = self:run_forward(self.c_fc, x)
  local a = self:activation({ h:dim(1), h:dim(2), h:dim(3) })
  ops.gelu_forward(a, h)
  self.pre_gelu = h
  return self:run_forward(self.c_proj, a)
end

function MLP:backward(dy)
  local da = self:run_backward(self.c_proj, dy)
  ops.gelu_backward(da, da, self.pre_gelu) -- in place: dx may alias dy
  return self:run_backward(self.c_fc, da)
end

-- Besides c_fc and c_proj: the GELU output (its backward works in place).
function MLP:own_memory(B, T)
  return { activations = lz.arena_bytes(B * T * self.n_hidden) }
end

return MLP
