-- zero/agree.lua — the ranks build one engine: before any other collective,
-- zero.initialize checks that every rank was given the same seed, the same
-- settings (stage, dtype, optimizer and its parameters, clipping,
-- accumulation, buckets, offload) and the same trainable parameters (and,
-- at stage 0, runs the same CPU code paths). A rank
-- given its own seed or lr would otherwise train its copy or its shard
-- apart from the others with no error (DeepSpeed broadcasts rank 0's weights
-- at start-up; here each rank draws them from the seed).
--
--   agree.check(comm, s, opts, model)   -- errors on every rank alike
local lz = require("luazero")

local M = {}

-- Per-rank by nature: each rank's own files (DeepSpeed's nvme_path is one
-- string for the job; a script may still point ranks at their own disks).
local PER_RANK = { nvme_path = true, aio = true }

-- The config's names for the engine's settings, for messages.
local CONFIG_NAME = {
  stage = "zero_optimization.stage", dtype = "fp16/bf16.enabled",
  accum = "gradient_accumulation_steps", micro_batch = "train_micro_batch_size_per_gpu",
  clip = "gradient_clipping", optimizer = "optimizer", grad_dtype = "data_types.grad_accum_dtype",
  offload_opt = "zero_optimization.offload_optimizer",
  offload_param = "zero_optimization.offload_param", ep_size = "moe.ep_size",
}

-- A value as text, the same on every rank for the same value: numbers to
-- 17 digits, tables by sorted keys.
local function text(v)
  if type(v) == "number" then return ("%.17g"):format(v) end
  -- (a function's or a pointer's text is its address, another on each rank)
  if type(v) == "function" or type(v) == "userdata" then return "<" .. type(v) .. ">" end
  if type(v) == "cdata" then
    local ok, n = pcall(tonumber, v)
    return ok and n and ("%.17g"):format(n) or "<cdata>"
  end
  if type(v) ~= "table" then return tostring(v) end
  local keys = {}
  for k in pairs(v) do
    if not PER_RANK[k] then keys[#keys + 1] = k end
  end
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
  local parts = {}
  for _, k in ipairs(keys) do parts[#parts + 1] = tostring(k) .. "=" .. text(v[k]) end
  return "{" .. table.concat(parts, ", ") .. "}"
end

-- The trainable parameters: names and sizes in order.
local function params_text(model)
  local parts = {}
  for _, e in ipairs(model:trainable_table()) do
    parts[#parts + 1] = e.name .. ":" .. tostring(e.numel)
  end
  return table.concat(parts, ";")
end

-- At stage 0 on the CPU every rank updates its own copy of every
-- parameter, so the ranks' CPU code paths (lz.cpu_path) must be the same
-- too: ranks on CPUs with other paths (AVX2 beside AVX-512) would update
-- their copies to other bits and part. From stage 1 one rank updates each
-- parameter and the others receive its bits.
local function cpu_item(s, opts)
  -- (the sim device runs the CPU's kernels; the 8-bit update's forms give
  -- one set of bits, and a bf16 path is told by native or f32, not why)
  if s.stage ~= 0 or (opts.device and opts.device ~= "cpu" and opts.device ~= "sim") then
    return nil
  end
  return { "CPU code paths", lz.cpu_path({ bf16 = s.dtype == "bf16", brief = true }),
           why = "at ZeRO stage 0 every rank updates its own copy of the weights, and copies " ..
                 "updated on other code paths would part: run the ranks on one kind of CPU, " ..
                 "or give stage 1 or higher (each parameter updated by one rank)" }
end

-- What must agree, in a fixed order: { name, text } pairs.
local function items(s, opts, model)
  local list = { { "seed", text(opts.seed or 0) } }
  if type(opts.lr) == "number" then list[#list + 1] = { "lr (zero.initialize)", text(opts.lr) } end
  local keys = {}
  for k in pairs(s) do
    if not PER_RANK[k] then keys[#keys + 1] = k end
  end
  table.sort(keys)
  for _, k in ipairs(keys) do list[#list + 1] = { CONFIG_NAME[k] or k, text(s[k]) } end
  list[#list + 1] = { "the model's trainable parameters", params_text(model) }
  list[#list + 1] = cpu_item(s, opts)
  return list
end

function M.check(comm, s, opts, model)
  local W, rank = comm.size(), comm.rank()
  if W == 1 then return end
  local list = items(s, opts, model)
  -- each item's xxh64 as two 32-bit words (exact in a double), every rank's
  local vals = {}
  for i, it in ipairs(list) do
    local h = lz.xxh64(it[2], #it[2])
    vals[2 * i - 1], vals[2 * i] = tonumber(h % 4294967296ULL), tonumber(h / 4294967296ULL)
  end
  local all = comm.numbers(vals)
  for i, it in ipairs(list) do
    local differ = {}
    for r = 2, W do
      if all[r][2 * i - 1] ~= all[1][2 * i - 1] or all[r][2 * i] ~= all[1][2 * i] then
        differ[#differ + 1] = tostring(r - 1)
      end
    end
    if #differ > 0 then
      local shown = #it[2] > 200 and it[2]:sub(1, 200) .. "..." or it[2]
      if it.why then
        error(("initialize: the ranks run different %s: rank%s %s differ%s from rank 0's (this " ..
               "rank, %d, runs %s); %s"):format(it[1], #differ > 1 and "s" or "",
               table.concat(differ, ", "), #differ > 1 and "" or "s", rank, shown, it.why), 0)
      end
      error(("initialize: the ranks were given different %s: rank%s %s differ%s from rank 0's " ..
             "(this rank, %d, has %s). Every rank must build its engine from the same config, " ..
             "seed and model"):format(it[1], #differ > 1 and "s" or "", table.concat(differ, ", "),
                                      #differ > 1 and "" or "s", rank, shown), 0)
    end
  end
end

return M
