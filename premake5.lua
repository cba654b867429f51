-- premake5.lua — the build. Runs under Debian's premake4 and under premake5:
--   premake4 --file=premake5.lua gmake && make -C build config=release
-- Outputs: build/lib/libluazero.so, build/lib/libluazero_cuda.so (where nvcc
-- exists), build/bin/luazero, build/bin/lz_tests. The debug configuration
-- (AddressSanitizer + UBSan) builds into build/debug/.
if not workspace then workspace = solution end

local root = os.getcwd()
local mpi_inc = "/usr/lib/x86_64-linux-gnu/openmpi/include"
local mpi_lib = "/usr/lib/x86_64-linux-gnu/openmpi/lib"
local cuda = os.getenv("CUDA_HOME") or "/usr/local/cuda"
local nvcc = cuda .. "/bin/nvcc"
local have_cuda = os.isfile(nvcc) and os.getenv("LZ_NO_CUDA") == nil
-- nvcc through ccache where it is on PATH and LZ_CCACHE is not 0, as
-- tools/setup runs gcc: paths under the checkout hash relative to it, so
-- a new clone anywhere reuses the objects of an earlier one.
local ccache = os.getenv("LZ_CCACHE") ~= "0" and os.pathsearch("ccache", os.getenv("PATH") or "")
local nvcc_launcher = ccache and string.format("CCACHE_BASEDIR=%s CCACHE_NOHASHDIR=1 %s/ccache ",
                                               root, ccache) or ""

-- LZ_BUILD=DIR puts the whole build somewhere else (default: build/).
local out = os.getenv("LZ_BUILD") or "build"

-- A dependency file (.d) naming a source or header that has moved or gone
-- stops make ("No rule to make target"): drop it and its object, which is
-- then rebuilt. Paths in it are relative to the build folder.
for _, dep in ipairs(os.matchfiles(out .. "/obj/**.d")) do
  local f = io.open(dep)
  local text = f and f:read("*a") or ""
  if f then f:close() end
  for word in text:gmatch("[^%s\\]+") do
    local file = word:gsub(":$", "")
    if file:match("%.[ch]$") or file:match("%.cu$") then
      local full = file:sub(1, 1) == "/" and file or (out .. "/" .. file)
      if not os.isfile(full) then
        os.remove(dep)
        os.remove((dep:gsub("%.d$", ".o")))
        break
      end
    end
  end
end

local warnings = { "-Wall", "-Wextra", "-Werror", "-Wno-unknown-pragmas" }

-- Where a project's output goes: release into <out>/<sub>, debug into
-- <out>/debug/<sub>, with the matching lib folder to link against.
local function output_dirs(sub, extra_libdir)
  configuration "release"
    targetdir(out .. "/" .. sub)
    libdirs { out .. "/lib", extra_libdir and (out .. "/" .. extra_libdir) or nil }
  configuration "debug"
    targetdir(out .. "/debug/" .. sub)
    libdirs { out .. "/debug/lib", extra_libdir and (out .. "/debug/" .. extra_libdir) or nil }
  configuration {}
end

workspace "luazero"
  configurations { "release", "debug" }
  location(out)
  flags { "Symbols" }
  language "C"
  includedirs { "core", mpi_inc }
  buildoptions { "-std=gnu11", "-fPIC", "-fopenmp", "-pthread" }
  buildoptions(warnings)
  linkoptions { "-fopenmp", "-pthread" }

  configuration "release"
    buildoptions { "-O3", "-g", "-fno-strict-aliasing", "-fno-math-errno" }
    defines { "NDEBUG" }
  configuration "debug"
    buildoptions { "-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                   "-fno-sanitize-recover=undefined" }
    linkoptions { "-fsanitize=address,undefined" }
  configuration {}

project "luazero"
  kind "SharedLib"
  files { "core/**.c", "core/**.h" }
  -- The nccl backend's device half is in libluazero_cuda.so (core/comm/backends.c).
  if have_cuda then defines { "LZ_HAVE_CUDA" } end
  libdirs { mpi_lib }
  links { "dnnl", "xxhash", "zstd", "aio", "mpi", "m", "rt", "dl" }
  output_dirs("lib")

if have_cuda then
  -- premake4 has no build rules for .cu, and its prebuild step runs beside the
  -- link under make -j. So nvcc runs in the prebuild step of a project of its
  -- own (an empty archive), which luazero_cuda links after: make orders them.
  -- The step runs a makefile written here, one rule per object, as a sub-make
  -- that shares the top make's -j slots: the objects compile side by side and
  -- beside the C build. An object is rebuilt when its source or a shared
  -- header is newer. Commands run in build/.
  -- sm_90 (H100/H200) machine code plus compute_90 PTX, which the driver
  -- compiles for newer GPUs. LZ_CUDA_ARCH=80 (say) builds for another one.
  local arch = os.getenv("LZ_CUDA_ARCH") or "90"
  local nvflags = string.format("-O3 -std=c++17 -gencode arch=compute_%s,code=sm_%s "
    .. "-gencode arch=compute_%s,code=compute_%s -Werror all-warnings "
    .. "-Xcompiler -fPIC,-Wall,-Wextra,-Werror -I%s/core -I%s/cuda", arch, arch, arch, arch, root, root)
  local headers = { "cuda/lz_cuda.h", "core/mem/lz_backend.h", "core/mem/lz_internal.h",
                    "core/mem/lz_dtype.h", "core/mem/lz_ops.def", "core/luazero.h",
                    "core/luazero_kernels.h" }
  for _, h in ipairs(os.matchfiles("cuda/*.cuh")) do table.insert(headers, h) end
  -- The largest sources first, so the longest compiles start first under -j.
  local cu_files = os.matchfiles("cuda/*.cu")
  local function cost(f) -- bytes of the source and of the local .cuh files it includes
    local fh = io.open(f)
    local text = fh and fh:read("*a") or ""
    if fh then fh:close() end
    local n = #text
    for inc in text:gmatch('#include "([%w_]+%.cuh)"') do n = n + cost("cuda/" .. inc) end
    return n
  end
  local costs = {}
  for _, f in ipairs(cu_files) do costs[f] = cost(f) end
  table.sort(cu_files, function(a, b) return costs[a] > costs[b] or (costs[a] == costs[b] and a < b) end)
  local objs = {}
  for _, f in ipairs(cu_files) do table.insert(objs, "obj/cuda/" .. path.getbasename(f) .. ".o") end
  local deps = {}
  for _, h in ipairs(headers) do table.insert(deps, root .. "/" .. h) end
  os.mkdir(out)
  local mk = assert(io.open(out .. "/cuda_objects.mk", "w"))
  mk:write("# Written by premake5.lua: the objects of libluazero_cuda.so.\n",
           "all: ", table.concat(objs, " "), "\n",
           "obj/cuda/%.o: ", root, "/cuda/%.cu ", table.concat(deps, " "), "\n",
           "\t@mkdir -p obj/cuda\n",
           -- The libraries link the objects as options, not prerequisites:
           -- a new object has them linked again by removing them.
           "\t@rm -f lib/libluazero_cuda.so debug/lib/libluazero_cuda.so\n",
           "\t", nvcc_launcher, nvcc, " ", nvflags, " -c $< -o $@\n")
  mk:close()
  local cmds = { "+$(MAKE) --no-print-directory -f cuda_objects.mk" }
  project "luazero_cuda_objects"
    kind "StaticLib"
    language "C"
    prebuildcommands(cmds)
    output_dirs("obj")

  project "luazero_cuda"
    kind "SharedLib"
    language "C"
    files { "cuda/*.c" }
    includedirs { "cuda", cuda .. "/include" }
    linkoptions(objs)
    libdirs { cuda .. "/lib64" }
    linkoptions { "-Wl,-rpath," .. cuda .. "/lib64", "-Wl,-rpath,'$$ORIGIN'" }
    links { "luazero_cuda_objects", "luazero", "cudart", "cublas", "cublasLt", "nccl", "stdc++" }
    output_dirs("lib", "obj")
end

project "luazero-bin"
  kind "ConsoleApp"
  targetname "luazero"
  files { "lua/main.c" }
  includedirs { "/usr/include/luajit-2.1" }
  links { "luazero", "luajit-5.1", "edit", "dl", "m" }
  -- -Wl,-E: the executable's symbols are visible to LuaJIT's ffi.C.
  linkoptions { "-Wl,-E", "-Wl,-rpath,'$$ORIGIN/../lib'" }
  output_dirs("bin")

project "lz_tests"
  kind "ConsoleApp"
  files { "tests/*.c", "tests/*.h" }
  includedirs { "tests" }
  links { "luazero", "dnnl", "m", "dl" }
  linkoptions { "-Wl,-rpath,'$$ORIGIN/../lib'" }
  output_dirs("bin")

-- The core built again with one more op declared (tests/toy/), to show that
-- a line in the declaration and a kernel make an op on the cpu and sim
-- (tests/lua/test_op_binding.lua runs it). Unoptimized: it only has to run.
project "lz_ops_toy"
  kind "ConsoleApp"
  files { "core/**.c", "tests/toy/*.c", "tests/lz_test_main.c" }
  includedirs { "tests/toy", "tests" }
  defines { "LZ_OPS_EXTRA" }
  buildoptions { "-O0" }
  libdirs { mpi_lib }
  links { "dnnl", "xxhash", "zstd", "aio", "mpi", "m", "rt", "dl" }
  output_dirs("bin")

-- The CUDA kernels against the CPU ones (tools/test cuda); skips without a GPU.
project "lz_cuda_tests"
  kind "ConsoleApp"
  files { "tests/cuda/test_cuda_kernels.c" }
  links { "luazero", "m" }
  linkoptions { "-Wl,-rpath,'$$ORIGIN/../lib'" }
  output_dirs("bin")

-- Multi-rank tests and the collective benchmark (tests/comm/run.sh, bench/bench-comm).
local function comm_tool(name, file)
  project(name)
    kind "ConsoleApp"
    files { file }
    links { "luazero", "m" }
    linkoptions { "-Wl,-rpath,'$$ORIGIN/../lib'" }
    output_dirs("bin")
end
comm_tool("lz_run", "tests/comm/lz_run.c")
comm_tool("comm_check", "tests/comm/comm_check.c")
comm_tool("a2a_check", "tests/comm/a2a_check.c")
comm_tool("bench_comm", "bench/bench_comm.c")
project "bench_comm"
  libdirs { mpi_lib }
  links { "mpi" }

-- The kernel benchmark (bench/bench-kernels): ours against raw oneDNN and OpenBLAS.
project "bench_kernels"
  kind "ConsoleApp"
  files { "bench/bench_kernels.c" }
  links { "luazero", "dnnl", "openblas", "m" }
  linkoptions { "-Wl,-rpath,'$$ORIGIN/../lib'" }
  output_dirs("bin")

-- The CPU Adam and NVMe-tier benchmarks (bench/bench-adam, bench/bench-aio).
comm_tool("bench_adam", "bench/bench_adam.c")
comm_tool("bench_aio", "bench/bench_aio.c")
