"""checks.py — the named checks of a reference test, each printed "ok" or
"FAIL" with the suite's prefix, and the closing "N passed, N failed" line
tests/ref/run.py reads (summary() prints it and gives the exit code).

    check = Checks("generate")
    check("prompt0_greedy_ids", got == want, "first difference at 3")
    return check.summary()
"""


class Checks:
    def __init__(self, prefix):
        self.prefix, self.passed, self.failed = prefix, 0, 0

    def __call__(self, name, ok, detail=""):
        print(("ok   " if ok else "FAIL ") + f"{self.prefix}.{name} {detail}", flush=True)
        if ok:
            self.passed += 1
        else:
            self.failed += 1

    def summary(self):
        print(f"{self.passed} passed, {self.failed} failed")
        return 1 if self.failed else 0
