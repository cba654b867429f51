-- tests/ref/family_run.lua — the luazero side of tests/ref/family_ref.py: a
-- Hugging Face folder's model (fp32, one rank) and its loss on a fixed batch,
-- printed as JSON with the batch's tokens.
--   luazero tests/ref/family_run.lua --init FOLDER [--grads FILE]
--       --init as scripts/train.lua reads it (luazero/hf.lua); with --grads,
--       one backward too: every parameter's gradient in canonical order
--       written to FILE (raw f32), and the parameter table in the JSON
--   luazero tests/ref/family_run.lua --hf FOLDER --adapters DIR
--       the base with PEFT adapters, as scripts/eval.lua --adapters loads them
--   --pad N   the second row's last N tokens are padding, as data/packed.lua
--             lays it (target -1, a segment of its own, mask 0)
local cjson = require("cjson")
local ffi = require("ffi")
local lz = require("luazero")
local rng = require("luazero.rng")
local models = require("models.registry")

local opts, i = {}, 1
while arg[i] do
  opts[arg[i]:gsub("^%-%-", "")] = arg[i + 1]
  i = i + 2
end
local B, T = 2, 16

local engine, cfg, w
if opts.adapters then
  w = require("luazero.inference").open({ models = models, lora = require("models.lora"),
                                           hf = opts.hf, adapters = opts.adapters,
                                           micro_batch = B, seq_len = T })
  engine, cfg = w.engine, w.cfg
else
  local path = assert(opts.init, "usage: luazero tests/ref/family_run.lua --init FOLDER")
  cfg = models.from_hf_config(path .. "/config.json")
  engine = require("luazero.zero").initialize({ model = models.new(cfg), batch = { B, T },
                                                comm = require("luazero.comm").init("local"),
                                                config = { train_micro_batch_size_per_gpu = B } })
  require("luazero.hf").load_into(engine, path)
end

local x = lz.tensor({ B, T }, "i32")
local y = lz.tensor({ B, T }, "i32")
local r, tokens = rng.new(5), {}
for k = 0, B * T - 1 do x:set(k, r:int(cfg.vocab)) end
for k = 0, B * T - 1 do y:set(k, r:int(cfg.vocab)) end
for k = 0, B * T - 1 do tokens[#tokens + 1] = x:get(k) end
for k = 0, B * T - 1 do tokens[#tokens + 1] = y:get(k) end
local extra
local pad = tonumber(opts.pad or 0)
if pad > 0 then
  extra = { pos = lz.tensor({ B, T }, "i32"), seg = lz.tensor({ B, T }, "i32"),
            mask = lz.tensor({ B, T }, "i32") }
  for k = 0, B * T - 1 do
    local t, padding = k % T, k >= B * T - pad
    local j = padding and T - pad or 0
    extra.pos:set(k, t - j)
    extra.seg:set(k, padding and 1 or 0)
    extra.mask:set(k, padding and 0 or 1)
    if padding then y:set(k, -1) end
  end
end
local loss = engine:forward(x, y, extra)
local out = { loss = ("%.17g"):format(loss), tokens = tokens, vocab = cfg.vocab,
              padded_vocab = cfg.padded_vocab }
-- An MoE model's load-balancing loss (without its coefficient) and tokens per expert.
local routed = engine.model.router_metrics and engine.model:router_metrics()
if routed then
  out.aux_loss = engine.model.aux and ("%.17g"):format(engine.model.aux.loss)
  out.expert_tokens = routed.expert_tokens
end

if opts.grads then
  engine:backward(loss)
  -- The engine's gradient segments (padded) put back in canonical order.
  local g = lz.tensor({ engine.L.numel }, "f32", "workspace")
  for _, seg in ipairs(engine.L.segments) do
    g:view(seg.entries[1].offset, { seg.numel })
     :copy(engine.grads:view(seg.full_offset, { seg.numel }))
  end
  local f = assert(io.open(opts.grads, "wb"))
  f:write(ffi.string(g.data, g:bytes()))
  f:close()
  g:free()
  local params = {}
  for k, e in ipairs(engine.model.param_table) do
    params[k] = { name = e.name, shape = e.shape, offset = e.offset, numel = e.numel }
  end
  out.params = params
end
print(cjson.encode(out))
