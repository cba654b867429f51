#!/usr/bin/env bash
# tests/fuzz/run.sh — builds tests/fuzz/fuzz_checkpoint.c with clang's
# libFuzzer and AddressSanitizer, makes a seed corpus from a real small
# checkpoint (its manifest.json and a shard), and fuzzes for LZ_FUZZ_SECONDS
# (default 25). Ends with "N passed, N failed".
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)
secs=${LZ_FUZZ_SECONDS:-25}
out=build/fuzz
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pass=0
fail=0

echo "== build fuzz_checkpoint (clang -fsanitize=fuzzer,address)"
# The checkpoint reader (core/io/checkpoint.c) is built instrumented; the rest of
# the library comes from build/lib/libluazero.so.
if ! clang -g -O1 -std=gnu11 -fsanitize=fuzzer,address,undefined -Icore \
    -I/usr/include/luajit-2.1 tests/fuzz/fuzz_checkpoint.c core/io/checkpoint.c \
    -Lbuild/lib -lluazero -Wl,-rpath,"$root/build/lib" -fopenmp -lzstd -lxxhash -lluajit-5.1 \
    -lm -ldl -o "$out/fuzz_checkpoint"; then
  echo "FAIL fuzz.build (the compiler says why above; tools/setup installs clang)"
  echo "0 passed, 1 failed"
  exit 1
fi
pass=$((pass + 1))

echo "== seed corpus from a real checkpoint"
yes "A seed corpus line of text for a tiny model." | head -50 > "$work/corpus.txt"
if ! build/bin/luazero scripts/train.lua --model gpt2-nano --n-layer 1 --n-embd 16 --n-head 2 \
    --context 8 --vocab 128 --seq-len 8 --micro-batch 2 --steps 2 --sample 0 \
    --data "$work/corpus.txt" --save "$work/ck" --save-zstd-level 19 >/dev/null 2>&1; then
  echo "FAIL fuzz.seed: a tiny training run with --save failed"
  echo "$pass passed, $((fail + 1)) failed"
  exit 1
fi
mkdir -p "$work/seeds"
step="$work/ck/step-000002"
{ printf '\001'; cat "$step/manifest.json"; } > "$work/seeds/manifest"
{ printf '\000'; cat "$step/shard-00000-of-00001.zst"; } > "$work/seeds/shard"
{ printf '\000'; head -c 48 "$step/shard-00000-of-00001.zst"; } > "$work/seeds/header"
pass=$((pass + 1))

echo "== fuzz ${secs}s"
if LZ_ROOT="$root" ASAN_OPTIONS=detect_leaks=0 "$out/fuzz_checkpoint" -max_total_time="$secs" \
    -max_len=65536 -print_final_stats=1 -artifact_prefix="$work/" "$work/seeds" \
    > "$work/log" 2>&1; then
  grep -E "stat::number_of_executed_runs|stat::new_units_added" "$work/log"
  echo "ok   fuzz.fuzz_checkpoint ${secs}s"
  pass=$((pass + 1))
else
  tail -40 "$work/log"
  echo "FAIL fuzz.fuzz_checkpoint: a crash or stray error (input above)"
  fail=$((fail + 1))
fi
echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
