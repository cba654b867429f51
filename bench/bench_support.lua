-- bench_support.lua — what the Lua benchmarks share (not a benchmark itself):
-- shell quoting and commands, a scratch folder, the corpus they train on,
-- medians, the GEMM yardstick and the machine line every figure is read
-- beside.
--   local bench = dofile(lz.root .. "/bench/bench_support.lua")
--   local q, tmp = bench.quote, bench.scratch()
--   local data = bench.corpus(tmp, flags.data)   -- the given file, or a generated text
--   local peak = bench.gemm_gflops(2048, "f32")  -- GFLOP/s of n x n x n through lz_matmul
--   ... bench.cleanup(tmp)
local lz = require("luazero")
local clock = require("luazero.clock")

local M = {}

function M.quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

-- A bench's flags (luazero.args): --help prints the usage and exits 0; a
-- refused flag is one line "NAME: ..." and exit 2. name: "bench_llama".
function M.flags(name, argv, spec, usage_args)
  local ok, flags, usage = pcall(require("luazero.args").parse, argv, spec)
  if not ok then
    io.stderr:write(name, ": ", tostring(flags), "\n")
    os.exit(2)
  end
  if not flags then
    print(("usage: luazero bench/%s.lua %s[flags]\n%s"):format(name, usage_args or "", usage))
    os.exit(0)
  end
  return flags
end

function M.scratch()
  local dir = os.tmpname()
  os.remove(dir)
  os.execute("mkdir -p " .. M.quote(dir))
  return dir
end

-- `given` when set; else a generated text in dir.
function M.corpus(dir, given)
  if given then return given end
  local path = dir .. "/corpus.txt"
  local f = assert(io.open(path, "w"))
  f:write(("The quick brown fox jumps over the lazy dog. "):rep(20000))
  f:close()
  return path
end

function M.cleanup(dir) os.execute("rm -rf " .. M.quote(dir)) end

-- A shell command's output, stdout and stderr together.
function M.sh(cmd)
  local p = io.popen(cmd .. " 2>&1")
  local out = p:read("*a")
  p:close()
  return out
end

-- The median of a list of numbers (the list is left as it is); nil when empty.
function M.median(t)
  local s = {}
  for i, v in ipairs(t) do s[i] = v end
  table.sort(s)
  local n = #s
  if n == 0 then return nil end
  return n % 2 == 1 and s[(n + 1) / 2] or (s[n / 2] + s[n / 2 + 1]) / 2
end

-- GFLOP/s of an n x n x n GEMM through lz_matmul (oneDNN) in dtype ("f32",
-- or "bf16" operands with fp32 accumulation): the best of 10 after a warm-up.
function M.gemm_gflops(n, dtype)
  local dt = dtype == "bf16" and "bf16" or "f32"
  local a, b, c = lz.tensor({ n, n }, dt), lz.tensor({ n, n }, dt), lz.tensor({ n, n })
  a:fill(0.5)
  b:fill(0.25)
  lz.ops.matmul(c, a, b, 0, 0, 1, 0) -- warm-up: oneDNN picks its kernel
  local best = math.huge
  for _ = 1, 10 do
    local t0 = clock.now()
    lz.ops.matmul(c, a, b, 0, 0, 1, 0)
    best = math.min(best, clock.now() - t0)
  end
  a:free(); b:free(); c:free()
  return 2 * n ^ 3 / best / 1e9
end

-- One line naming the machine a figure comes from: the CPU, the threads,
-- its vector and matrix units (AMX tiles, AVX-512 BF16, AVX-512, AVX2) and
-- how bf16 GEMMs run on it.
function M.machine()
  local model, flags = "unknown CPU", ""
  local f = io.open("/proc/cpuinfo", "r")
  if f then
    for line in f:lines() do
      local k, v = line:match("^(%w[%w ]-)%s*:%s*(.*)$")
      if k == "model name" and model == "unknown CPU" then model = v end
      if k == "flags" and flags == "" then flags = " " .. v .. " " end
    end
    f:close()
  end
  local units = {}
  for _, u in ipairs({ { "amx_tile", "AMX" }, { "avx512_bf16", "AVX-512 BF16" },
                       { "avx512f", "AVX-512" }, { "avx2", "AVX2" } }) do
    if flags:find(" " .. u[1] .. " ", 1, true) then units[#units + 1] = u[2] end
  end
  return ("machine: %s, %d threads; %s; bf16 GEMMs %s"):format(model, lz.threads(),
    #units > 0 and table.concat(units, ", ") or "no AVX2", lz.bf16_matmul())
end

return M
