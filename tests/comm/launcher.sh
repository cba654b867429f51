#!/bin/sh
# launcher.sh — the launcher's promises (docs/collectives.md, "What the
# launcher promises on every signal"): -n checked before anything starts;
# SIGKILL, SIGTERM or SIGINT of the launcher and SIGKILL of a rank at random
# moments of start-up leave no process of the job and nothing in /dev/shm;
# under mpirun (--backend mpi) every rank knows its rank, the cores are
# shared, rank 0 alone prints, and a signal to the launcher stops the job.
# Called by run.sh; prints "ok ..." / "FAIL ..." lines and ends with
# "N passed, N failed".
#   tests/comm/launcher.sh [RUNS]      RUNS: early-fault runs (default 40)
# Binaries: $LZ_BIN (default build/bin): luazero, lz_run, comm_check.
cd "$(dirname "$0")/../.."
BIN=${LZ_BIN:-build/bin}
RUNS=${1:-40}
. tests/comm/lib.sh
cores=$(nproc)

# Whether process $1 was started with $2 (NAME=value) in its environment.
has_env() { tr "\\0" "\\n" 2>/dev/null < "/proc/$1/environ" | grep -qx "$2"; }
# Processes whose environment carries LZ_TEST_JOB=$1 (the launcher's
# children inherit it, mpirun's ranks too), the launcher itself aside.
job_procs() {
  for e in /proc/[0-9]*/environ; do
    p=${e#/proc/}
    p=${p%/environ}
    [ "$p" != "$2" ] && has_env "$p" "LZ_TEST_JOB=$1" && echo "$p"
  done
}
# Waits up to 5 s for the job's processes to go; prints those left.
job_left() {
  for i in $(seq 1 50); do
    left=$(job_procs "$1" "$2")
    [ -z "$left" ] && return
    sleep 0.1
  done
  echo $left
}
# A rank that joins the job's communicator, then sleeps 30 s in its own process.
SLEEPER='require("luazero.comm").init(); local ffi = require("ffi"); ffi.cdef("int poll(void *, unsigned long, int);"); ffi.C.poll(nil, 0, 30000)'
# A rank of launcher $1 (a child that was exec'd with LZ_LAUNCHER_PID set),
# not a helper the launcher forks for itself.
a_rank() {
  for c in $(pgrep -P "$1"); do
    has_env "$c" "LZ_LAUNCHER_PID=$1" && echo "$c" && return
  done
}
# A random delay of 0-200 ms, as "0.NNN".
delay() { printf "0.%03d" $(( $(od -An -N2 -tu2 /dev/urandom) % 201 )); }

# --- -n out of range: one line naming the flag and the range, nothing started
"$BIN/luazero" -n 99999999999 -e 'print("ran")' > "$TMP/wrap" 2>&1
code=$?
if [ $code -ne 0 ] && [ "$(wc -l < "$TMP/wrap")" = 1 ] &&
   grep -q "^luazero: -n takes a number of ranks from 1 to 4096 (got '99999999999')$" "$TMP/wrap"; then
  ok "-n 99999999999: exit $code, one line naming -n, the range and the number as given"
else bad "-n 99999999999 (exit $code)" "$TMP/wrap"; fi

# --- more ranks than the machine runs: refused at once, before any rank
n=$((8 * cores + 1))
t0=$(now)
"$BIN/luazero" -n $n -e 'print("ran")' > "$TMP/many" 2>&1
code=$?
dt=$(echo "$(now) - $t0" | bc)
if [ $code -ne 0 ] && [ "$(echo "$dt < 2" | bc)" = 1 ] && [ "$(wc -l < "$TMP/many")" = 1 ] &&
   grep -q "^luazero: launch: -n $n: at most $((8 * cores)) ranks run on this machine's $cores core" "$TMP/many"; then
  ok "-n $n on $cores cores: refused in ${dt%????} s, one line naming -n and the limit"
else bad "-n $n on $cores cores (exit $code after $dt s)" "$TMP/many"; fi

# --- faults at random moments of start-up (0-200 ms after the launcher
# starts): SIGKILL of the launcher, SIGKILL of a rank, SIGTERM and SIGINT of
# the launcher. Afterwards no process of the job, nothing in /dev/shm; a
# caught signal exits 128+signal with a message once any rank had started;
# a killed rank makes the launcher exit non-zero naming it.
fails=0
for i in $(seq 1 "$RUNS"); do
  case $((i % 4)) in
    0) fault=kill-launcher ;; 1) fault=kill-rank ;; 2) fault=term-launcher ;; 3) fault=int-launcher ;;
  esac
  tag="launcher-$$-$i"
  d=$(delay)
  # (a non-interactive shell starts a background job with SIGINT ignored; a
  # SIGINT before the launcher sets its handler would then be lost, where at
  # a terminal, SIGINT's default disposition, it ends the launcher: that one)
  LZ_TEST_JOB=$tag env --default-signal=INT "$BIN/lz_run" -n 3 "$BIN/comm_check" --loop 30 \
    > "$TMP/fault" 2>&1 &
  lpid=$!
  sleep "$d"
  started=$(pgrep -P $lpid | head -1)
  case $fault in
    kill-launcher) kill -KILL $lpid ;;
    kill-rank)
      started=$(a_rank $lpid)
      for k in $(seq 1 100); do [ -n "$started" ] && break; sleep 0.01; started=$(a_rank $lpid); done
      [ -n "$started" ] && kill -KILL "$started" ;;
    term-launcher) kill -TERM $lpid ;;
    int-launcher) kill -INT $lpid ;;
  esac
  wait $lpid 2>/dev/null
  code=$?
  left=$(job_left "$tag" $lpid)
  shm=$(shm_left $lpid)
  why=
  [ -n "$left" ] && why="$why processes left: $left;"
  [ "$shm" != 0 ] && why="$why /dev/shm entries left: $shm;"
  case $fault in
    kill-rank)
      { [ -n "$started" ] && [ $code -ne 0 ] && grep -q "luazero: rank [0-2] was killed by signal 9" "$TMP/fault"; } ||
        why="$why exit $code without naming the killed rank;" ;;
    term-launcher | int-launcher)
      sig=15; name=SIGTERM; [ $fault = int-launcher ] && sig=2 && name=SIGINT
      [ $code = $((128 + sig)) ] || why="$why exit $code, expected $((128 + sig));"
      if [ -n "$started" ] && ! grep -q "luazero: received $name" "$TMP/fault"; then
        why="$why no message about $name;"
      fi ;;
  esac
  if [ -n "$why" ]; then
    fails=$((fails + 1))
    bad "early fault $i: $fault after $d s:$why" "$TMP/fault"
  fi
done
[ $fails = 0 ] && ok "$RUNS early faults (SIGKILL/SIGTERM/SIGINT of the launcher, SIGKILL of a rank, 0-200 ms): no process, no /dev/shm entry left, exit codes and messages right"

# --- SIGTERM while the ranks start (-n 8 luazero ranks): they are stopped
tag="launcher-$$-many"
LZ_TEST_JOB=$tag "$BIN/luazero" -n 8 -e "$SLEEPER" > "$TMP/startup" 2>&1 &
lpid=$!
for k in $(seq 1 200); do [ -n "$(pgrep -P $lpid)" ] && break; sleep 0.005; done
kill -TERM $lpid
t0=$(now)
wait $lpid
code=$?
dt=$(echo "$(now) - $t0" | bc)
left=$(job_left "$tag" $lpid)
if [ $code = 143 ] && [ -z "$left" ] && [ "$(echo "$dt < 5" | bc)" = 1 ] &&
   grep -q "luazero: received SIGTERM" "$TMP/startup"; then
  ok "SIGTERM while 8 ranks start: exit 143 in ${dt%????} s with a message, no process left"
else bad "SIGTERM while 8 ranks start (exit $code after $dt s, left '$left')" "$TMP/startup"; fi

# --- a parent that ignores SIGCHLD (exec keeps it ignored): the launcher
# puts it back to its default, so it still sees its ranks end
/usr/bin/python3 -c '
import signal, subprocess, sys, time
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
t = time.time()
p = subprocess.Popen([sys.argv[1], "-n", "2", "-e", "io.write(\"done\\n\")"], stdout=subprocess.PIPE)
try:
    out, _ = p.communicate(timeout=20)
    print("exit", p.returncode, "lines", out.decode().count("done"), "in %.2f s" % (time.time() - t))
except subprocess.TimeoutExpired:
    p.kill()
    print("no end after 20 s")
' "$BIN/luazero" > "$TMP/sigchld" 2>&1
if grep -Eq "^exit 0 lines 2 in [0-9.]+ s$" "$TMP/sigchld"; then
  ok "SIGCHLD ignored by the launcher's parent: the job ends ($(cut -d' ' -f5- "$TMP/sigchld"))"
else bad "SIGCHLD ignored by the launcher's parent" "$TMP/sigchld"; fi

# --- SIGINT to a launcher whose ranks ignore SIGTERM and relay no output:
# it waits for them (LZ_STOP_GRACE 3 s, then SIGKILL) asleep, not spinning
IGNORER='local ffi = require("ffi"); ffi.cdef("typedef void (*lz_sh)(int); lz_sh signal(int, lz_sh); int poll(void *, unsigned long, int);"); ffi.C.signal(15, ffi.cast("lz_sh", 1)); ffi.C.signal(2, ffi.cast("lz_sh", 1)); ffi.C.poll(nil, 0, 30000)'
tag="launcher-$$-quiet"
LZ_TEST_JOB=$tag LZ_STOP_GRACE=3 LZ_RANK_OUTPUT=quiet "$BIN/luazero" -n 2 -e "$IGNORER" > "$TMP/quiet" 2>&1 &
lpid=$!
sleep 1
kill -INT $lpid
sleep 2.5
ticks=$(awk '{print $14 + $15}' "/proc/$lpid/stat" 2>/dev/null)
wait $lpid
code=$?
left=$(job_left "$tag" $lpid)
if [ -n "$ticks" ] && [ "$ticks" -lt 50 ] && [ $code = 130 ] && [ -z "$left" ]; then
  ok "SIGINT, ranks ignoring SIGTERM, output quiet: $ticks CPU ticks of the launcher in 3.5 s, exit 130, no process left"
else bad "SIGINT, ranks ignoring SIGTERM, output quiet (ticks '$ticks', exit $code, left '$left')" "$TMP/quiet"; fi

# --- LZ_RANK_OUTPUT=quiet: rank 1's stdout silenced, its stderr (an error
# of its own) still shown, prefixed
LZ_RANK_OUTPUT=quiet "$BIN/luazero" -n 2 -e 'print("out " .. os.getenv("RANK")); io.stderr:write("err " .. os.getenv("RANK") .. "\n")' > "$TMP/quiet2" 2>&1
if [ "$(grep -c '^out' "$TMP/quiet2")" = 1 ] && grep -qx "out 0" "$TMP/quiet2" &&
   grep -qx "\[rank 1\] err 1" "$TMP/quiet2" && grep -qx "err 0" "$TMP/quiet2"; then
  ok "LZ_RANK_OUTPUT=quiet: rank 1's stdout silenced, its stderr shown prefixed"
else bad "LZ_RANK_OUTPUT=quiet: rank 1's stdout silenced, its stderr shown" "$TMP/quiet2"; fi

# --- under mpirun: OpenMPI's rank variables become RANK, WORLD_SIZE,
# LOCAL_RANK, LOCAL_WORLD_SIZE, and the cores are shared among the ranks
want=$((cores / 3)); [ $want -lt 1 ] && want=1
timeout 60 "$BIN/luazero" -n 3 --backend mpi -e 'io.write(os.getenv("RANK"), " ", os.getenv("WORLD_SIZE"), " ", os.getenv("LOCAL_RANK"), " ", os.getenv("LOCAL_WORLD_SIZE"), " ", require("luazero").threads(), "\n")' > "$TMP/mpienv" 2>&1
code=$?
if [ $code = 0 ] && [ "$(sort "$TMP/mpienv" | tr '\n' ,)" = "0 3 0 3 $want,1 3 1 3 $want,2 3 2 3 $want," ]; then
  ok "--backend mpi -n 3: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE set, $want thread(s) per rank on $cores cores"
else bad "--backend mpi -n 3: rank variables and threads (exit $code; want $want threads)" "$TMP/mpienv"; fi

# --- under mpirun, scripts/train.lua prints from rank 0 only
printf 'To be, or not to be, that is the question:\n%.0s' $(seq 1 100) > "$TMP/corpus.txt"
timeout 120 "$BIN/luazero" -n 2 --backend mpi scripts/train.lua --model gpt2-nano --n-layer 2 \
  --n-embd 64 --n-head 4 --context 32 --seq-len 16 --sample 0 --eval-batches 1 --micro-batch 2 \
  --steps 3 --data "$TMP/corpus.txt" > "$TMP/mpitrain" 2>&1
code=$?
if [ $code = 0 ] && [ "$(grep -c '^step ' "$TMP/mpitrain")" = 3 ] &&
   [ "$(grep -c '^params_checksum' "$TMP/mpitrain")" = 1 ]; then
  ok "--backend mpi -n 2 train.lua: 3 step lines and 1 checksum (rank 0 alone prints)"
else bad "--backend mpi -n 2 train.lua prints once (exit $code)" "$TMP/mpitrain"; fi

# --- under mpirun, SIGTERM to the launcher stops mpirun and its ranks
tag="launcher-$$-mpi"
LZ_TEST_JOB=$tag "$BIN/luazero" -n 2 --backend mpi -e "$SLEEPER" > "$TMP/mpiterm" 2>&1 &
lpid=$!
sleep 1.5
kill -TERM $lpid
wait $lpid
code=$?
left=$(job_left "$tag" $lpid)
if [ $code = 143 ] && [ -z "$left" ] && grep -q "luazero: received SIGTERM; stopping mpirun" "$TMP/mpiterm"; then
  ok "--backend mpi: SIGTERM to the launcher: exit 143, mpirun and its ranks gone"
else bad "--backend mpi: SIGTERM to the launcher (exit $code, left '$left')" "$TMP/mpiterm"; fi

# --- -n passes every argument on (it kept the first 509 of a command line);
# more than 64 -e chunks are refused naming the limit
echo 'print("args", #arg, arg[#arg])' > "$TMP/count.lua"
"$BIN/luazero" -n 2 "$TMP/count.lua" $(seq 600) > "$TMP/args" 2>&1
if [ "$(grep -c 'args	600	600' "$TMP/args")" = 2 ]; then
  ok "-n 2 script with 600 arguments: each rank gets all 600"
else bad "-n 2 script with 600 arguments" "$TMP/args"; fi
"$BIN/luazero" -n 1 $(for i in $(seq 65); do printf -- '-e x=1 '; done) "$TMP/count.lua" \
  > "$TMP/e65" 2>&1
code=$?
if [ $code = 2 ] && grep -q "at most 64 -e chunks" "$TMP/e65"; then
  ok "65 -e chunks: refused naming the limit (exit 2)"
else bad "65 -e chunks (exit $code)" "$TMP/e65"; fi

# --- a backend of one rank under -n 2 would run two jobs of one rank each,
# writing the same files: refused before any starts (exit 2)
LZ_BACKEND=local "$BIN/luazero" -n 2 -e 'print("started")' > "$TMP/local" 2>&1
code=$?
if [ $code = 2 ] && grep -q "backend local (LZ_BACKEND) serves at most 1 rank, but -n asks for 2" \
   "$TMP/local" && ! grep -q started "$TMP/local"; then
  ok "LZ_BACKEND=local -n 2: refused before any rank starts (exit 2)"
else bad "LZ_BACKEND=local -n 2 (exit $code)" "$TMP/local"; fi

# --- a luazero a rank starts is a job of its own: it does not join the
# outer job's segment (a sweep under -n, os.execute in a script)
cat > "$TMP/child.lua" <<'LUA'
local comm = require("luazero.comm"); comm.init()
print("child", os.getenv("RANK"), comm.size())
LUA
cat > "$TMP/parent.lua" <<LUA
local comm = require("luazero.comm"); comm.init()
if comm.rank() == 0 then os.execute("'$BIN/luazero' '$TMP/child.lua'") end
comm.barrier()
print("parent", comm.rank())
LUA
LZ_COMM_TIMEOUT=10 timeout 60 "$BIN/luazero" -n 2 "$TMP/parent.lua" > "$TMP/nested" 2>&1
code=$?
if [ $code = 0 ] && grep -q "^child	nil	1$" "$TMP/nested" && [ "$(grep -c parent "$TMP/nested")" = 2 ]; then
  ok "a luazero started by a rank runs alone (RANK unset, world 1), the outer job goes on"
else bad "a luazero started by a rank (exit $code)" "$TMP/nested"; fi

# --- a flag given twice, and a script that is not there, are said once by
# the launcher before any rank starts (exit 2)
"$BIN/luazero" -n 2 -n 3 -e 'print("started")' > "$TMP/twice" 2>&1
code1=$?
"$BIN/luazero" -n 2 "$TMP/no-such-script.lua" > "$TMP/noscript" 2>&1
code2=$?
if [ $code1 = 2 ] && grep -q "^luazero: -n given twice; give it once$" "$TMP/twice" &&
   [ $code2 = 2 ] && [ "$(grep -c "cannot open script" "$TMP/noscript")" = 1 ] &&
   ! grep -q "\[rank" "$TMP/noscript"; then
  ok "-n given twice, and a missing script under -n 2: one line from the launcher, exit 2"
else bad "-n twice (exit $code1) / missing script (exit $code2)" "$TMP/noscript"; fi

# --- --quiet-ranks under --backend mpi: ranks other than 0 silence their own stdout
"$BIN/luazero" -n 2 --backend mpi --quiet-ranks -e 'print("hello", os.getenv("RANK"))' \
  > "$TMP/mpiquiet" 2>&1
code=$?
if [ $code = 0 ] && [ "$(grep -c hello "$TMP/mpiquiet")" = 1 ] && grep -q "hello	0" "$TMP/mpiquiet"; then
  ok "--backend mpi --quiet-ranks: rank 0 alone prints"
else bad "--backend mpi --quiet-ranks (exit $code)" "$TMP/mpiquiet"; fi

# --- a rank that exits (code 0) before its comm.init: the others stop at
# once naming it, not after LZ_COMM_TIMEOUT
t0=$(now)
LZ_COMM_TIMEOUT=60 timeout 90 "$BIN/luazero" -n 2 -e 'if os.getenv("RANK") == "1" then os.exit(0) end
local c = require("luazero.comm"); c.init(); c.barrier()' > "$TMP/early" 2>&1
code=$?
dt=$(echo "$(now) - $t0" | bc)
if [ $code = 1 ] && grep -q "waiting for rank 1 (pid [0-9]*), which has exited without joining" \
   "$TMP/early" && [ "$(echo "$dt < 10" | bc)" = 1 ]; then
  ok "a rank gone before its comm.init: the other stops in ${dt%????} s naming it"
else bad "a rank gone before its comm.init (exit $code, ${dt%????} s)" "$TMP/early"; fi

echo "$passed passed, $failed failed"
[ $failed -eq 0 ]
