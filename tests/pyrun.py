"""tests/pyrun.py — the runner the Python end-to-end suites share: every
test_* function of a module, in name order, an optional name filter, one
"ok"/"FAIL" line each, then "N passed, N failed"; exit status 1 on a failure."""
import sys
import time
import traceback


def run_tests(namespace, argv=None):
    argv = sys.argv[1:] if argv is None else argv
    only = argv[0] if argv else None
    tests = [(k, v) for k, v in sorted(namespace.items()) if k.startswith("test_")]
    passed = failed = 0
    for name, fn in tests:
        if only and only not in name:
            continue
        t0 = time.time()
        try:
            fn()
            passed += 1
            print("ok   %-64s %6.2f s" % (name, time.time() - t0), flush=True)
        except Exception:
            failed += 1
            print("FAIL %s\n    %s" % (name, traceback.format_exc().replace("\n", "\n    ")),
                  flush=True)
    print("%d passed, %d failed" % (passed, failed))
    sys.exit(1 if failed else 0)
