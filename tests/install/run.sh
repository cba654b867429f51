#!/usr/bin/env bash
# tests/install/run.sh — tools/install into a temporary prefix, then, from a
# folder that is not the checkout, with only the prefix's bin on PATH:
# `luazero --version`, a script of one's own (`luazero my_train.lua`), a
# bundled script by name (`luazero -m train`, `luazero -n 2 -m
# examples/own_model`), an example's loss falling; then the documented
# uninstall leaves nothing behind; the tools through a link to them, an
# empty --prefix refused, tools/checksums failing when its runs fail. Ends
# with "N passed, N failed".
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pass=0
fail=0
check() { # name, condition (a command), detail
  local name=$1 detail=$3
  if eval "$2"; then pass=$((pass + 1)); echo "ok   install.$name"
  else fail=$((fail + 1)); echo "FAIL install.$name"; echo "$detail" | tail -n 20 | sed 's/^/     /'; fi
}

prefix="$work/prefix"
out=$(tools/install --prefix "$prefix" 2>&1)
check installs '[ -x "$prefix/bin/luazero" ] && [ -d "$prefix/lib/luazero/lua" ]' "$out"

elsewhere="$work/elsewhere"
mkdir -p "$elsewhere"
cd "$elsewhere"
export PATH="$prefix/bin:/usr/bin:/bin"
unset LUAZERO_HOME
awk 'BEGIN { for (i = 0; i < 400; i++) printf "line %d of the corpus: %d %s\n", i, (i * 7919) % 1000, (i % 3 ? "alpha" : "beta") }' > corpus.txt

out=$(luazero --version 2>&1)
check version '[[ "$out" =~ ^luazero\ [0-9]+\.[0-9]+ ]]' "$out"

out=$(luazero -e 'print(require("luazero").root)' 2>&1)
check root_is_the_install '[ "$out" = "$prefix/lib/luazero" ]' "$out"

cat > my_train.lua <<'LUA'
local config, data = require("luazero.config"), require("luazero.data")
local zero, models = require("luazero.zero"), require("models.registry")
local mcfg = models.config("gpt2-nano", { n_layer = 1, n_embd = 32, n_head = 2, context = 16 })
local engine = zero.initialize{ model = models.new(mcfg), seed = 1, batch = { 4, 16 },
                                config = config.load({ train_micro_batch_size_per_gpu = 4 }) }
local corpus = data.load(arg[1])
local loader = data.loader(corpus, { B = 4, T = 16, seed = 1, vocab = mcfg.vocab })
for step = 1, 6 do print(("step %d loss %.4f"):format(step, engine:train_batch(loader).loss)) end
LUA
out=$(luazero my_train.lua corpus.txt 2>&1)
first=$(echo "$out" | awk '/^step 1 /{print $4}')
last=$(echo "$out" | awk '/^step 6 /{print $4}')
check my_train_runs '[ -n "$first" ] && [ -n "$last" ] && awk "BEGIN{exit !($last < $first)}"' "$out"

out=$(luazero -m train --data corpus.txt --model gpt2-nano --n-layer 1 --n-embd 32 --n-head 2 \
      --context 16 --seq-len 8 --micro-batch 2 --steps 3 --sample 0 --eval-batches 1 2>&1)
check bundled_train_by_name 'echo "$out" | grep -q "^params_checksum [0-9a-f]"' "$out"

out=$(luazero -n 2 -m examples/own_model corpus.txt 4 2>&1)
check bundled_example_on_2_ranks 'echo "$out" | grep -q "^params_checksum [0-9a-f]" && [ "$(echo "$out" | grep -c "^step ")" = 4 ]' "$out"

out=$(luazero -m train.lua --help 2>&1); st=$?
check bundled_name_with_its_extension '[ $st = 0 ] && echo "$out" | grep -q "^usage: luazero scripts/train.lua"' "$out"

out=$(luazero -m nothing-here 2>&1); st=$?
check unknown_name_is_one_line '[ $st = 2 ] && [ "$(echo "$out" | wc -l)" = 1 ] && echo "$out" | grep -q "no bundled script"' "$out"

left=$(ls -A "$elsewhere" | grep -v -e '^corpus.txt$' -e '^my_train.lua$')
check writes_nothing_beside_the_script '[ -z "$left" ]' "$left"

cd "$root"
out=$(tools/install --uninstall --prefix "$prefix" 2>&1)
check uninstall_leaves_nothing '[ ! -e "$prefix/bin/luazero" ] && [ ! -e "$prefix/lib/luazero" ]' "$out"

# A prefix spelt with a trailing slash and ./ parts: the link install makes is
# the one uninstall recognises (it left a link to nothing behind, saying it
# had removed it), and only what was removed is reported.
odd="$prefix/./odd/"
tools/install --prefix "$odd" >/dev/null 2>&1
out=$(tools/install --uninstall --prefix "$odd" 2>&1)
check uninstall_of_an_odd_prefix_removes_its_link '[ ! -L "$prefix/odd/bin/luazero" ] && [ ! -e "$prefix/odd/lib/luazero" ] && echo "$out" | grep -q "bin/luazero"' "$out"
out=$(tools/install --uninstall --prefix "$odd" 2>&1)
check uninstall_again_says_nothing_was_there 'echo "$out" | grep -q "nothing of luazero" ' "$out"

# A checkout whose folders are links (here a copy of lua/, linked): the
# install holds files of its own, and the linked tree keeps its lua/main.c.
linked="$work/linked"
mkdir -p "$linked"
cp -R lua "$work/lua-copy"
ln -s "$work/lua-copy" "$linked/lua"
for d in build models scripts tools; do ln -s "$root/$d" "$linked/$d"; done
out=$("$linked/tools/install" --prefix "$work/prefix2" 2>&1)
check linked_checkout_keeps_its_files '[ -f "$work/lua-copy/main.c" ] && [ ! -L "$work/prefix2/lib/luazero/lua" ] && [ -f "$work/prefix2/lib/luazero/lua/luazero/args.lua" ] && [ ! -e "$work/prefix2/lib/luazero/lua/main.c" ]' "$out"

# The tools run through a link to them (as one links them into a bin
# folder), from another folder.
mkdir -p "$work/mybin"
ln -s "$root/tools/estimate" "$work/mybin/estimate"
ln -s ../mybin/estimate "$work/mybin/estimate2" # (a link to the link)
out=$(cd "$work" && mybin/estimate2 --model gpt2-nano 2>&1); st=$?
check a_tool_through_a_link '[ $st = 0 ] && echo "$out" | grep -q "model states per rank for gpt2-nano"' "$out"

# An empty --prefix (an unset $PREFIX) is refused, not taken as this folder.
mkdir -p "$work/here"
out=$(cd "$work/here" && "$root/tools/install" --prefix= 2>&1); st=$?
check an_empty_prefix_is_refused '[ $st = 2 ] && echo "$out" | grep -q "install: --prefix is empty" && [ -z "$(ls -A "$work/here")" ]' "$out"

# tools/checksums with a luazero that fails exits 1 (each run's line says
# FAILED), and names a luazero given relative to the caller's folder.
printf '#!/bin/sh\nexit 3\n' > "$work/here/fake-lz"
chmod +x "$work/here/fake-lz"
out=$(cd "$work/here" && "$root/tools/checksums" ./fake-lz 2>&1); st=$?
check checksums_fails_when_runs_fail '[ $st = 1 ] && echo "$out" | grep -q "^gpt2 w1 s0 fp32 FAILED" && echo "$out" | grep -q "runs FAILED"' "$out"
out=$(cd "$work/here" && "$root/tools/checksums" ./not-there 2>&1); st=$?
check checksums_refuses_a_missing_luazero '[ $st = 2 ] && echo "$out" | grep -q "not-there: no such executable"' "$out"

echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
