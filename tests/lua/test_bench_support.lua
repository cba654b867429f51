-- test_bench_support.lua — what the Lua benchmarks share: the machine line
-- printed beside every figure names the CPU, the threads, the units the
-- CPU reports and the bf16 GEMM path the engine took.
local lz = require("luazero")
local bench = dofile(lz.root .. "/bench/bench_support.lua")

local T = {}

function T.the_machine_line_names_what_this_cpu_has()
  local line = bench.machine()
  local cpu, threads, units, path = line:match("^machine: (.+), (%d+) threads; (.+); bf16 GEMMs (.+)$")
  assert(cpu and tonumber(threads) == lz.threads(), line)
  assert(path == lz.bf16_matmul(), line)
  -- each unit the engine's own CPU check sees is named, and only those
  for feature, name in pairs({ avx2 = "AVX2", avx512f = "AVX-512", avx512bf16 = "AVX-512 BF16" }) do
    local named = (", " .. units .. ","):find(", " .. name .. ",", 1, true) ~= nil
    assert(named == lz.cpu_has(feature), ("%s: %s (cpu_has %s)"):format(name, line,
                                                                  tostring(lz.cpu_has(feature))))
  end
  print("    " .. line)
end

-- Every Lua benchmark that takes flags: --help prints its usage and exits 0
-- (without running), a flag it does not have is one line and exit 2.
function T.each_benchs_help_and_bad_flag()
  local support = dofile(lz.root .. "/tests/lua/support.lua")
  for _, name in ipairs({ "bench_llama", "bench_offload", "bench_zero", "bench_ckpt", "bench_muon",
                          "bench_train", "bench_optimizers", "bench_hf_init" }) do
    local cmd = ("cd %s && timeout 60 %s bench/%s.lua "):format(support.quote(lz.root),
                                                                support.quote(lz.executable()), name)
    local out, st = support.sh(cmd .. "--help")
    assert(st == 0 and out:find("^usage: luazero bench/" .. name .. "%.lua "), name .. ":\n" .. out)
    out, st = support.sh(cmd .. (name == "bench_hf_init" and "x " or "") .. "--no-such-flag")
    assert(st == 2 and out == name .. ": unknown flag --no-such-flag (--help lists the flags)\n",
           name .. ":\n" .. out)
  end
end

return T
