-- test_examples.lua — the scripts in scripts/examples/ run for a few steps,
-- from a folder other than the checkout, and say what they should: the loss
-- falls (a model of one's own on 2 ranks at stage 3, a scripted schedule,
-- whose callback halves the learning rate); a custom loop resumed from its
-- checkpoint ends with the uninterrupted run's checksum. Each is short and
-- commented. (The LoRA example: tests/ref/test_examples.py.)
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")

local T = {}
local q, sh = support.quote, support.sh
local _, tmp, corpus = support.scratch_corpus(support.HAMLET, 60)
local EXAMPLES = lz.root .. "/scripts/examples/"

-- An example run from the scratch folder: its output, raising when it fails.
local function example(launch, name, args)
  local out, st = sh(("cd %s && %s %s %s %s"):format(q(tmp), q(lz.executable()), launch,
                                                     q(EXAMPLES .. name), args))
  assert(st == 0, name .. " failed: " .. out)
  return out
end

local function losses(out)
  local l = {}
  for v in out:gmatch("step %d+ loss (%S+)") do l[#l + 1] = tonumber(v) end
  return l
end

-- Each refuses missing arguments or a steps that is not a whole number with
-- its usage line, written as README runs it (luazero -m examples/NAME).
function T.each_example_names_its_usage()
  for _, c in ipairs({ { "own_model", "" }, { "custom_loop", "c.txt 0 out" },
                       { "lora", "folder c.jsonl out 2.5" }, { "schedule", "c.txt abc" } }) do
    local out, st = sh(("cd %s && %s -m examples/%s %s"):format(q(tmp), q(lz.executable()),
                                                               c[1], c[2]))
    assert(st ~= 0 and out:find("usage: luazero .*-m examples/" .. c[1] .. " "),
           c[1] .. " " .. c[2] .. ": " .. out)
  end
end

function T.each_example_is_short_and_commented()
  local n = 0
  for _, name in ipairs({ "own_model.lua", "custom_loop.lua", "lora.lua", "schedule.lua" }) do
    local lines, comments = 0, 0
    for line in io.lines(EXAMPLES .. name) do
      lines = lines + 1
      if line:match("^%s*%-%-") then comments = comments + 1 end
    end
    assert(lines <= 60, ("%s: %d lines, more than 60"):format(name, lines))
    assert(comments >= 5, ("%s: %d comment lines"):format(name, comments))
    n = n + 1
  end
  support.eq(n, 4, "examples")
end

function T.own_model_trains_at_stage_3_on_2_ranks()
  local out = example("-n 2", "own_model.lua", q(corpus) .. " 8")
  local l = losses(out)
  support.eq(#l, 8, "steps printed (rank 0 alone)")
  assert(l[8] < l[1] - 0.5, ("the loss did not fall: %s"):format(table.concat(l, " ")))
  assert(out:find("params_checksum %x+"), out)
end

function T.custom_loop_resumed_ends_as_the_uninterrupted_run()
  local whole = example("", "custom_loop.lua", ("%s 6 %s"):format(q(corpus), q(tmp .. "/a")))
  local resumed = example("", "custom_loop.lua", ("%s 6 %s %s"):format(q(corpus), q(tmp .. "/b"),
                                                                       q(tmp .. "/a/step-000003")))
  local a, b = whole:match("params_checksum (%x+)"), resumed:match("params_checksum (%x+)")
  assert(a and a == b, ("checksums %s (uninterrupted) and %s (resumed)"):format(a, b))
  assert(not resumed:find("step 3 loss"), "the resumed run began at step 4")
  local l = losses(whole)
  assert(l[6] < l[1], "the loss did not fall: " .. table.concat(l, " "))
  local z1 = whole:match("step 1 loss %S+ z_loss (%S+)")
  local z6 = whole:match("step 6 loss %S+ z_loss (%S+)")
  assert(tonumber(z6) < tonumber(z1), ("the z-loss term did not fall: %s -> %s"):format(z1, z6))
end

function T.schedule_callback_halves_the_learning_rate()
  local out = example("", "schedule.lua", q(corpus) .. " 15")
  local l = losses(out)
  assert(l[15] < l[1] - 1, "the loss did not fall: " .. table.concat(l, " "))
  -- warmup to 2e-2 over 5 steps, then the callback's peak
  support.eq(out:match("step 1 loss %S+ lr (%S+)"), "4.00e-03", "step 1's learning rate")
  local halved = out:match("step (%d+) val_loss %S+ best %S+ peak lr now 1%.00e%-02")
  assert(halved, "the callback never halved the peak: " .. out)
  local after = out:match(("step %d loss %%S+ lr (%%S+)"):format(tonumber(halved) + 1))
  support.eq(after, "1.00e-02", "the learning rate after the halving")
end

return T
