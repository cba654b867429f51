-- nn/packed_linear.lua — a Linear whose weight is several parameters stacked
-- by rows, one GEMM for all of them (Llama's q_proj, k_proj and v_proj: one
-- [(n_head + 2 n_kv_head) * head_dim, C] matrix writing the packed q|k|v
-- rows the attention kernel reads). With opts.bias each part has a bias too
-- (Qwen2's q_proj.bias, k_proj.bias, v_proj.bias), declared after every
-- weight, so the biases are one vector as the weights are one matrix.
--
-- A module's parameters lie one after another in every buffer that binds
-- them (the model's flat buffer, the ZeRO engine's segments), so the parts
-- are one matrix; their gradients lie the same way. Each part keeps its own
-- name (Hugging Face's q_proj.weight, ...), in the parent's namespace when
-- the parent adds this module with name false.
local ffi = require("ffi")
local lz = require("luazero")
local Linear = require("luazero.nn.linear")

local C = lz.C
local PackedLinear = Linear:extend("PackedLinear")

-- parts: { {name, rows}, ... } in row order (name: the part's module name,
-- its weight is name .. ".weight"); std: their init std. opts.bias: a bias
-- per part (name .. ".bias", zeros at init); default none.
function PackedLinear.new(n_in, parts, std, opts)
  local self = setmetatable({}, PackedLinear):init()
  self.n_in, self.has_bias = n_in, (opts and opts.bias) == true
  -- one GEMM reads every part: they freeze all or none (weight_grad)
  self.freeze_as_one = true
  self.parts, self.part_list, self.bias_list = {}, {}, {}
  local init, row0 = { kind = "normal", std = std or 0.02 }, 0
  for i, part in ipairs(parts) do
    local name, rows = part[1], part[2]
    self:param(name, { rows, n_in }, init, true, name .. ".weight")
    self.parts[name] = { row0 = row0, rows = rows }
    self.part_list[i] = name
    row0 = row0 + rows
  end
  if self.has_bias then
    for i, part in ipairs(parts) do
      local key = part[1] .. "_bias"
      self:param(key, { part[2] }, { kind = "zeros" }, false, part[1] .. ".bias")
      self.bias_list[i] = key
    end
  end
  self.n_out = row0
  return self
end

local wrap_out = ffi.typeof("lz_tensor *[1]")

-- The tensors keys name in `t` (module.p or module.g) as one tensor of
-- `dims` over their memory (borrowed: release frees it).
function PackedLinear:packed(t, keys, dims, what)
  local first = t[keys[1]]
  local base, at = ffi.cast("char *", first.data), 0
  for _, key in ipairs(keys) do
    if ffi.cast("char *", t[key].data) ~= base + at then
      error(("%s: the %s %s are not adjacent in memory; bind a module's parameters one after " ..
             "another"):format(self.path or "?", table.concat(self.part_list, ", "), what), 0)
    end
    at = at + t[key]:bytes()
  end
  local out = wrap_out()
  if C.lz_tensor_wrap(out, first.data, first.dtype, #dims, ffi.new("int64_t[?]", #dims, dims))
     ~= 0 then
    error(ffi.string(C.lz_last_error()), 0)
  end
  out[0].device = first.device -- the memory's device (wrap assumes the host's)
  return out[0]
end

function PackedLinear:weight()
  return self:packed(self.p, self.part_list, { self.n_out, self.n_in }, "weights")
end

function PackedLinear:bias()
  return self:packed(self.p, self.bias_list, { self.n_out }, "biases")
end

-- The gradients of keys, packed; nil when every part is frozen; freezing
-- some parts only is an error (one GEMM writes the gradient of all of them).
function PackedLinear:packed_grad(keys, dims, what)
  local g, n = self.g, 0
  for _, key in ipairs(keys) do if g[key] then n = n + 1 end end
  if n == 0 then return nil end
  if n < #keys then
    error(("%s: %s are one matrix here; freeze all of them or none")
          :format(self.path or "?", table.concat(self.part_list, ", ")), 0)
  end
  return self:packed(g, keys, dims, what)
end

function PackedLinear:weight_grad()
  return self:packed_grad(self.part_list, { self.n_out, self.n_in }, "gradients")
end

function PackedLinear:bias_grad()
  return self:packed_grad(self.bias_list, { self.n_out }, "bias gradients")
end

function PackedLinear:release(w, gw)
  C.lz_tensor_free(w)
  if gw then C.lz_tensor_free(gw) end
end

return PackedLinear
