-- test_run_parts.lua — the scripts are made of lua/luazero/run/'s parts:
-- train, eval and generate refuse the same bad value of a flag they share
-- with the same line and exit status, the flags naming trained weights are
-- declared once for eval and generate, the scripts leave parsing and exiting
-- to the parts; and no file of core/, lua/, scripts/, tools/ passes 800
-- lines (scripts/train.lua stays under 500).
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")

local T = {}
local write_file = support.scratch()
local corpus = write_file("corpus.txt", ("It was the best of times, it was the worst of times.\n"):rep(60))
local examples = write_file("chat.jsonl", '{"prompt": "a", "completion": "b"}\n')

-- scripts/NAME.lua with flags: its output and exit status.
local function script(name, flags)
  return support.sh(("cd %s && %s scripts/%s.lua %s"):format(support.quote(lz.root),
                    support.quote(lz.executable()), name, flags))
end

-- The one line a refused run prints, without the script's name, asserting
-- exit status 2.
local function refusal(name, flags)
  local out, st = script(name, flags)
  assert(st == 2, ("%s %s: exit %s, expected 2:\n%s"):format(name, flags, tostring(st), out))
  local line = out:match("^" .. name .. ": ([^\n]*)\n$")
  assert(line, ("%s %s: not one line starting %q:\n%s"):format(name, flags, name .. ": ", out))
  return line
end

function T.a_shared_flag_with_a_bad_value_is_refused_alike_by_train_eval_and_generate()
  local data = "--data " .. support.quote(corpus)
  -- a checkpoint for generate, which opens the weights before the tokenizer
  local ck = select(2, support.scratch())
  local out, st = script("train", "--model gpt2-nano --n-layer 1 --n-embd 32 --n-head 2 " ..
                         "--context 16 --micro-batch 2 --steps 1 --sample 0 --eval-batches 1 " ..
                         data .. " --save " .. support.quote(ck))
  assert(st == 0, out)
  local load = "--load " .. support.quote(ck)
  local no_json = select(2, support.scratch()) -- a folder without tokenizer.json
  local cases = {
    -- flag and value, then the scripts sharing the flag with what else each needs
    { "--micro-batch 0", "--micro-batch must be >= 1 (got 0)",
      { train = data, eval = data } },
    { "--seq-len -2", "--seq-len must be >= 1 (got -2)", { train = data, eval = data } },
    { "--seed 1.5", "--seed: '1.5' is not a whole number",
      { train = data, generate = "--prompt a" } },
    { "--dtype", "--dtype needs a value", { train = data, eval = data, generate = "" } },
    { "--model gpt2-nano --model gpt2", "--model is given twice (--model gpt2-nano, then " ..
      "--model gpt2); give it once", { train = data, eval = data, generate = "" } },
    { "--tokenizer /nonexistent/tok", "tokenizer: /nonexistent/tok: cannot read it",
      { train = "--data " .. support.quote(examples),
        eval = "--hf /nonexistent/hf --data " .. support.quote(examples) } },
    { "--tokenizer " .. support.quote(no_json), ("tokenizer: %s/tokenizer.json: cannot read it")
      :format(no_json), { train = data, eval = load .. " --data " .. support.quote(examples),
                          generate = load .. " --prompt a" } },
    { "--data /nonexistent/corpus.txt", "data: /nonexistent/corpus.txt: ",
      { train = "", eval = "--load /nonexistent/ck" } },
    { "--no-such-flag", "unknown flag --no-such-flag (--help lists the flags)",
      { train = data, eval = data, generate = "" } },
  }
  for _, c in ipairs(cases) do
    local seen = {}
    for _, name in ipairs({ "train", "eval", "generate" }) do
      local rest = c[3][name]
      if rest then
        local line = refusal(name, rest .. " " .. c[1])
        assert(line:find(c[2], 1, true), ("%s %s: %q does not hold %q"):format(name, c[1], line, c[2]))
        seen[#seen + 1] = line
      end
    end
    assert(#seen >= 2, c[1])
    for i = 2, #seen do support.eq(seen[i], seen[1], c[1] .. ": the line of each script") end
  end
end

-- An option of the executable written after the script (-n, --restarts,
-- --quiet-ranks) is named as luazero's, with where it goes, by each script.
function T.luazeros_own_options_after_the_script_say_where_they_go()
  for _, name in ipairs({ "train", "eval", "generate" }) do
    for _, c in ipairs({ { "--restarts 2", "--restarts 2" }, { "-n 2", "-n 2" },
                         { "--quiet-ranks --data x", "--quiet-ranks" } }) do
      local line = refusal(name, "--dtype fp32 " .. c[1])
      local flag = c[2]:match("^%S+")
      local want = ("%s is an option of luazero itself, not of this script: give it before the " ..
                    "script (luazero %s scripts/%s.lua ...;"):format(flag, c[2], name)
      assert(line:find(want, 1, true), ("%s: %q does not hold %q"):format(name, line, want))
    end
  end
end

-- --help: each script's usage line, and the flags naming trained weights
-- (--load, --model, --model-config, --adapters) word for word in eval and
-- generate; train's --model says the named sizes.
function T.help_prints_each_scripts_usage_and_the_weights_flags_once_declared()
  local helps = {}
  for _, name in ipairs({ "train", "eval", "generate" }) do
    local out, st = script(name, "--help")
    support.eq(st, 0, name .. " --help's exit status")
    assert(out:find("^usage: luazero scripts/" .. name .. "%.lua "), out)
    helps[name] = out
  end
  for _, flag in ipairs({ "load", "model", "model-config", "adapters" }) do
    local line = helps.eval:match("\n(  %-%-" .. flag:gsub("%-", "%%-") .. " [^\n]*)")
    assert(line, "eval --help lists no --" .. flag)
    assert(helps.generate:find(line, 1, true), ("generate --help lacks %q"):format(line))
  end
  assert(helps.train:find("--model STRING         model size (default gpt2-nano", 1, true),
         helps.train)
  assert(not helps.train:find("--load", 1, true), helps.train)
end

-- The scripts parse, check and exit through lua/luazero/run/: none calls
-- os.exit or luazero.args itself.
function T.the_scripts_leave_parsing_and_exiting_to_the_run_parts()
  for _, name in ipairs({ "train", "eval", "generate" }) do
    local f = assert(io.open(lz.root .. "/scripts/" .. name .. ".lua", "rb"))
    local src = f:read("*a")
    f:close()
    assert(src:find('require("luazero.run.exits")', 1, true), name .. " does not use run.exits")
    assert(src:find('require("luazero.run.flags")', 1, true), name .. " does not use run.flags")
    assert(not src:find("os.exit(", 1, true), name .. ".lua calls os.exit itself")
    assert(not src:find('require("luazero.args")', 1, true), name .. ".lua parses flags itself")
  end
end

-- Lines in a file: its newlines, and a last line without one.
local function count_lines(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  local _, n = s:gsub("\n", "")
  return n + ((#s > 0 and s:sub(-1) ~= "\n") and 1 or 0)
end

function T.no_file_in_core_lua_scripts_tools_is_over_800_lines_and_train_is_under_500()
  local p = io.popen(("cd %s && find core lua scripts tools -type f"):format(support.quote(lz.root)))
  local over, n = {}, 0
  for path in p:lines() do
    n = n + 1
    local lines = count_lines(lz.root .. "/" .. path)
    if lines > 800 then over[#over + 1] = ("%s (%d lines)"):format(path, lines) end
  end
  p:close()
  assert(n > 100, ("found %d files under core/, lua/, scripts/, tools/"):format(n))
  assert(#over == 0, "over 800 lines; split by idea: " .. table.concat(over, ", "))
  local train = count_lines(lz.root .. "/scripts/train.lua")
  assert(train < 500, ("scripts/train.lua is %d lines; its parts go under lua/luazero/run/")
         :format(train))
end

return T
