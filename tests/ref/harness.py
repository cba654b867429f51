"""harness.py — what the PyTorch reference tests share: the checks, which
count passes and failures, and the runner, which ends with "N passed, N
failed". A test file registers its tests with @test and calls run(header).
"""
import traceback

import numpy as np
import torch

import lz

TOL = 1e-5
passed = 0
failed = 0
TESTS = []


def test(fn):
    TESTS.append(fn)
    return fn


def rel_err(ours, ref):
    """max|ours - ref| / max|ref|: the worst difference against the largest magnitude."""
    a = np.asarray(ours, dtype=np.float64)
    b = ref.detach().double().numpy() if isinstance(ref, torch.Tensor) else np.asarray(
        ref, dtype=np.float64)
    if a.shape != b.shape:
        a = a.reshape(b.shape)
    scale = max(float(np.max(np.abs(b))) if b.size else 0.0, 1e-30)
    return float(np.max(np.abs(a - b))) / scale if b.size else 0.0


def check(name, ours, ref, tol=TOL):
    global passed, failed
    err = rel_err(ours, ref)
    ok = err <= tol  # False for NaN
    if ok:
        passed += 1
        print(f"  ok   {name:58s} err {err:.2e}")
    else:
        failed += 1
        print(f"  FAIL {name:58s} err {err:.2e} > {tol:.0e}")
    return ok


def check_true(name, cond, detail=""):
    global passed, failed
    if cond:
        passed += 1
        print(f"  ok   {name}")
    else:
        failed += 1
        print(f"  FAIL {name} {detail}")


def check_equal(name, ours, ref):
    """Bitwise equality of two arrays (a torch tensor is read as numpy)."""
    ref = ref.numpy() if isinstance(ref, torch.Tensor) else ref
    same = np.array_equal(ours, ref)
    detail = ""
    if not same:
        bad = np.flatnonzero(ours != ref)
        i = bad[0]
        detail = f"({bad.size} elements differ; first [{i}]: {ours[i]!r} vs {ref[i]!r})"
    check_true(f"{name}: bitwise", same, detail)


def randn_with(rng):
    """randn(*shape, scale=1, shift=0): fp32 normal samples drawn from rng."""
    def randn(*shape, scale=1.0, shift=0.0):
        return (rng.standard_normal(shape) * scale + shift).astype(np.float32)
    return randn


def zeros(*shape):
    return np.zeros(shape, dtype=np.float32)


def tt(a, grad=False):
    """A torch tensor holding a copy of numpy array a."""
    return torch.from_numpy(np.array(a, copy=True)).requires_grad_(grad)


def run(header):
    """Runs the registered tests on 2 threads; an exception is one failure.
    Returns the exit status."""
    global failed
    lz.call("lz_threads_set", 2)
    print(header)
    for fn in TESTS:
        print(f"{fn.__name__}:")
        try:
            fn()
        except Exception as e:  # a missing kernel or a bad status: one failure
            failed += 1
            msg = str(e) if isinstance(e, lz.LzError) else traceback.format_exc()
            print(f"  FAIL {fn.__name__}: {msg}")
        finally:
            lz.release()
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0
