#!/usr/bin/env bash
# tests/fuzz/run.sh — fuzzes every reader of a user's file.
#  * C: tests/fuzz/fuzz_checkpoint.c built with clang's libFuzzer and
#    AddressSanitizer, seeded from a real small checkpoint (its manifest.json
#    and a shard), for LZ_FUZZ_SECONDS (default 25).
#  * Lua: tests/fuzz/fuzz_readers.lua, a seeded mutation loop over the
#    safetensors, DeepSpeed config, config.json, safetensors index,
#    tokenizer.json, JSON Lines, token file and manifest readers (the
#    manifest also beside its shards), each for LZ_FUZZ_SECONDS / 6 (at
#    least 1 s), after its selfcheck; seeded from files made here (the
#    checkpoint, its exports, tools/prepare-data's token and instruction
#    files), tests/fuzz/seeds and tests/fixtures/tokenizer. A crash or a
#    hang (past twice the budget) names the input in flight.
# Ends with "N passed, N failed".
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
echo "== seeds of the Lua readers"
lz=build/bin/luazero
seeds="$work/lua-seeds"
mkdir -p "$seeds"/{safetensors,ds_config,hf_config,hf_index,tokenizer,jsonl,tokens,manifest,shards}
cp tests/fuzz/seeds/instruct_*.jsonl "$seeds/jsonl/"
cp "$step"/shard-*.zst "$seeds/shards/"
cp tests/fuzz/seeds/ds_config_*.json "$seeds/ds_config/"
cp tests/fixtures/tokenizer/*.json "$seeds/tokenizer/"
cp "$step/manifest.json" "$seeds/manifest/"
head -c 3000 "$work/corpus.txt" > "$work/small.txt"
if tools/ckpt export "$work/ck" "$work/hf" >/dev/null &&
   tools/ckpt export "$work/ck" "$seeds/safetensors/bf16.safetensors" --dtype bf16 >/dev/null &&
   cp "$work/hf/model.safetensors" "$seeds/safetensors/fp32.safetensors" &&
   cp "$work/hf/config.json" "$seeds/hf_config/gpt2.json" &&
   $lz -e 'local st = require("luazero.checkpoint.safetensors").open("'"$work"'/hf/model.safetensors")
     local map = {} for _, n in ipairs(st.names) do map[n] = "model.safetensors" end
     io.write(require("cjson").encode({ metadata = { total_size = st.size - st.start },
                                       weight_map = map }))' > "$seeds/hf_index/index.json" &&
   $lz -e 'local hf, reg = require("luazero.hf"), require("models.registry")
     io.write(require("cjson").encode(hf.config_json(reg.config("llama-tiny"))))' \
     > "$seeds/hf_config/llama.json" &&
   $lz -e 'local m = require("luazero.checkpoint.manifest")
     local t = m.decode(io.open("'"$step"'/manifest.json"):read("*a"), "manifest")
     io.write(require("cjson").encode(t.config))' > "$seeds/ds_config/from_checkpoint.json" &&
   tools/prepare-data "$work/small.txt" "$seeds/tokens/v1.bin" >/dev/null &&
   $lz -e 'local ids = {} for i = 1, 500 do ids[i] = (i * 7919) % 70000 end
     require("luazero.data").write_token_file("'"$seeds"'/tokens/v2.bin", ids, { version = 2 })' &&
   tools/prepare-data --format jsonl --tokenizer tests/fixtures/tokenizer/byte_level.json \
     tests/fuzz/seeds/instruct_prompt.jsonl "$seeds/tokens/instruct.bin" >/dev/null; then
  pass=$((pass + 1))
else
  echo "FAIL fuzz.lua_seeds: making the seed files failed (above)"
  fail=$((fail + 1))
fi

echo "== the Lua fuzzer's own checks catch readers that misbehave on purpose"
$lz tests/fuzz/fuzz_readers.lua "$seeds" selfcheck > "$work/self.log" 2>&1
grep -aE "^(ok|FAIL) " "$work/self.log"
sp=$(grep -ac "^ok " "$work/self.log")
sf=$(grep -ac "^FAIL " "$work/self.log")
if ! grep -qE "^[0-9]+ passed, 0 failed$" "$work/self.log"; then
  tail -5 "$work/self.log"
  sf=$((sf > 0 ? sf : 1))
fi
pass=$((pass + sp))
fail=$((fail + sf))

lua_secs=$(( secs / 6 > 0 ? secs / 6 : 1 ))
echo "== fuzz the Lua readers ${lua_secs}s each"
# 9 targets: a hang past twice their budget is killed and names the input in flight.
timeout $(( 18 * lua_secs + 30 )) $lz tests/fuzz/fuzz_readers.lua "$seeds" "$lua_secs" > "$work/lua.log" 2>&1
rc=$?
grep -aE "^(ok|FAIL) " "$work/lua.log" | head -20
grep -aA30 "^FAIL " "$work/lua.log" | grep -av "^ok " | head -40
lp=$(sed -n 's/^\([0-9]*\) passed, \([0-9]*\) failed$/\1/p' "$work/lua.log")
lf=$(sed -n 's/^\([0-9]*\) passed, \([0-9]*\) failed$/\2/p' "$work/lua.log")
pass=$((pass + ${lp:-0}))
fail=$((fail + ${lf:-0}))
if [ -z "$lp" ]; then
  in_flight=$(cat "$seeds/current" 2>/dev/null)
  tail -20 "$work/lua.log"
  echo "FAIL fuzz.lua: exit $rc (a crash, or killed past its time) during input ${in_flight:-?};" \
       "replay: $lz tests/fuzz/fuzz_readers.lua $out/lua-seeds replay ${in_flight:-TARGET N}"
  fail=$((fail + 1))
fi
if [ "$rc" != 0 ]; then # the seeds stay for a replay (the log names them under $work)
  rm -rf "$out/lua-seeds" && cp -r "$seeds" "$out/lua-seeds"
  echo "the seeds are kept in $out/lua-seeds: replay with $lz tests/fuzz/fuzz_readers.lua" \
       "$out/lua-seeds replay TARGET N"
fi

echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
