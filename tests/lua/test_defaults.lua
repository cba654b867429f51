-- test_defaults.lua — scripts/train.lua's defaults are what docs/training.md
-- says they are: the micro-batch (8, and the default model's own), the
-- warmup and the default model's learning rate (the defaults whose 300-step figure on tinyshakespeare
-- docs/training.md reports, "Defaults that learn"), and the run uses them.
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local config = require("luazero.config")
local models = require("models.registry")

local T = {}
local eq = support.eq

local function docs()
  local f = assert(io.open(lz.root .. "/docs/training.md", "rb"))
  local text = f:read("*a")
  f:close()
  return text
end

-- The default column of the flags table's row for `flag`.
local function flag_default(text, flag)
  local row = text:match("\n| `" .. flag:gsub("%-", "%%-") .. " [^`]*` | ([^|]*) |")
  return assert(row, "docs/training.md: no row for " .. flag)
end

function T.documented_defaults_are_the_code_s()
  local text = docs()
  local td = config.train_defaults
  eq(tonumber(flag_default(text, "--micro-batch"):match("else (%d+)")), td.micro_batch,
     "--micro-batch's default")
  local pct, most = flag_default(text, "--warmup"):match("(%d+)%% of `%-%-steps`, at most (%d+)")
  eq(tonumber(pct) / 100, td.warmup_fraction, "--warmup's fraction")
  eq(tonumber(most), td.warmup_max, "--warmup's most")
  local mb, lr = text:match("\n| `gpt2%-nano` |[^\n]*| (%d+) | ([%d.e%-]+) |\n")
  eq(tonumber(mb), models.config("gpt2-nano").micro_batch, "gpt2-nano's default micro-batch")
  eq(tonumber(lr), models.config("gpt2-nano").lr, "gpt2-nano's default lr")
  local gpt2_mb = text:match("\n| `gpt2` |[^\n]*| (%d+) | [%d.e%-]+ |\n")
  eq(tonumber(gpt2_mb), models.config("gpt2").micro_batch or td.micro_batch, "gpt2's micro-batch")
  -- the figure of the measured run
  local cmd, val = text:match("`(luazero scripts/train.lua %-%-data tinyshakespeare.txt " ..
                              "%-%-steps 300)` reaches a validation loss of ([%d.]+)")
  assert(cmd and tonumber(val) < 2.2, "docs/training.md reports the 300-step run below 2.2")
end

-- A run without flags says the batch and schedule those defaults give.
function T.a_run_without_flags_uses_them()
  local write = support.scratch()
  local lines = {}
  for i = 1, 400 do lines[i] = ("line %d: %d\n"):format(i, i * 7919 % 1000) end
  local data = write("d.txt", table.concat(lines))
  local td = config.train_defaults
  local out, st = support.sh(("cd %s && %s scripts/train.lua --data %s --steps 1 --sample 0 " ..
                        "--n-layer 1 --context 16 --eval-batches 1")
                       :format(support.quote(lz.root), support.quote(lz.executable()),
                               support.quote(data)))
  assert(st == 0, out)
  local B = tonumber(out:match("\nbatch (%d+) x 16 tokens"))
  eq(B, models.config("gpt2-nano").micro_batch, "gpt2-nano's batch without --micro-batch")
  local lr = tonumber(out:match("; lr ([%d.e%-]+), warmup"))
  eq(lr, models.config("gpt2-nano").lr, "the lr without --lr")
  local warmup = tonumber(out:match("warmup (%d+) %+ cosine"))
  eq(warmup, math.min(td.warmup_max, math.floor(1 * td.warmup_fraction)), "the warmup of 1 step")
end

return T
