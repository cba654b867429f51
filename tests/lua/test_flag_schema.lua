-- test_flag_schema.lua — the scripts' flags declare their ranges, choices
-- and dependencies, and luazero.args checks them: every flag of train,
-- eval, generate and tools/estimate that `needs` another is refused alone
-- with one line naming it and what it needs, and accepted with it; a value
-- past a declared range or outside the choices is refused; the scripts
-- refuse with exit 2; and no script checks a flag's dependency or range
-- outside its declaration.
local lz = require("luazero")
local args = require("luazero.args")
local support = dofile(lz.root .. "/tests/lua/support.lua")

local T = {}
local write_file = support.scratch()
local corpus = write_file("corpus.txt", ("It was the best of times.\n"):rep(40))
local constant = write_file("constant.json", '{"train_micro_batch_size_per_gpu": 2}')

local SCRIPTS = {
  { "scripts/train.lua", { "--help" } },
  { "scripts/eval.lua", { "--help" } },
  { "scripts/generate.lua", { "--help" } },
  { "tools/estimate.lua", { "--help" } },
}

-- The spec a script hands luazero.args, caught at its parse: the script
-- runs with `argv` until then, its output and exit swallowed.
local CAUGHT = setmetatable({}, { __tostring = function() return "caught" end })
local function spec_of(path, argv)
  local parse, exit, stderr, write, print_ = args.parse, os.exit, io.stderr, io.write, print
  local saved_arg = rawget(_G, "arg")
  local spec
  args.parse = function(_, s) spec = s; error(CAUGHT, 0) end
  os.exit = function() error(CAUGHT, 0) end
  io.stderr = { write = function() end, flush = function() end } -- luacheck: ignore
  io.write = function() end -- luacheck: ignore
  print = function() end -- luacheck: ignore
  rawset(_G, "arg", argv)
  local ok, err = pcall(dofile, lz.root .. "/" .. path)
  args.parse, os.exit, io.stderr, io.write, print = parse, exit, stderr, write, print_ -- luacheck: ignore
  rawset(_G, "arg", saved_arg)
  assert(spec, ("%s: no spec reached luazero.args.parse (%s)"):format(path, ok and "ran through" or tostring(err)))
  return spec
end

local function by_name(spec)
  local t = {}
  for _, s in ipairs(spec) do t[s[1]] = s end
  return t
end

-- A value of flag s that its own declaration takes and that is not its
-- default (the value a `needs` is checked for); nil for a switch.
local function a_value(s)
  if s[2] == "flag" then return nil end
  local candidates = s[2] == "string" and { "x" } or { 2, 1, 0.5, 3 }
  if s.choices then candidates = s.choices end
  for _, v in ipairs(candidates) do
    if v ~= s[3] and not (s[2] == "int" and v ~= math.floor(v)) then
      local bare = {} -- its range and choices, not what it needs
      for k, x in pairs(s) do if k ~= "needs" then bare[k] = x end end
      local ok = pcall(args.check, { [s[1]:gsub("-", "_")] = v }, { bare })
      if ok then return tostring(v) end
    end
  end
  error("no value for --" .. s[1])
end

-- argv from { {name, value}, ... }, a later name replacing an earlier.
local function argv_of(pairs_)
  local order, val = {}, {}
  for _, p in ipairs(pairs_) do
    if val[p[1]] == nil then order[#order + 1] = p[1] end
    val[p[1]] = p[2] or false
  end
  local argv = {}
  for _, n in ipairs(order) do
    argv[#argv + 1] = n
    if val[n] then argv[#argv + 1] = val[n] end
  end
  return argv
end

local function fillers(spec)
  local out = {}
  for _, s in ipairs(spec) do
    if s.required then out[#out + 1] = { "--" .. s[1], "x" } end
  end
  return out
end

function T.every_flag_that_needs_another_is_refused_alone_and_accepted_with_it()
  local seen = 0
  for _, sc in ipairs(SCRIPTS) do
    local spec = spec_of(sc[1], sc[2])
    local names = by_name(spec)
    for _, s in ipairs(spec) do
      local n = s.needs
      if n then
        if type(n) == "string" then n = { flag = n } end
        local alone = fillers(spec)
        alone[#alone + 1] = { "--" .. s[1], a_value(s) }
        for i = 1, #(n.alone or {}), 2 do alone[#alone + 1] = { n.alone[i], n.alone[i + 1] } end
        local ok, why = pcall(args.parse, argv_of(alone), spec)
        local what = ("%s --%s"):format(sc[1], s[1])
        assert(not ok, what .. " alone is accepted")
        assert(why:find("^%-%-") and not why:find("\n"), what .. ": not one line naming a flag: " .. why)
        local named = n.flag and ("--" .. n.flag) or n.with[1]
        assert(why:find("--" .. s[1], 1, true) and why:find(named, 1, true),
               ("%s: %q names neither it nor %s"):format(what, why, named))
        -- what it needs, and what that needs in turn
        local with = { unpack(alone) }
        local function meet(need)
          if type(need) == "string" then need = { flag = need } end
          if need.flag then
            local t = names[need.flag]
            with[#with + 1] = { "--" .. need.flag, a_value(t) }
            if t.needs then meet(t.needs) end
          else
            for i = 1, #need.with, 2 do with[#with + 1] = { need.with[i], need.with[i + 1] } end
          end
        end
        meet(n)
        ok, why = pcall(args.parse, argv_of(with), spec)
        assert(ok, ("%s with %s is refused: %s"):format(what, named, tostring(why)))
        seen = seen + 1
      end
    end
  end
  -- the checkpoint flags, LoRA's, the weights flags, the sampling flags
  -- and the estimate's pairs at least
  assert(seen >= 20, "only " .. seen .. " flags declare what they need")
end

-- A value just past each declared bound, or outside the choices: one line
-- "--NAME must be ... (got V)".
function T.every_declared_range_and_choice_refuses_the_value_past_it()
  local seen = 0
  for _, sc in ipairs(SCRIPTS) do
    local spec = spec_of(sc[1], sc[2])
    for _, s in ipairs(spec) do
      local bad = {}
      local min = s.min
      if type(min) == "function" then min = min({}) end
      local step = s[2] == "int" and 1 or 0.5
      if min then bad[#bad + 1] = min - step end
      if s.over then bad[#bad + 1] = s.over end
      if s.max then bad[#bad + 1] = s.max + step end
      if s.choices then bad[#bad + 1] = s[2] == "string" and "zzz" or 7 end
      for _, v in ipairs(bad) do
        local argv = argv_of(fillers(spec))
        argv[#argv + 1] = "--" .. s[1]
        argv[#argv + 1] = tostring(v)
        local ok, why = pcall(args.parse, argv, spec)
        assert(not ok, ("%s --%s %s is accepted"):format(sc[1], s[1], tostring(v)))
        assert(why:find("--" .. s[1] .. " must be ", 1, true) and
               why:find("(got " .. tostring(v) .. ")", 1, true),
               ("%s --%s %s: %q"):format(sc[1], s[1], tostring(v), why))
        seen = seen + 1
      end
    end
  end
  assert(seen >= 30, "only " .. seen .. " bounds and choices declared")
end

function T.a_declaration_that_names_no_flag_or_no_field_is_the_programs_error()
  for _, spec in ipairs({ { { "a", "int", 0, "", needs = "b" } },
                          { { "a", "int", 0, "", minimum = 1 } },
                          { { "a", "int", 0, "", needs = { says = "x" } } },
                          { { "a", "int", 0, "" }, { "a", "string", nil, "" } } }) do
    local ok, why = pcall(args.parse, {}, spec)
    assert(not ok and tostring(why):find("args: --a", 1, true), tostring(why))
  end
  -- a needs holds only for a value other than the default
  local spec = { { "save", "string", nil, "" }, { "keep", "int", 0, "", needs = "save" } }
  assert(pcall(args.parse, { "--keep", "0" }, spec))
  local ok, why = pcall(args.parse, { "--keep", "1" }, spec)
  assert(not ok and why == "--keep without --save does nothing: add --save or drop --keep", why)
end

-- What the scripts make of a refusal: exit 2 and the one line, before
-- anything is read (no --load, --hf or data there).
function T.the_scripts_and_tools_refuse_with_exit_2_and_one_line()
  for _, c in ipairs({
    { "scripts/generate.lua --hf nope --top-k 5", "generate: --top-k does nothing with greedy " ..
      "decoding (--temperature 0): add --temperature T (above 0) to sample, or drop it" },
    { "scripts/eval.lua --hf nope --model gpt2 --data x", "eval: --model gpt2 goes with --load " ..
      "FILE (a consolidated file, which names no model)" },
    { "scripts/eval.lua --load nope --adapters ad --data x", "eval: --adapters ad goes with --hf BASE" },
    { "scripts/train.lua --data x --save-zstd-level 9", "train: --save-zstd-level without --save " ..
      "does nothing: add --save DIR (the checkpoint folder) or drop --save-zstd-level" },
    { "tools/ckpt.lua inspect nope --dtype bf16", "ckpt: --dtype goes with export" },
    -- DeepSpeed's name of a flag (its aliases), a flag spelt with _ for -
    { "scripts/train.lua --deepspeed ds.json", "train: --deepspeed is --config here" },
    { "scripts/train.lua --deepspeed_config=ds.json", "train: --deepspeed_config is --config here" },
    { "scripts/train.lua --micro_batch 2", "train: unknown flag --micro_batch; did you mean " ..
      "--micro-batch?" },
    -- a typo: the nearest flag, at most two edits away
    { "scripts/train.lua --stpes 2", "train: unknown flag --stpes; did you mean --steps? " ..
      "(--help lists the flags)" },
    { "scripts/eval.lua --jsno", "eval: unknown flag --jsno; did you mean --json?" },
    { "tools/ckpt.lua export nope out --base b", "ckpt: --base b without --merge-lora does nothing" },
    { "tools/estimate.lua --model gpt2 --checkpoint-activations 1", "estimate: " ..
      "--checkpoint-activations counts the activation arenas of --micro-batch B --seq-len L" },
    -- what a flag needs from the configuration, once it is read
    { ("scripts/train.lua --model gpt2-nano --n-layer 1 --steps 1 --data %s --config %s " ..
       "--warmup 5"):format(support.quote(corpus), support.quote(constant)),
      ("train: --warmup 5: --config %s has no scheduler, so the lr is constant and nothing " ..
       "warms up"):format(constant) },
  }) do
    local out, st = support.sh(("cd %s && %s %s"):format(support.quote(lz.root),
                                                         support.quote(lz.executable()), c[1]))
    assert(st == 2, ("%s: exit %s:\n%s"):format(c[1], tostring(st), out))
    assert(out:find(c[2], 1, true) == 1 and select(2, out:gsub("\n", "")) == 1,
           ("%s:\n%s"):format(c[1], out))
  end
end

-- The old ad-hoc checks: a dependency or a range tested in code beside the
-- flags, which a declaration now holds.
local OLD = {
  { "run_flags%.at_least", "a range: min = N in the flag's declaration" },
  { "run_flags%.required", "required = \"...\" in the flag's declaration" },
  { "without %-%-[%w%-]+ does nothing", "needs = \"flag\" in the flag's declaration" },
  { "%-%-[%w%-]+ must be >=? ", "min / over in the flag's declaration" },
  { "%-%-[%w%-]+ must be in %(", "over / max in the flag's declaration" },
  { "%-%-[%w%-]+ must be %w+,? [%w, ]*or %w+ %(got", "choices in the flag's declaration" },
  { "if not flags%.[%w_]+ then\n%s*for _, n in ipairs", "needs in the flags' declarations" },
  { "flags%.[%w_]+ < %d", "min = N in the flag's declaration" },
  { "flags%.[%w_]+ <= %d", "over = N in the flag's declaration" },
}

local function scan(text)
  for _, o in ipairs(OLD) do
    local at = text:find(o[1])
    if at then
      local line = select(2, text:sub(1, at):gsub("\n", "")) + 1
      return line, o
    end
  end
end

function T.no_script_checks_a_flags_dependency_or_range_outside_its_declaration()
  local files = { "lua/luazero/run/checks.lua", "lua/luazero/run/flags.lua",
                  "lua/luazero/run/outputs.lua", "tools/estimate.lua", "tools/ckpt.lua" }
  for name in io.popen("ls " .. support.quote(lz.root .. "/scripts")):lines() do
    if name:match("%.lua$") then files[#files + 1] = "scripts/" .. name end
  end
  for _, f in ipairs(files) do
    local h = assert(io.open(lz.root .. "/" .. f, "rb"))
    local text = h:read("*a")
    h:close()
    local line, o = scan(text)
    assert(not line, ("%s:%s checks a flag outside its declaration (%s): use %s")
                     :format(f, tostring(line), o and o[1] or "", o and o[2] or ""))
  end
  -- the scan sees the old forms
  for _, old in ipairs({
    'run_flags.at_least(ex, flags, "batch", 1)',
    'fail("--top-p must be in (0, 1]")',
    'ex.user_error(("--%s without --save does nothing: add --save DIR"):format(n))',
    'if flags.max_batches < 0 then ex.user_error("--max-batches must be >= 0") end',
    'fail(("--kv-dtype must be fp32 or bf16 (got %s)"):format(flags.kv_dtype))',
    'if flags.lr and flags.lr <= 0 then',
  }) do
    assert(scan(old), "the scan misses " .. old)
  end
end

return T
