#!/usr/bin/env bash
# run — runs a program of luazero's GPU kit (tools/gpu-kit copies this file
# into the kit as `run`) on a machine that has glibc, the C++ runtime and
# CUDA 13, and nothing else of luazero's. On first use it unpacks kit.tar.gz
# (into $LZ_KIT_ROOT, default /tmp/luazero-gpu-kit.<the kit's id>); each use
# checks that the machine's glibc is not older than the kit's, and sets
#   LD_LIBRARY_PATH  the kit's libraries, then the CUDA toolkit's ($CUDA_HOME,
#                    default /usr/local/cuda), then each folder of the Python
#                    packages' nvidia/*/lib (NCCL) that holds a library the
#                    kit's programs load and nothing before it does; the kit's
#                    C++ runtime only where the machine has none; then the
#                    LD_LIBRARY_PATH it was given
#   LUA_CPATH        the kit's cjson first
#   LUAZERO_HOME     the checkout above the kit folder (its lua/, models/, ...)
# Usage:
#   run luazero ARGS...        the kit's luazero (also lz_tests, lz_cuda_tests)
#   run --check                where every library of every program comes from;
#                              exit 1 with one line naming each one not found
#   run --env                  the environment it sets, as shell assignments
#   run COMMAND ARGS...        any command in that environment
set -euo pipefail
kit=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
say() { echo "gpu-kit: $*" >&2; }
field() { sed -n "s/^$1: //p" "$kit/KIT"; }

[ -f "$kit/kit.tar.gz" ] && [ -f "$kit/KIT" ] ||
  { say "$kit has no kit.tar.gz or KIT: make the kit with tools/gpu-kit"; exit 1; }

want=$(field glibc)
have=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
[ -n "$have" ] || have=$(ldd --version 2>/dev/null | awk 'NR == 1 {print $NF}')
if [ -z "$have" ]; then
  say "cannot tell this machine's glibc (no getconf, no ldd): the kit needs $want or newer"
  exit 1
fi
if [ "$(printf '%s\n%s\n' "$want" "$have" | sort -V | head -n 1)" != "$want" ]; then
  say "this machine's glibc is $have, older than the $want the kit was built against;" \
      "build the kit on a machine with glibc $have or older, or build luazero here"
  exit 1
fi

root=${LZ_KIT_ROOT:-${TMPDIR:-/tmp}/luazero-gpu-kit.$(field id)}
if [ ! -f "$root/.unpacked" ]; then
  rm -rf "$root.part"
  mkdir -p "$root.part"
  if ! tar -C "$root.part" -xzf "$kit/kit.tar.gz" 2>/dev/null; then
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
      "$kit/kit.tar.gz" "$root.part" ||
      { say "cannot unpack $kit/kit.tar.gz (neither tar -z nor python3 worked)"; exit 1; }
  fi
  rm -rf "$root"
  mv "$root.part" "$root"
  touch "$root/.unpacked"
fi

lister() { # ldd, or the loader's --list where ldd is missing
  if command -v ldd >/dev/null 2>&1; then ldd "$1"
  else /lib64/ld-linux-x86-64.so.2 --list "$1"; fi
}
programs=$(sed -n 's/^programs: //p' "$root/KIT")
missing() { # the sonames no folder of LD_LIBRARY_PATH=$1 gives, as "name by program"
  local p
  for p in $programs; do
    LD_LIBRARY_PATH=$1 lister "$root/$p" 2>/dev/null | awk -v p="$p" '$3 == "not" {print $1, p}' || true
  done | sort -u -k1,1
}
python_lib_dirs() { # nvidia/*/lib of every Python package folder (NCCL's wheel among them)
  command -v python3 >/dev/null 2>&1 || return 0
  python3 -c '
import glob, os, sys
for p in sys.path:
    for d in sorted(glob.glob(os.path.join(p, "nvidia", "*", "lib"))):
        print(d)' 2>/dev/null || true
}

# The folders found here depend only on the machine: kept beside the unpacked kit.
if [ "${1:-}" = --check ] || [ ! -f "$root/libpath" ]; then
  cuda=${CUDA_HOME:-/usr/local/cuda}
  path="$root/lib"
  for d in "$cuda/lib64" "$cuda/targets/x86_64-linux/lib"; do
    if [ -d "$d" ]; then path="$path:$d"; break; fi
  done
  [ -n "${LD_LIBRARY_PATH:-}" ] && given=":$LD_LIBRARY_PATH" || given=
  pydirs=$(python_lib_dirs)
  for _ in 1 2 3; do # a library found there may load another one from there
    added=
    while read -r name _; do
      [ -n "$name" ] || continue
      for d in $pydirs; do
        if [ -e "$d/$name" ]; then
          case ":$path:" in *":$d:"*) ;; *) path="$path:$d"; added=1 ;; esac
          break
        fi
      done
    done <<< "$(missing "$path$given")"
    [ -n "$added" ] || break
  done
  if missing "$path$given" | grep -qE '^lib(stdc\+\+|gcc_s)\.'; then path="$path:$root/lib-cxx"; fi
  echo "$path" > "$root/libpath"
fi
path=$(cat "$root/libpath")
export LD_LIBRARY_PATH="$path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LUA_CPATH="$root/lua/?.so;${LUA_CPATH:-;}"
if [ -z "${LUAZERO_HOME:-}" ]; then
  [ -f "$kit/../lua/luazero/init.lua" ] ||
    { say "the kit's luazero needs the checkout's lua/: set LUAZERO_HOME to the checkout"; exit 1; }
  LUAZERO_HOME=$(cd "$kit/.." && pwd)
fi
export LUAZERO_HOME
# The checkout's Lua binds the C API through cdef.lua: a kit built from
# another API would crash or misread, so it is refused (a kit from before
# the field was recorded is taken as it is).
api=$(field api)
if [ -n "$api" ] && [ -f "$LUAZERO_HOME/core/luazero.h" ] && [ -f "$LUAZERO_HOME/lua/luazero/cdef.lua" ]; then
  here=$(cat "$LUAZERO_HOME/core/luazero.h" "$LUAZERO_HOME/lua/luazero/cdef.lua" | sha256sum | cut -c1-16)
  [ "$here" = "$api" ] ||
    { say "the kit's library was built from another C API ($(field built)) than $LUAZERO_HOME's core/luazero.h: make the kit again from this checkout (tools/gpu-kit)"; exit 1; }
fi

case "${1:-}" in
  --env)
    printf 'export LD_LIBRARY_PATH=%q LUA_CPATH=%q LUAZERO_HOME=%q\n' \
      "$LD_LIBRARY_PATH" "$LUA_CPATH" "$LUAZERO_HOME"
    exit 0 ;;
  --check)
    echo "kit $(sed -n 's/^id: //p' "$root/KIT") in $root; glibc $have (kit: $want)"
    echo "library path: $path"
    status=0
    for p in $programs; do
      bad=$(lister "$root/$p" 2>&1 | awk '$3 == "not" {print $1}' | tr '\n' ' ')
      if [ -n "$bad" ]; then
        echo "missing: ${bad% } (needed by $p): not in the kit, $cuda/lib64 or a Python" \
             "package's nvidia/*/lib; install it or set CUDA_HOME"
        status=1
      else
        echo "ok: $p"
      fi
    done
    # Where the libraries that are not the kit's come from.
    for p in $programs; do lister "$root/$p" 2>/dev/null; done |
      awk '$2 == "=>" && $3 != "not" && index($3, "'"$root"'/") != 1 {print "  " $1 " => " $3}' | sort -u
    exit $status ;;
  "") sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
if [ -x "$root/bin/$1" ]; then
  prog="$root/bin/$1"
  shift
  exec "$prog" "$@"
fi
exec "$@"
