-- sweeps/example.lua — learning rate × ZeRO stage on gpt2-nano, 2 ranks a run.
--   luazero scripts/sweep.lua sweeps/example.lua --jobs 1
-- Every scripts/train.lua flag can go in base, grid or runs (docs/sweeps.md).
-- (its data the checkout's README.md, found from this file's folder, so the
-- sweep runs from any folder)
local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "."
return {
  name = "example",
  ranks = 2,
  base = { model = "gpt2-nano", data = here .. "/../README.md", steps = 30, ["seq-len"] = 64,
           ["micro-batch"] = 4, ["eval-every"] = 10, sample = 0 },
  grid = { lr = { 1e-3, 3e-3 }, stage = { 0, 3 } },
  runs = {
    { lr = 3e-3, stage = 2, dtype = "bf16" },
  },
}
