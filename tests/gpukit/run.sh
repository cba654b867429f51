#!/usr/bin/env bash
# tests/gpukit/run.sh — the GPU kit (tools/gpu-kit) holds everything the GPU
# checks load beyond glibc, the C++ runtime and the CUDA libraries, so that
# tools/gpu-check --kit runs on a machine that has only those:
#  * the kit is built here, its size printed and kept under 48 MiB, and with
#    the working tree (what travels to a lent machine) under 64 MiB; its
#    manifest records this glibc, and a machine with an older one is refused,
#    and the C API it was built from, and a checkout of another is refused;
#  * every program and library of the kit resolves in a sandbox that holds
#    only the kit, glibc, the C++ runtime and the CUDA libraries: each run
#    through the sandbox's own loader with --inhibit-cache and --library-path,
#    and every object the loader names or loads (LD_DEBUG) must come from the
#    kit or the sandbox, not from the system's library folders, which the
#    loader still searches last (a test removes a library to show that this
#    is caught); also where the machine has no C++ runtime (the kit's lib-cxx);
#  * in that sandbox the CPU parts run: luazero loads the package, cjson and
#    libluazero_cuda.so (where no GPU is present it says so), trains a few
#    CPU steps of gpt2-nano to the build's own checksum, and lz_tests passes;
#  * tools/gpu-check --kit runs from the kit (without a GPU: the CUDA steps
#    skip in one line) and, with --device sim, rehearses its training and
#    offload steps on the sim device; its summary and JSON are written;
#  * the device command in docs/cuda.md is under 2,000 characters, carries at
#    most 8 paths, all ignored by git, and its time limit covers the check.
# Ends with "N passed, N failed".
set -uo pipefail
cd "$(dirname "$0")/../.."
repo=$(pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pass=0
fail=0
ok() { echo "ok   gpukit.$1${2:+ ($2)}"; pass=$((pass + 1)); }
bad() { echo "FAIL gpukit.$1: $2"; fail=$((fail + 1)); }
finish() { echo "$pass passed, $fail failed"; [ "$fail" = 0 ]; exit $?; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }

# ---------------------------------------------------------------- the kit
kit=$work/kit
if tools/gpu-kit --out "$kit" > "$work/build.log" 2>&1; then
  ok build "$(tail -n 1 "$work/build.log" | cut -c1-160)"
else
  bad build "tools/gpu-kit failed: $(tail -n 1 "$work/build.log")"
  finish
fi
field() { sed -n "s/^$1: //p" "$kit/KIT"; }

kit_bytes=$(du -sb "$kit" | awk '{print $1}')
tree_bytes=$(git ls-files -z --cached --others --exclude-standard |
             xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
echo "     kit $(mib "$kit_bytes"), working tree $(mib "$tree_bytes"), together $(mib $((kit_bytes + tree_bytes)))"
if [ "$kit_bytes" -lt $((48 << 20)) ]; then ok kit_under_48_mib "$(mib "$kit_bytes")"
else bad kit_under_48_mib "the kit is $(mib "$kit_bytes")"; fi
if [ $((kit_bytes + tree_bytes)) -lt $((64 << 20)) ]; then
  ok kit_and_tree_under_64_mib "$(mib $((kit_bytes + tree_bytes)))"
else bad kit_and_tree_under_64_mib "kit $(mib "$kit_bytes") + tree $(mib "$tree_bytes")"; fi

glibc=$(getconf GNU_LIBC_VERSION | awk '{print $2}')
if [ "$(field glibc)" = "$glibc" ]; then ok manifest_records_glibc "$glibc"
else bad manifest_records_glibc "KIT says glibc '$(field glibc)', this machine has $glibc"; fi

# A machine whose glibc is older than the kit's is refused in one line
# (here: a kit that says it was built against glibc 9.99).
newer=$work/kit-newer
cp -al "$kit" "$newer"
sed 's/^glibc: .*/glibc: 9.99/' "$kit/KIT" > "$work/KIT.newer" && mv "$work/KIT.newer" "$newer/KIT"
said=$(LZ_KIT_ROOT=$work/root-newer "$newer/run" --env 2>&1)
rc=$?
if [ "$rc" = 1 ] && [ "$(echo "$said" | wc -l)" = 1 ] &&
   echo "$said" | grep -q "glibc is $glibc, older than the 9.99" && [ ! -e "$work/root-newer" ]; then
  ok an_older_glibc_is_refused
else bad an_older_glibc_is_refused "exit $rc: $said"; fi

# The kit unpacked where its run script puts it; it lies outside the
# checkout, so its luazero is told where the checkout is.
export LZ_KIT_ROOT=$work/root LUAZERO_HOME=$repo
if ! "$kit/run" --env > /dev/null 2> "$work/unpack.log"; then
  bad unpack "$(tail -n 1 "$work/unpack.log")"
  finish
fi
root=$LZ_KIT_ROOT

# A kit built from another C API than the checkout's (core/luazero.h and
# its cdef) is refused in one line: the Lua would bind the wrong functions.
other=$work/kit-api
cp -al "$kit" "$other"
sed 's/^api: .*/api: 0000000000000000/' "$kit/KIT" > "$work/KIT.api" && mv "$work/KIT.api" "$other/KIT"
said=$("$other/run" --env 2>&1)
rc=$?
if [ -n "$(field api)" ] && [ "$rc" = 1 ] && [ "$(echo "$said" | wc -l)" = 1 ] &&
   echo "$said" | grep -q "built from another C API"; then
  ok a_kit_of_another_api_is_refused
else bad a_kit_of_another_api_is_refused "exit $rc: $said"; fi

# Every soname the build's programs load (ldd, here, where all resolve) is
# either the machine's (glibc, C++ runtime, CUDA: the manifest's lists) or in
# the kit; the kit's ELF files are its programs and its libraries.
machine_libs=" $(field glibc-libs) $(field cxx) "
cuda_pattern=$(field cuda-pattern)
missing=""
for p in $(field programs); do
  src=build/$p
  [ "$p" = lua/cjson.so ] && continue
  while read -r name arrow _; do
    [ "$arrow" = "=>" ] || continue
    case "$name" in libluazero*) continue ;; esac
    case "$machine_libs" in *" $name "*) continue ;; esac
    [[ "$name" =~ $cuda_pattern ]] && continue
    [ -f "$root/lib/$name" ] || missing="$missing $name"
  done < <(ldd "$src")
done
if [ -z "$missing" ]; then ok kit_holds_the_closure "$(field libraries | wc -w) libraries"
else bad kit_holds_the_closure "not in the kit:$missing"; fi

# ---------------------------------------------------------------- the sandbox
# glibc, the C++ runtime and the CUDA libraries, linked from where ldd finds them here.
sys=$work/sys
mkdir -p "$sys"
ldso=$(ldd build/bin/luazero | awk '/ld-linux/ {print $1}')
ln -s "$ldso" "$sys/ld-linux-x86-64.so.2"
cuda_lib=build/lib/libluazero_cuda.so
for f in build/bin/luazero build/bin/lz_tests $([ -f $cuda_lib ] && echo $cuda_lib); do ldd "$f"; done |
  awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u |
  while read -r name path; do
    case "$machine_libs" in *" $name "*) ln -sf "$path" "$sys/$name"; continue ;; esac
    [[ "$name" =~ $cuda_pattern ]] && ln -sf "$path" "$sys/$name"
  done
elves() { # the kit's ELF files under $1
  for p in $(field programs); do [ -f "$1/$p" ] && echo "$1/$p"; done
  ls "$1"/lib/*.so* "$1"/lib-cxx/*.so* 2>/dev/null
}
# Lines of FILE's closure (the loader's --list) that come from outside the
# kit in $1 and the sandbox in $2; a CUDA library may be absent (the lent
# machine has it).
outside() { # kit-root sandbox library-path file
  env -i "$2/ld-linux-x86-64.so.2" --inhibit-cache --library-path "$3" --list "$4" 2>&1 |
    awk -v k="$1/" -v s="$2/" -v cuda="$cuda_pattern" '
      $2 == "=>" && $3 == "not" && $1 !~ cuda { print "  " $1 " not found" }
      $2 == "=>" && $3 ~ /^\// && index($3, k) != 1 && index($3, s) != 1 { print "  " $1 " => " $3 }'
}
leaks=""
for f in $(elves "$root"); do
  l=$(outside "$root" "$sys" "$root/lib:$sys" "$f")
  [ -z "$l" ] || leaks="$leaks ${f#$root/}:$l"
done
if [ -z "$leaks" ]; then ok every_library_resolves_in_the_sandbox "$(elves "$root" | wc -l) files"
else bad every_library_resolves_in_the_sandbox "$leaks"; fi

# Without the machine's C++ runtime, the kit's lib-cxx stands in.
nocxx=$work/sys-nocxx
mkdir -p "$nocxx"
for f in "$sys"/*; do
  case " $(field cxx) " in *" $(basename "$f") "*) ;; *) ln -s "$(readlink "$f")" "$nocxx/$(basename "$f")" ;; esac
done
leaks=""
for f in $(elves "$root"); do
  l=$(outside "$root" "$nocxx" "$root/lib:$root/lib-cxx:$nocxx" "$f")
  [ -z "$l" ] || leaks="$leaks ${f#$root/}:$l"
done
if [ -z "$leaks" ]; then ok the_kit_cxx_runtime_stands_in
else bad the_kit_cxx_runtime_stands_in "$leaks"; fi

# The check can fail: a kit without libzstd loads the system's.
broken=$work/broken
cp -a "$root" "$broken"
rm -f "$broken/lib/libzstd.so.1"
l=$(outside "$broken" "$sys" "$broken/lib:$sys" "$broken/lib/libluazero.so")
if echo "$l" | grep -q "libzstd.so.1 => /"; then ok a_missing_library_is_caught
else bad a_missing_library_is_caught "without libzstd.so.1 the check said: ${l:-nothing}"; fi

# Programs run through the sandbox's loader; LD_DEBUG names every object
# loaded, dlopen's included (libluazero_cuda.so, cjson).
mkdir -p "$work/trace"
sandbox() { # program args...
  local prog=$1
  shift
  env -i PATH=/usr/bin:/bin HOME="$work" LUAZERO_HOME="$repo" LUA_CPATH="$root/lua/?.so" \
    LD_DEBUG=files LD_DEBUG_OUTPUT="$work/trace/t" \
    "$sys/ld-linux-x86-64.so.2" --inhibit-cache --library-path "$root/lib:$sys" "$root/bin/$prog" "$@"
}
out=$(sandbox luazero -e 'local lz = require("luazero")
  print("cjson " .. require("cjson").encode({ 1, 2 }))
  print("cuda", lz.cuda.available())' 2>&1)
if echo "$out" | grep -q '^cjson \[1,2\]$'; then ok luazero_loads_the_package_and_cjson
else bad luazero_loads_the_package_and_cjson "$(echo "$out" | tail -n 2)"; fi
cuda_line=$(echo "$out" | grep '^cuda')
if [ ! -f "$root/lib/libluazero_cuda.so" ]; then
  echo "skip gpukit.cuda_library_loads: the kit has no libluazero_cuda.so (no nvcc where it was built)"
elif echo "$cuda_line" | grep -q "cannot open shared object\|undefined symbol"; then
  bad cuda_library_loads "$cuda_line"
elif echo "$cuda_line" | grep -qE "^cuda\s+(true|false)"; then
  ok cuda_library_loads "$(echo "$cuda_line" | cut -c1-120)"
else bad cuda_library_loads "luazero printed: $out"; fi

corpus=$work/corpus.txt
for i in $(seq 300); do echo "$i: To be, or not to be, that is the question"; done > "$corpus"
args=(scripts/train.lua --model gpt2-nano --n-layer 2 --steps 2 --seq-len 32 --micro-batch 8
      --sample 0 --eval-batches 0 --data "$corpus" --log "$work/metrics.jsonl")
want=$(build/bin/luazero "${args[@]}" 2>&1 | awk '/^params_checksum/ {print $2}')
got=$(sandbox luazero "${args[@]}" 2>&1 | awk '/^params_checksum/ {print $2}')
if [ -n "$got" ] && [ "$got" = "$want" ]; then ok cpu_training_in_the_sandbox "params_checksum $got"
else bad cpu_training_in_the_sandbox "params_checksum '${got}', the build's '${want}'"; fi

objs=$(grep -h "calling init:" $(grep -l "file=$root/bin/" "$work"/trace/t.* 2>/dev/null) /dev/null |
       awk '{print $NF}' | sort -u)
foreign=$(echo "$objs" | awk -v k="$root/" -v s="$sys/" 'NF && index($0, k) != 1 && index($0, s) != 1 &&
                                                         $0 !~ /\/lib(cuda|nvidia-)[^\/]*$/')
if [ -n "$objs" ] && [ -z "$foreign" ]; then
  ok every_loaded_object_is_the_kits_or_the_sandboxs "$(echo "$objs" | wc -l) objects"
else bad every_loaded_object_is_the_kits_or_the_sandboxs "loaded from outside: ${foreign:-(no trace)}"; fi

tests_out=$(env -i PATH=/usr/bin:/bin HOME="$work" "$sys/ld-linux-x86-64.so.2" --inhibit-cache \
              --library-path "$root/lib:$sys" "$root/bin/lz_tests" 2>&1)
line=$(echo "$tests_out" | grep -E '^[0-9]+ passed, [0-9]+ failed' | tail -n 1)
if echo "$line" | grep -qE '^[1-9][0-9]* passed, 0 failed'; then ok lz_tests_in_the_sandbox "$line"
else bad lz_tests_in_the_sandbox "${line:-no summary}: $(echo "$tests_out" | grep -m 3 '^FAIL')"; fi

# The lent image has NCCL only in its Python packages (nvidia/nccl/lib): with
# the folder that holds NCCL here hidden (a mount namespace), CUDA_HOME naming
# a folder of the other CUDA libraries and a Python package folder holding
# NCCL, run --check finds it there; without that package folder it names what
# is missing. Needs unshare -m (root) and hard links to the CUDA libraries.
nccl=$sys/libnccl.so.2
if [ ! -f "$root/lib/libluazero_cuda.so" ] || [ ! -e "$nccl" ] ||
   ! unshare -m true 2>/dev/null; then
  echo "skip gpukit.nccl_from_the_python_packages: needs libluazero_cuda.so, NCCL and unshare -m"
else
  fake=$work/machine
  mkdir -p "$fake/cuda/lib64" "$fake/site/nvidia/nccl/lib" "$fake/empty"
  linked=1
  for f in "$sys"/*; do
    name=$(basename "$f")
    [[ "$name" =~ $cuda_pattern ]] || continue
    to=$fake/cuda/lib64/$name
    [ "$name" = libnccl.so.2 ] && to=$fake/site/nvidia/nccl/lib/$name
    ln "$(readlink -f "$f")" "$to" 2>/dev/null || linked=0
  done
  if [ "$linked" = 0 ]; then
    echo "skip gpukit.nccl_from_the_python_packages: the CUDA libraries are on another file system"
  else
    hide=$(dirname "$(readlink -f "$nccl")")
    in_image() { # PYTHONPATH, then run --check inside the namespace
      unshare -m sh -c 'mount --bind "$1" "$2" && shift 2 && exec "$@"' sh "$fake/empty" "$hide" \
        env CUDA_HOME="$fake/cuda" PYTHONPATH="$1" LZ_KIT_ROOT="$work/root-image" "$kit/run" --check 2>&1
    }
    with=$(in_image "$fake/site")
    rc_with=$?
    without=$(in_image "$fake/none")
    rc_without=$?
    if [ "$rc_with" = 0 ] && echo "$with" | grep -q "^library path: .*$fake/site/nvidia/nccl/lib" &&
       [ "$rc_without" = 1 ] && echo "$without" | grep -q "^missing: libnccl.so.2 (needed by lib/libluazero_cuda.so)"; then
      ok nccl_from_the_python_packages
    else
      bad nccl_from_the_python_packages "with the package: exit $rc_with, $(echo "$with" |
        grep -m 1 '^library path'); without: exit $rc_without, $(echo "$without" | grep -m 1 '^missing')"
    fi
  fi
fi

# ---------------------------------------------------------------- gpu-check --kit
tools/gpu-check --kit "$kit" --out "$work/out" > "$work/check.log" 2>&1
rc=$?
json_ok() { /usr/bin/python3 -c 'import json, sys; json.load(open(sys.argv[1]))' "$1" 2>/dev/null; }
if [ "$rc" = 0 ] && grep -q "^  ok    cpu training" "$work/out/gpu-check.txt" &&
   json_ok "$work/out/gpu-check.json"; then
  ok gpu_check_kit "$(grep -E '^  (skip|ok)    (cuda steps|gpu) ' "$work/out/gpu-check.txt" | head -n 1 | cut -c1-100)"
else bad gpu_check_kit "exit $rc: $(grep -E 'FAIL' "$work/check.log" | head -n 3)"; fi

tools/gpu-check --kit "$kit" --device sim --out "$work/out-sim" > "$work/sim.log" 2>&1
rc=$?
agree=$(grep -cE '^  ok    (stages agree (fp32|bf16)|offload tiers agree)' "$work/out-sim/gpu-check.txt" 2>/dev/null)
if [ "$rc" = 0 ] && [ "$agree" = 3 ] && json_ok "$work/out-sim/gpu-check.json"; then
  ok gpu_check_rehearsal_on_sim "stages and offload tiers agree"
else bad gpu_check_rehearsal_on_sim "exit $rc: $(grep -E 'FAIL' "$work/sim.log" | head -n 3)"; fi

# ---------------------------------------------------------------- docs/cuda.md
block=$(sed -n '/<!-- device-command: begin -->/,/<!-- device-command: end -->/p' docs/cuda.md)
command=$(echo "$block" | sed -n 's/^command: //p')
carry=$(echo "$block" | sed -n 's/^carry: //p')
limit=$(echo "$block" | sed -n 's/^timeout_s: //p')
paths=$(echo "$carry" | /usr/bin/python3 -c 'import json, sys; print("\n".join(json.load(sys.stdin)))' 2>/dev/null)
kit_default=$(sed -n 's/^out=//p' tools/gpu-kit | head -n 1)
deadline=$(grep -o 'LZ_GPU_CHECK_DEADLINE:-[0-9]*' tools/gpu-check | head -n 1 | cut -d- -f2)
problems=""
[ -n "$command" ] || problems="$problems no command line;"
[ "${#command}" -lt 2000 ] || problems="$problems the command is ${#command} characters;"
[ -n "$paths" ] || problems="$problems no carry list (a JSON list);"
[ "$(echo "$paths" | grep -c .)" -le 8 ] || problems="$problems more than 8 carried paths;"
for p in $paths; do
  git check-ignore -q "$p" || problems="$problems $p is not ignored by git (it would travel twice);"
done
echo "$paths" | grep -qx "$kit_default" || problems="$problems carry does not name $kit_default;"
echo "$command" | grep -q "tools/gpu-check --kit" || problems="$problems the command does not run tools/gpu-check --kit;"
[ -n "$limit" ] && [ "$limit" -le 600 ] && [ "$limit" -ge $((deadline + 30)) ] ||
  problems="$problems timeout_s '$limit' is not within $((deadline + 30))..600;"
if [ -z "$problems" ]; then ok docs_device_command "${#command} characters, carry $carry, timeout_s $limit"
else bad docs_device_command "${problems% ;}"; fi

finish
