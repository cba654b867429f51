#!/bin/sh
# run.sh — the multi-rank tests: the correctness matrix (comm_check) for the
# shm backend (under lz_run) and the mpi backend (under mpirun) at 1-4 ranks,
# bitwise equality across two runs, across the two backends and with the
# shm backend's single-copy path turned off, collectives that differ between
# ranks, a rank killed
# with SIGKILL mid-collective, a rank that never joins, collectives on sim
# device buffers (sim_collectives.lua), and the launcher's
# promises (launcher.sh: signals at start-up, -n, mpirun's ranks). Ends with
# "N passed, N failed"; exits non-zero on any failure.
#   tests/comm/run.sh [--quick]      --quick: counts up to 1M+3 only
# Binaries: $LZ_BIN (default build/bin): lz_run, comm_check, luazero.
cd "$(dirname "$0")/../.."
BIN=${LZ_BIN:-build/bin}
QUICK=
[ "$1" = "--quick" ] && QUICK=--quick
for b in lz_run comm_check a2a_check luazero; do
  [ -x "$BIN/$b" ] || { echo "run.sh: $BIN/$b is missing; build first (or set LZ_BIN)"; exit 2; }
done
. tests/comm/lib.sh
MPIRUN="mpirun --allow-run-as-root --oversubscribe"

# --- the matrix: every op x dtype x count, each backend, 1..4 ranks
for w in 1 2 3 4; do
  # Ranks of a job share their comm buffers (1 rank: nothing to share).
  want="send shared, receive shared"; [ $w = 1 ] && want="send private, receive private"
  if "$BIN/lz_run" -n $w "$BIN/comm_check" --hashes $QUICK > "$TMP/shm$w" 2>&1 &&
     grep -q "all passed" "$TMP/shm$w" && grep -qx "buffers: $want" "$TMP/shm$w"; then
    ok "shm matrix, $w ranks, buffers $want $(grep -o "([0-9.]* s)" "$TMP/shm$w")"
  else bad "shm matrix, $w ranks (buffers $want)" "$TMP/shm$w"; fi
  if $MPIRUN -np $w "$BIN/comm_check" --hashes $QUICK > "$TMP/mpi$w" 2>&1 &&
     grep -q "all passed" "$TMP/mpi$w"; then ok "mpi matrix, $w ranks $(grep -o "([0-9.]* s)" "$TMP/mpi$w")"
  else bad "mpi matrix, $w ranks" "$TMP/mpi$w"; fi
  grep '^hash' "$TMP/shm$w" > "$TMP/h_shm$w"
  grep '^hash' "$TMP/mpi$w" > "$TMP/h_mpi$w"
  if [ -s "$TMP/h_shm$w" ] && cmp -s "$TMP/h_shm$w" "$TMP/h_mpi$w"; then
    ok "shm and mpi results bitwise equal, $w ranks ($(wc -l < "$TMP/h_shm$w") cases)"
  else bad "shm and mpi results bitwise equal, $w ranks"; fi
done

# --- all-to-all and sub-groups (a2a_check): shm and mpi at 1-4 ranks, the
# local backend, and every shm path (shared memory, process_vm_readv, the
# segment, non-temporal copies at every size) bitwise equal; count and
# group-list mismatches fail on every rank
for w in 1 2 3 4; do
  "$BIN/lz_run" -n $w "$BIN/a2a_check" --hashes > "$TMP/a2a_shm$w" 2>&1
  $MPIRUN -np $w "$BIN/a2a_check" --hashes > "$TMP/a2a_mpi$w" 2>&1
  grep '^hash' "$TMP/a2a_shm$w" > "$TMP/h_a2a_shm$w"
  if grep -q "all passed" "$TMP/a2a_shm$w" && grep -q "all passed" "$TMP/a2a_mpi$w" &&
     [ -s "$TMP/h_a2a_shm$w" ] && [ "$(grep '^hash' "$TMP/a2a_mpi$w")" = "$(cat "$TMP/h_a2a_shm$w")" ]; then
    ok "all-to-all and groups, shm and mpi bitwise equal, $w ranks ($(wc -l < "$TMP/h_a2a_shm$w") cases)"
  else bad "all-to-all and groups, shm and mpi, $w ranks" "$TMP/a2a_shm$w" "$TMP/a2a_mpi$w"; fi
done
"$BIN/a2a_check" --hashes > "$TMP/a2a_local" 2>&1
if grep -q "backend local, 1 ranks: .* all passed" "$TMP/a2a_local" &&
   [ "$(grep '^hash' "$TMP/a2a_local")" = "$(cat "$TMP/h_a2a_shm1")" ]; then
  ok "all-to-all and groups, local backend bitwise equal to shm"
else bad "all-to-all and groups, local backend" "$TMP/a2a_local"; fi
for w in 2 4; do
  for mode in cma segment stream; do
    envs=; args="--buffers private"
    [ $mode = segment ] && envs="LZ_SHM_CMA=0"
    [ $mode = stream ] && envs="LZ_SHM_STREAM_MIN=1" && args=
    env $envs "$BIN/lz_run" -n $w "$BIN/a2a_check" --hashes $args > "$TMP/a2a_$mode$w" 2>&1
    if grep -q "all passed" "$TMP/a2a_$mode$w" &&
       [ "$(grep '^hash' "$TMP/a2a_$mode$w")" = "$(cat "$TMP/h_a2a_shm$w")" ]; then
      ok "all-to-all and groups, shm through $mode bitwise equal, $w ranks"
    else bad "all-to-all and groups, shm through $mode, $w ranks" "$TMP/a2a_$mode$w"; fi
  done
done
if [ "$(grep -c "^mismatch: " "$TMP/a2a_shm4")" = 3 ] && [ "$(grep -c "^mismatch: " "$TMP/a2a_mpi4")" = 3 ]; then
  ok "all-to-all counts and group lists that disagree: an error naming the ranks, shm and mpi"
else bad "all-to-all and group mismatches" "$TMP/a2a_shm4" "$TMP/a2a_mpi4"; fi
for launch in shm mpi; do
  case $launch in
    shm) LZ_SIM_JITTER=5 "$BIN/luazero" -n 2 tests/comm/a2a_lua.lua > "$TMP/a2a_lua_$launch" 2>&1 ;;
    mpi) LZ_SIM_JITTER=5 $MPIRUN -np 2 -x LZ_SIM_JITTER "$BIN/luazero" tests/comm/a2a_lua.lua \
           > "$TMP/a2a_lua_$launch" 2>&1 ;;
  esac
  if [ "$(grep -c "a2a lua: all passed (2 ranks, $launch)" "$TMP/a2a_lua_$launch")" = 2 ]; then
    ok "$launch: luazero.comm all_to_all, all_to_all_v (host and sim buffers) and groups, 2 ranks"
  else bad "$launch: luazero.comm all-to-all and groups" "$TMP/a2a_lua_$launch"; fi
done

# Ranks calling different collectives (kind, count, reduce op, root, a call
# that moves nothing on one rank, a save's gather on rank 0 only): every rank
# fails at once naming both calls, none returns the other's data (shm).
for w in 2 3 4; do
  timeout 60 "$BIN/luazero" -n $w tests/comm/mismatch.lua > "$TMP/mismatch$w" 2>&1
  if [ "$(grep -c "mismatch: all passed" "$TMP/mismatch$w")" = $w ]; then
    ok "shm: ranks calling different collectives fail alike naming both, $w ranks"
  else bad "shm: ranks calling different collectives, $w ranks" "$TMP/mismatch$w"; fi
done

# The same under mpirun, a case a job (a failed rank ends the job): a rank
# finds a message of another collective and fails naming it; none returns
# another collective's data.
for w in 2 3; do
  for c in kind count op skipped; do
    timeout 60 $MPIRUN -np $w "$BIN/luazero" tests/comm/mismatch.lua $c > "$TMP/mpimis$w$c" 2>&1
    if grep -q "^case $c: .*the ranks called different collectives" "$TMP/mpimis$w$c" &&
       ! grep -q "returned without an error" "$TMP/mpimis$w$c"; then
      ok "mpi: ranks calling different collectives ($c) fail naming it, $w ranks"
    else bad "mpi: ranks calling different collectives ($c), $w ranks" "$TMP/mpimis$w$c"; fi
  done
done

# A rank that never joins an all-to-all: the others time out naming it.
t0=$(now)
LZ_COMM_TIMEOUT=2 "$BIN/lz_run" -n 3 "$BIN/a2a_check" --never-join 2 > "$TMP/a2a_never" 2>&1
code=$?
dt=$(echo "$(now) - $t0" | bc)
if [ $code -ne 0 ] && [ "$(echo "$dt < 15" | bc)" = 1 ] &&
   grep -q "all_to_all: rank 0 waited .* for ranks 2" "$TMP/a2a_never"; then
  ok "shm: a rank that never joins an all-to-all: timeout naming it, exit $code in ${dt%????} s"
else bad "shm: a rank that never joins an all-to-all (exit $code after $dt s)" "$TMP/a2a_never"; fi
LZ_COMM_TIMEOUT=2 timeout 60 $MPIRUN -np 3 -x LZ_COMM_TIMEOUT "$BIN/a2a_check" --never-join 2 > "$TMP/a2a_mnever" 2>&1
code=$?
if [ $code -ne 0 ] && [ $code -ne 124 ] &&
   grep -q "all_to_all (sharing the counts): all_gather: rank [01] waited .* for ranks 2" "$TMP/a2a_mnever"; then
  ok "mpi: a rank that never joins an all-to-all: timeout naming it, exit $code"
else bad "mpi: a rank that never joins an all-to-all (exit $code)" "$TMP/a2a_mnever"; fi

# Under AddressSanitizer and UBSan, where the debug build is there
# (make -C build config=debug a2a_check lz_run): every path, no report.
DBG=$(dirname "$BIN")/debug/bin
if [ -x "$DBG/a2a_check" ] && [ -x "$DBG/lz_run" ]; then
  for mode in shared private segment; do
    envs=; args=; [ $mode != shared ] && args="--buffers private"; [ $mode = segment ] && envs="LZ_SHM_CMA=0"
    env $envs ASAN_OPTIONS=detect_leaks=1 "$DBG/lz_run" -n 4 "$DBG/a2a_check" $args > "$TMP/a2a_asan_$mode" 2>&1
    if grep -q "all passed" "$TMP/a2a_asan_$mode" && ! grep -q -E "ERROR: AddressSanitizer|runtime error" "$TMP/a2a_asan_$mode"; then
      ok "all-to-all and groups under AddressSanitizer, shm $mode, 4 ranks"
    else bad "all-to-all and groups under AddressSanitizer, shm $mode, 4 ranks" "$TMP/a2a_asan_$mode"; fi
  done
fi

# --- a second run gives bitwise the same results
for w in 3 4; do
  "$BIN/lz_run" -n $w "$BIN/comm_check" --hashes --quick > "$TMP/again$w" 2>&1
  grep '^hash' "$TMP/again$w" > "$TMP/h_again$w"
  if [ -s "$TMP/h_again$w" ] && [ -z "$(grep -v -x -F -f "$TMP/h_shm$w" "$TMP/h_again$w")" ]; then
    ok "second shm run bitwise equal to the first, $w ranks"
  else bad "second shm run bitwise equal to the first, $w ranks" "$TMP/again$w"; fi
done

# --- the other paths give bitwise the same results: private buffers
# (process_vm_readv), private send and shared receive buffers (all-gather
# writes into its peers), shared memory on 4 KiB pages (LZ_SHM_HUGE=0: memfds),
# non-temporal copies at every size (LZ_SHM_STREAM_MIN=1; the quick matrix
# stops below the 8 MiB where they start)
for w in 2 3; do
  for mode in private mixed memfd stream; do
    case $mode in
      private) want="send private, receive private"; args="--buffers private"; envs= ;;
      mixed) want="send private, receive shared"; args="--buffers mixed"; envs= ;;
      memfd) want="send shared, receive shared"; args=; envs="LZ_SHM_HUGE=0" ;;
      stream) want="send shared, receive shared"; args=; envs="LZ_SHM_STREAM_MIN=1" ;;
    esac
    env $envs "$BIN/lz_run" -n $w "$BIN/comm_check" --hashes --quick $args > "$TMP/$mode$w" 2>&1
    grep '^hash' "$TMP/$mode$w" > "$TMP/h_$mode$w"
    if grep -q "all passed" "$TMP/$mode$w" && grep -qx "buffers: $want" "$TMP/$mode$w" &&
       [ -s "$TMP/h_$mode$w" ] && [ -z "$(grep -v -x -F -f "$TMP/h_shm$w" "$TMP/h_$mode$w")" ]; then
      ok "shm, $mode buffers ($want) bitwise equal, $w ranks"
    else bad "shm, $mode buffers ($want) bitwise equal, $w ranks" "$TMP/$mode$w"; fi
  done
done

# --- the shared-memory files reach the ranks through /proc/<launcher>/fd:
# a rank's program (here a shell) holds no descriptor of them to pass on
"$BIN/lz_run" -n 2 sh -c 'ls -l /proc/$$/fd' > "$TMP/fds" 2>&1
if [ -s "$TMP/fds" ] && ! grep -q "luazero-.*-rank-" "$TMP/fds"; then
  ok "no shared-memory descriptor is inherited by a rank's program"
else bad "no shared-memory descriptor is inherited by a rank's program" "$TMP/fds"; fi

# --- single copy off (LZ_SHM_CMA=0, as where ptrace rules forbid it): the
# segment paths give bitwise the same results
for w in 2 4; do
  LZ_SHM_CMA=0 "$BIN/lz_run" -n $w "$BIN/comm_check" --hashes --quick > "$TMP/nocma$w" 2>&1
  grep '^hash' "$TMP/nocma$w" > "$TMP/h_nocma$w"
  if grep -q "all passed" "$TMP/nocma$w" && [ -s "$TMP/h_nocma$w" ] &&
     [ -z "$(grep -v -x -F -f "$TMP/h_shm$w" "$TMP/h_nocma$w")" ]; then
    ok "shm without single copy (LZ_SHM_CMA=0) bitwise equal, $w ranks"
  else bad "shm without single copy (LZ_SHM_CMA=0) bitwise equal, $w ranks" "$TMP/nocma$w"; fi
done

# --- kill -9 of rank 2 in the middle of all-reduces
"$BIN/lz_run" -n 4 "$BIN/comm_check" --loop 60 > "$TMP/kill" 2>&1 &
LPID=$!
sleep 1.5
victim=
for p in $(pgrep -P $LPID); do
  tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -qx RANK=2 && victim=$p
done
t0=$(now)
[ -n "$victim" ] && kill -9 "$victim"
for i in $(seq 1 120); do kill -0 $LPID 2>/dev/null || break; sleep 0.1; done
wait $LPID
code=$?
dt=$(echo "$(now) - $t0" | bc)
if [ -n "$victim" ] && [ $code -ne 0 ] && [ "$(echo "$dt < 10" | bc)" = 1 ] &&
   grep -q "rank 2 was killed by signal 9 (SIGKILL)" "$TMP/kill" && [ "$(shm_left $LPID)" = 0 ]; then
  ok "kill -9 rank 2: launcher exits $code in ${dt%????} s, names the rank, /dev/shm clean"
else bad "kill -9 rank 2 (victim '$victim', exit $code after $dt s, shm left $(shm_left $LPID))" "$TMP/kill"; fi

# --- SIGTERM to the launcher: ranks stopped, segment removed
"$BIN/lz_run" -n 3 "$BIN/comm_check" --loop 60 > "$TMP/term" 2>&1 &
LPID=$!
sleep 1.5
kill -TERM $LPID
wait $LPID
code=$?
if [ $code -ne 0 ] && [ "$(shm_left $LPID)" = 0 ] && [ -z "$(pgrep -P $LPID)" ]; then
  ok "SIGTERM to the launcher: exit $code, ranks gone, /dev/shm clean"
else bad "SIGTERM to the launcher (exit $code)" "$TMP/term"; fi

# --- a rank that never joins: the others time out naming it
t0=$(now)
LZ_COMM_TIMEOUT=2 "$BIN/lz_run" -n 4 "$BIN/comm_check" --never-join 3 > "$TMP/never" 2>&1
code=$?
dt=$(echo "$(now) - $t0" | bc)
if [ $code -ne 0 ] && [ "$(echo "$dt < 15" | bc)" = 1 ] &&
   grep -q "all_reduce: rank 0 waited .* for ranks 3" "$TMP/never"; then
  ok "shm: a rank that never joins: timeout error naming it, exit $code in ${dt%????} s"
else bad "shm: a rank that never joins (exit $code after $dt s)" "$TMP/never"; fi
t0=$(now)
LZ_COMM_TIMEOUT=2 timeout 60 $MPIRUN -np 4 -x LZ_COMM_TIMEOUT "$BIN/comm_check" --never-join 3 > "$TMP/mnever" 2>&1
code=$?
dt=$(echo "$(now) - $t0" | bc)
if [ $code -ne 0 ] && [ $code -ne 124 ] && grep -q "all_reduce: rank [0-2] waited .* for ranks 3" "$TMP/mnever"; then
  ok "mpi: a rank that never joins: timeout error naming it, exit $code in ${dt%????} s"
else bad "mpi: a rank that never joins (exit $code after $dt s)" "$TMP/mnever"; fi

# --- output of ranks other than 0: prefixed, or silenced
"$BIN/lz_run" -n 3 "$BIN/comm_check" --loop 0 > "$TMP/out" 2>&1
if grep -qx "looping" "$TMP/out" && grep -qx "\[rank 1\] looping" "$TMP/out" &&
   grep -qx "\[rank 2\] looping" "$TMP/out"; then ok "rank output prefixed"
else bad "rank output prefixed" "$TMP/out"; fi
"$BIN/lz_run" -n 3 --quiet-ranks "$BIN/comm_check" --loop 0 > "$TMP/quiet" 2>&1
if [ "$(cat "$TMP/quiet")" = "looping" ]; then ok "rank output silenced (--quiet-ranks)"
else bad "rank output silenced (--quiet-ranks)" "$TMP/quiet"; fi

# --- collectives on sim device buffers (with jitter on the device streams):
# bitwise the host result, blocking and async, and on mixed host/sim buffers
for launch in shm mpi; do
  case $launch in
    shm) LZ_SIM_JITTER=5 "$BIN/luazero" -n 2 tests/comm/sim_collectives.lua > "$TMP/sim_$launch" 2>&1 ;;
    mpi) LZ_SIM_JITTER=5 $MPIRUN -np 2 -x LZ_SIM_JITTER "$BIN/luazero" tests/comm/sim_collectives.lua \
           > "$TMP/sim_$launch" 2>&1 ;;
  esac
  code=$?
  if [ $code -eq 0 ] && [ "$(grep -c "sim collectives: all passed (2 ranks, $launch)" "$TMP/sim_$launch")" = 2 ]; then
    ok "$launch: all_reduce, reduce_scatter, all_gather on sim buffers bitwise equal to host ones, 2 ranks"
  else bad "$launch: collectives on sim buffers (exit $code)" "$TMP/sim_$launch"; fi
done

# --- the launcher's promises on signals, -n, and mpirun's ranks (launcher.sh)
tests/comm/launcher.sh > "$TMP/launcher" 2>&1
grep -v -E "^[0-9]+ passed, [0-9]+ failed" "$TMP/launcher"
summary=$(grep -E "^[0-9]+ passed, [0-9]+ failed" "$TMP/launcher" | tail -n 1)
if [ -n "$summary" ]; then
  passed=$((passed + $(echo "$summary" | awk '{print $1}')))
  failed=$((failed + $(echo "$summary" | awk '{print $3}')))
else bad "launcher.sh ended without its summary line" "$TMP/launcher"; fi

echo "$passed passed, $failed failed"
[ $failed -eq 0 ]
