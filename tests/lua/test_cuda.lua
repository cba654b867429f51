-- test_cuda.lua — the Lua face of the cuda backend, on any machine: lz.cuda,
-- device tensors, and train.lua --device cuda failing at start with exit 2
-- and one clear line (no GPU: the driver's reason; a GPU: what is not wired
-- to the device yet).
local lz = require("luazero")
local support = dofile(lz.root .. "/tests/lua/support.lua")
local q = support.quote
local root = lz.root

local T = {}

local function run_train(flags)
  local cmd = ("cd %s && %s scripts/train.lua %s 2>&1; echo \"exit=$?\"")
              :format(q(root), q(lz.executable()), flags)
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  return out, tonumber(out:match("exit=(%d+)%s*$"))
end

-- The checks that start a device run in a process of their own: this one
-- may already use sim (one accelerator per process), and one that started
-- cuda would refuse the sim tests that run after it.
local function in_child(code)
  local out, status = support.sh(("%s -e %s"):format(q(lz.executable()),
                                 q('local lz = require("luazero")\n' .. code)))
  assert(status == 0, "in a fresh process:\n" .. out)
  return out
end

function T.available_says_why()
  in_child([[
  local ok, why = lz.cuda.available()
  if ok then
    assert(lz.cuda.ready() and lz.cuda.device() == 0)
  else
    assert(ok == false and type(why) == "string", "available() must return false and a reason")
    assert(why:find("^cuda: "), why)
    assert(why:find("run with --device cpu", 1, true), why)
    assert(not lz.cuda.ready() and lz.cuda.device() == -1)
  end]])
end

function T.cuda_tensor_or_clear_error()
  in_child([[
  if lz.cuda.available() then
    local before = lz.mem_device().activations
    local t = lz.tensor({ 4, 8 }, "f32", "activations", "cuda")
    assert(lz.mem_device().activations == before + 128)
    assert(t:device_name() == "cuda")
    assert(not pcall(t.get, t, 0), "get on a device tensor must raise")
    local h = t:to("cpu")
    assert(h:get(31) == 0)
    t:free()
    assert(lz.mem_device().activations == before)
  else
    local ok, err = pcall(lz.tensor, { 4, 8 }, "f32", "activations", "cuda")
    assert(not ok and tostring(err):find("cuda is not initialized", 1, true), tostring(err))
  end
  local ok, err = pcall(lz.tensor, { 2 }, "f32", "params", "tpu")
  assert(not ok and tostring(err):find('device "tpu" is not', 1, true), tostring(err))]])
end

function T.train_device_cuda_fails_at_start_with_exit_2()
  local write = support.scratch()
  local data = write("corpus.txt", ("hello luazero. "):rep(200))
  if not in_child("print(lz.cuda.available())"):find("^true") then
    -- (where a GPU exists, tools/gpu-check trains on it)
    local out, code = run_train("--data " .. q(data) .. " --steps 1 --device cuda")
    assert(code == 2, "exit status " .. tostring(code) .. ", expected 2:\n" .. out)
    local line = out:match("^train: ([^\n]*)\n")
    assert(line, "expected one 'train: ...' line, got:\n" .. out)
    assert(line:find("^cuda: no usable GPU on this machine %(.+%); run with %-%-device cpu$"), line)
    assert(not out:find("model gpt2", 1, true), "nothing may run before the error:\n" .. out)
  end
  local out2, code2 = run_train("--data " .. q(data) .. " --steps 1 --device tpu")
  assert(code2 == 2 and out2:find("--device must be cpu, sim or cuda (got tpu)", 1, true), out2)
end

return T
