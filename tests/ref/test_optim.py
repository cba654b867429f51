"""test_optim.py — luazero's fused Lion step against Lion written in PyTorch.

The reference is the update of lion-pytorch and DeepSpeed's FusedLion in fp32
torch ops, with g = grad * grad_scale:

    c = b1 m + (1 - b1) g;  p = p (1 - lr wd) - lr sign(c);  m = b2 m + (1 - b2) g

Tolerance: exact. The kernel rounds every fp32 product and sum on its own
(no fused multiply-add), which is what these torch ops do, and its scalars
are fp32 like torch's: so both give the same bits, and any difference is a
defect. (A tolerance would not do anyway: sign() turns a last-place
difference of c into a step of 2 lr.) Both sides read the same numpy arrays
(luazero through lz_tensor_wrap). Run with /usr/bin/python3.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import refenv  # noqa: E402

refenv.require_torch()
import numpy as np  # noqa: E402
import torch  # noqa: E402
import lz  # noqa: E402
from harness import check_equal, check_true, run, test  # noqa: E402

torch.set_num_threads(2)
rng = np.random.default_rng(20230213)


@test
def bitwise_check_can_fail():
    """One element one ulp off is caught: the comparison is exact."""
    a = rng.standard_normal(33).astype(np.float32)
    b = a.copy()
    b[17] = np.nextafter(b[17], np.float32(np.inf))
    check_true("an array equals itself", np.array_equal(a, a.copy()))
    check_true("one ulp apart is not equal", not np.array_equal(a, b))


def f32(x):
    """x as the fp32 the kernel's args hold, back as a Python float."""
    return float(np.float32(x))


def torch_lion(p, m, grad, lr, b1, b2, wd, gs):
    """One step in place; torch turns each Python scalar into an fp32 operand."""
    g = grad * gs
    c = m * b1 + g * (1.0 - b1)
    p.copy_(p * (1.0 - lr * wd) - torch.sign(c) * lr)
    m.copy_(m * b2 + g * (1.0 - b2))


# (lr, b1, b2, weight_decay, grad_scale)
CASES = [
    (1e-4, 0.9, 0.99, 0.0, 1.0),     # FusedLion's defaults
    (3e-3, 0.9, 0.99, 0.1, 0.5),     # decay, clipping
    (1e-2, 0.95, 0.98, 1.0, 1 / 1024),  # a loss scale undone
]
SIZES = [1, 15, 17, 1001, 100003]  # odd tails; 100003 spans threads


def lion_case(n, case):
    lr, b1, b2, wd, gs = (f32(x) for x in case)
    p0 = rng.standard_normal(n).astype(np.float32) * np.float32(0.02)
    p0[:2] = 0.0  # a parameter at zero stays there while c = 0
    grads = [(rng.standard_normal(n) * 0.1 / gs).astype(np.float32) for _ in range(5)]
    for g in grads:
        g[:4] = 0.0  # c = 0 at step 1: sign(0) = 0, only decay
    p, m = p0.copy(), np.zeros(n, dtype=np.float32)
    work32 = np.zeros(n, dtype=np.float32)
    work16 = np.zeros(n, dtype=np.uint16)
    workh = np.zeros(n, dtype=np.float16)
    works = [lz.wrap(work32), lz.wrap(work16, lz.BF16), lz.wrap(workh), None]
    pt, mt = torch.from_numpy(p0.copy()), torch.zeros(n)
    args = lz.LionArgs(lr, b1, b2, wd, gs)
    for step, g in enumerate(grads):
        # Steps 1-4 write f32, bf16, f16, none; step 5 bf16 again.
        w = works[step % 4] if step < 4 else works[1]
        lz.call("lz_lion_step", lz.wrap(p), lz.wrap(g), lz.wrap(m), w, lz.ctypes.byref(args))
        torch_lion(pt, mt, torch.from_numpy(g), lr, b1, b2, wd, gs)
    tag = f"lion [{n}] 5 steps lr={case[0]:g} betas=({case[1]}, {case[2]}) wd={case[3]:g} " \
          f"grad_scale={case[4]:g}"
    check_equal(f"{tag} param", p, pt)
    check_equal(f"{tag} m", m, mt)
    if n > 4:
        moved = np.abs(p[4:] - p0[4:] * np.float32(1 - lr * wd) ** 5)
        check_true(f"{tag} each step moves a parameter by lr", float(np.max(moved)) > 2 * lr)
    want16 = pt.bfloat16().view(torch.int16).numpy().view(np.uint16)
    check_equal(f"{tag} bf16 working copy = torch's bf16(param)", work16, want16)
    # Step 5 wrote bf16; one more step to each of the others.
    for w, copy, name in ((works[0], work32, "f32 working copy = param"),
                          (works[2], workh, "f16 working copy = f16(param)")):
        lz.call("lz_lion_step", lz.wrap(p), lz.wrap(grads[0]), lz.wrap(m), w,
                lz.ctypes.byref(args))
        check_equal(f"{tag} {name}", copy, p.astype(copy.dtype))

def lion_sizes(n):
    def fn():
        for case in CASES:
            lion_case(n, case)
            lz.release()
    fn.__name__ = f"lion_{n}"
    return test(fn)


for _n in SIZES:
    lion_sizes(_n)


def main():
    return run(f"test_optim: {lz.LIB_PATH}, torch {torch.__version__}, tolerance: bitwise")

if __name__ == "__main__":
    sys.exit(main())
