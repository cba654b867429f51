-- nn/qk_norm_full.lua — OLMoE's QK-norm (OlmoeAttention): an RMSNorm over
-- the whole q projection (all heads together, weight q_norm.weight
-- [n_head * head_dim]) and one over the whole k projection (k_norm.weight
-- [n_kv_head * head_dim]) inside the packed q|k|v rows, before the rotary
-- turn; then, where clip_qkv is set, q, k and v clamped to [-clip, clip].
-- The parent adds it with name false (self_attn.q_norm.weight, ...).
-- Runs on host memory (the cpu device), in fp32.
local ffi = require("ffi")
local lz = require("luazero")
local Module = require("luazero.nn.module")

local QKNormFull = Module:extend("QKNormFull")

function QKNormFull.new(q_width, kv_width, eps, clip)
  local self = setmetatable({}, QKNormFull):init()
  self.q_width, self.kv_width, self.eps, self.clip = q_width, kv_width, eps or 1e-5, clip
  self:param("q_w", { q_width }, { kind = "ones" }, false, "q_norm.weight")
  self:param("k_w", { kv_width }, { kind = "ones" }, false, "k_norm.weight")
  return self
end

local function floats(t)
  if t:device_name() ~= "cpu" then
    error(("attention: the whole-projection QK-norm runs on the cpu for now (got a tensor " ..
           "on %s); use --device cpu"):format(t:device_name()), 0)
  end
  return ffi.cast("float *", t.data)
end

-- The pieces of a row: { offset, width, weight key } for q and k.
function QKNormFull:parts()
  return { { 0, self.q_width, "q_w" }, { self.q_width, self.kv_width, "k_w" } }
end

function QKNormFull:forward(qkv)
  local B, T, W = qkv:dim(1), qkv:dim(2), qkv:dim(3)
  local N = B * T
  local y = self:activation({ B, T, W })
  self.rstd = self:activation({ N, 2 })
  local px, py, pr = floats(qkv), floats(y), floats(self.rstd)
  ffi.copy(py, px, 4 * N * W)
  for i, part in ipairs(self:parts()) do
    local at, n = part[1], part[2]
    local w = floats(self:cast(self.p[part[3]], "f32"))
    for r = 0, N - 1 do
      local x, o = px + r * W + at, py + r * W + at
      local ss = 0
      for c = 0, n - 1 do ss = ss + x[c] * x[c] end
      pr[r * 2 + i - 1] = 1 / math.sqrt(ss / n + self.eps)
      local rs = pr[r * 2 + i - 1]
      for c = 0, n - 1 do
        local xn = ffi.cast("float", x[c] * rs)
        o[c] = w[c] * tonumber(xn)
      end
    end
  end
  self.clipped = nil
  if self.clip then
    -- which values the clamp moved: their gradient stops there
    local c, moved = self.clip, ffi.new("uint8_t[?]", N * W)
    for k = 0, N * W - 1 do
      if py[k] > c then
        py[k], moved[k] = c, 1
      elseif py[k] < -c then
        py[k], moved[k] = -c, 1
      end
    end
    self.clipped = moved
  end
  self.input = qkv
  return y
end

-- dx is written over dy (the attention's dqkv scratch); v's gradient passes
-- (but for the clamp).
function QKNormFull:backward(dy)
  local B, T, W = dy:dim(1), dy:dim(2), dy:dim(3)
  local N = B * T
  local pd, px, pr = floats(dy), floats(self.input), floats(self.rstd)
  local moved = self.clipped
  if moved then
    for k = 0, N * W - 1 do
      if moved[k] == 1 then pd[k] = 0 end
    end
  end
  for i, part in ipairs(self:parts()) do
    local at, n = part[1], part[2]
    local w = floats(self:cast(self.p[part[3]], "f32"))
    local gw = self.g[part[3]]
    if gw and gw:dtype_name() ~= "f32" then
      error("attention: the whole-projection QK-norm accumulates f32 gradients only", 0)
    end
    local pg = gw and floats(gw)
    for r = 0, N - 1 do
      local x, d = px + r * W + at, pd + r * W + at
      local rs = pr[r * 2 + i - 1]
      local dot = 0
      for c = 0, n - 1 do
        if pg then pg[c] = pg[c] + d[c] * x[c] * rs end
        dot = dot + w[c] * d[c] * x[c]
      end
      local k = rs * rs * rs * dot / n
      for c = 0, n - 1 do d[c] = rs * w[c] * d[c] - x[c] * k end
    end
  end
  return dy
end

-- The normed rows and 1/rms; casts: both weights in forward and backward.
function QKNormFull:own_memory(B, T, dtype)
  local x = lz.arena_bytes(B * T * (self.q_width + 2 * self.kv_width))
  return { input = x, activations = x + lz.arena_bytes(B * T * 2),
           casts = 2 * Module.param_cast_bytes(self.q_width + self.kv_width, dtype) }
end

return QKNormFull
