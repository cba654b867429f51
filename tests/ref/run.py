"""run.py — runs every tests/ref/test_*.py (the PyTorch reference tests).

Each file runs as its own process and ends with an "N passed, N failed"
line. test_*.py files run with this interpreter (Debian's PyTorch 1.13 and
build/ref-venv's transformers 4.40); test5_*.py files, for what 4.40 lacks,
with the second reference environment's own python (torch 2.15,
transformers 5.23: refenv.VENV5, which tools/setup fills), each skipping with
one line where it is absent; this prints each file's output, then the sums. A
file that exits non-zero without failures, or prints no summary, counts as one
failure. Run with Debian's /usr/bin/python3 (python3-torch):
    /usr/bin/python3 tests/ref/run.py [test_x.py ...]
LZ_LIB picks the library (default build/lib/libluazero.so). The files run
LZ_REF_JOBS at a time (default: the CPU count, at most 2; most of a file's
time is importing torch and transformers), their outputs printed whole and in
order, each with its wall time.
"""
import concurrent.futures
import glob
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed\s*$", re.M)


def main(argv):
    try:
        import numpy  # noqa: F401
        import torch  # noqa: F401
    except ImportError as e:
        print(f"ref: {sys.executable} cannot import {e.name}: install python3-torch and "
              "python3-numpy (apt-get install python3-torch python3-numpy, or tools/setup) "
              "and run with /usr/bin/python3")
        print("0 passed, 1 failed")
        return 1
    sys.path.insert(0, HERE)
    import refenv
    files = [os.path.join(HERE, f) for f in argv] if argv else sorted(
        glob.glob(os.path.join(HERE, "test_*.py")) + glob.glob(os.path.join(HERE, "test5_*.py")))
    total_pass = total_fail = 0

    def run(path):
        name = os.path.basename(path)
        python = sys.executable
        if name.startswith("test5_"):
            python, why = refenv.python5()
            if python is None:
                return f"skip: {name}: {why}\n", None, 0.0
        start = time.monotonic()
        try:
            proc = subprocess.run([python, path], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, errors="replace",
                                  cwd=HERE)
        except OSError as e:
            return f"== {name}: cannot run {python}: {e}\n", 1, time.monotonic() - start
        return proc.stdout, proc.returncode, time.monotonic() - start

    jobs = int(os.environ.get("LZ_REF_JOBS") or min(2, os.cpu_count() or 1))
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs))
    try:
        for path, done in zip(files, [pool.submit(run, path) for path in files]):
            name = os.path.basename(path)
            print(f"== {name}", flush=True)
            out, rc, took = done.result()
            sys.stdout.write(out)
            if rc is None:
                continue
            print(f"== {name}: {took:.1f} s", flush=True)
            found = SUMMARY.findall(out)
            if not found:
                print(f"== {name}: exit {rc} without a summary line: 1 failure")
                total_fail += 1
                continue
            p, f = map(int, found[-1])
            if rc != 0 and f == 0:
                print(f"== {name}: exit {rc} with no failed check: 1 failure")
                f = 1
            total_pass += p
            total_fail += f
    finally:
        # Ctrl-C or an error here: the files not started yet are not run
        pool.shutdown(wait=True, cancel_futures=True)
    if not files:
        print("ref: no tests/ref/test_*.py found")
        total_fail += 1
    print(f"{total_pass} passed, {total_fail} failed")
    return 1 if total_fail else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
