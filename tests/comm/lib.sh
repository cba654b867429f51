# lib.sh — what the multi-rank test scripts share (sourced from the
# repository root): OpenMPI allowed as root, a scratch folder $TMP, the
# pass/fail counters and their lines, a clock, and the /dev/shm entries of
# the job of launcher pid $1.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
passed=0
failed=0
ok() { passed=$((passed + 1)); echo "ok   $1"; }
bad() { failed=$((failed + 1)); echo "FAIL $1"; [ -n "$2" ] && sed 's/^/    /' "$2" | tail -20; }
now() { date +%s.%N; }
shm_left() { ls /dev/shm 2>/dev/null | grep -c "^luazero-$1-" ; }
