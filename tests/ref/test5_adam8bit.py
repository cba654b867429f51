"""test5_adam8bit.py — luazero's fused 8-bit AdamW (lz_adamw8bit_step) against
bitsandbytes 0.50.2's AdamW8bit and Adam8bit themselves, on the CPU over
torch 2.15.

bitsandbytes' CPU step dequantises m (signed dynamic map) and v (unsigned
map), one absmax per 256 elements, updates in fp32 torch ops and requantises
with its C quantiser (whose index is not always the nearest map entry:
core/optim/quant8.c); tensors under min_8bit_size (4096) keep fp32 states
and a differently arranged update. Both sides start from the same numpy
arrays and each carries its own states; each case runs 10 steps and
compares, after every step, bit for bit, the parameters, the uint8 states
(state1, state2) and the absmaxes (or the fp32 states of a small tensor),
and the map values once. Tensors include zeros (a block of zero
gradients: 0/0 in the quantiser), denormals and huge values (v overflows to
inf in a block: inf/inf), sizes with a partial last block, and gradients of
every magnitude.

One substitution, stated here and checked below: torch 2.15's CPU sqrt is
not correctly rounded on tensors of more than 18 elements (its vector code is
off by one ulp on about 17% of inputs; small tensors and float64 are exact),
while luazero's is IEEE sqrt. The test gives bitsandbytes' update an exact
fp32 sqrt (torch's own, in float64, rounded once); every other operation, and
the quantiser, are bitsandbytes'.

Runs with the second reference environment's python (tests/ref/run.py does
that, or /root/.cache/luazero/ref5-venv/bin/python tests/ref/test5_adam8bit.py);
without bitsandbytes prints a skip line and "0 passed, 0 failed".
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402
import torch  # noqa: E402

try:
    import bitsandbytes as bnb  # noqa: E402
    import bitsandbytes.functional as bnbF  # noqa: E402
except ImportError as e:  # the first environment, or a venv without it
    print(f"skip: test5_adam8bit: cannot import bitsandbytes ({e}); run with "
          "the reference environment 5's python")
    print("0 passed, 0 failed")
    sys.exit(0)

import lz  # noqa: E402
from harness import check_equal, check_true, run, test  # noqa: E402

torch.set_num_threads(2)
rng = np.random.default_rng(20251205)
STEPS = 10
BLOCK = 256

_torch_sqrt = torch.Tensor.sqrt


def exact_sqrt(self):
    if self.dtype == torch.float32:
        return _torch_sqrt(self.double()).float()
    return _torch_sqrt(self)


def f32(x):
    return float(np.float32(x))


def bits(a):
    """An array's bytes as unsigned integers, so NaNs compare by their bits."""
    a = np.ascontiguousarray(a)
    return a.view({4: np.uint32, 1: np.uint8}[a.itemsize])


@test
def bitwise_check_can_fail():
    """One state byte off is caught."""
    a = rng.integers(0, 256, 300).astype(np.uint8)
    b = a.copy()
    b[7] ^= 1
    check_true("one byte apart is not equal", not np.array_equal(a, b))


@test
def torch_sqrt_needs_the_substitution():
    """The reason for exact_sqrt: torch's fp32 sqrt differs from IEEE's, the float64 one does not."""
    x = np.abs(rng.standard_normal(100000)).astype(np.float32)
    ieee = np.sqrt(x)
    ours = exact_sqrt(torch.from_numpy(x)).numpy()
    check_equal("float64 sqrt rounded once = IEEE fp32 sqrt", ours, ieee)
    theirs = _torch_sqrt(torch.from_numpy(x)).numpy()
    print(f"       torch 2.15 fp32 sqrt differs from IEEE on {np.sum(theirs != ieee)} of "
          f"{x.size} elements")


@test
def maps_are_bitsandbytes():
    for signed in (True, False):
        ours = np.ctypeslib.as_array(lz.lib.lz_adamw8bit_map(int(signed)), shape=(256,)).copy()
        check_equal(f"{'signed' if signed else 'unsigned'} dynamic map",
                    bits(ours), bits(bnbF.create_dynamic_map(signed=signed).numpy()))


lz.lib.lz_adamw8bit_map.restype = lz.ctypes.POINTER(lz.ctypes.c_float)
lz.lib.lz_adamw8bit_map.argtypes = [lz.ctypes.c_int]


def tensors(n):
    """A parameter and STEPS gradients with the awkward values."""
    p = (rng.standard_normal(n) * 0.05).astype(np.float32)
    p[:3] = 0.0
    p[3:6] = np.float32(1e-40)          # denormal parameters
    p[6] = np.float32(3e38)             # huge
    grads = []
    for s in range(STEPS):
        scale = np.float32(10.0) ** rng.integers(-8, 3)
        g = (rng.standard_normal(n) * scale).astype(np.float32)
        g[:2] = 0.0
        g[8:12] = np.float32(1e-41) * (s + 1)   # denormal gradients
        if n >= 4 * BLOCK:
            g[BLOCK:2 * BLOCK] = 0.0            # a block of zeros: 0/0 in the quantiser
            g[2 * BLOCK + 5] = np.float32(3e20) if s == 3 else g[2 * BLOCK + 5]  # v = inf
            g[3 * BLOCK:3 * BLOCK + 9] *= np.float32(1e6)   # one block of huge outliers
        grads.append(g)
    return p, grads


def run_case(cls, n, lr, betas, eps, wd, tag):
    lr, b1, b2, eps, wd = (f32(x) for x in (lr, betas[0], betas[1], eps, wd))
    p0, grads = tensors(n)
    pt = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = cls([pt], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    eight = n >= 4096
    p = p0.copy()
    if eight:
        m, v = np.zeros(n, np.uint8), np.zeros(n, np.uint8)
        blocks = -(-n // BLOCK)
        am, av = np.zeros(blocks, np.float32), np.zeros(blocks, np.float32)
    else:
        m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
        am = av = None
    args = lz.AdamwArgs(lr, b1, b2, eps, wd, 1.0, 0)
    torch.Tensor.sqrt = exact_sqrt
    try:
        for s, g in enumerate(grads):
            pt.grad = torch.from_numpy(g.copy())
            opt.step()
            args.step = s + 1
            lz.call("lz_adamw8bit_step", lz.wrap(p), lz.wrap(g), lz.wrap(m), lz.wrap(v),
                    lz.wrap(am), lz.wrap(av), None, lz.ctypes.byref(args))
            st = opt.state[pt]
            check_equal(f"{tag}: step {s + 1} param", bits(p), bits(pt.detach().numpy()))
            check_equal(f"{tag}: step {s + 1} state1 (m)", bits(m), bits(st["state1"].numpy()))
            check_equal(f"{tag}: step {s + 1} state2 (v)", bits(v), bits(st["state2"].numpy()))
            if eight:
                check_equal(f"{tag}: step {s + 1} absmax1", bits(am), bits(st["absmax1"].numpy()))
                check_equal(f"{tag}: step {s + 1} absmax2", bits(av), bits(st["absmax2"].numpy()))
    finally:
        torch.Tensor.sqrt = _torch_sqrt
    st = opt.state[pt]
    check_true(f"{tag}: bitsandbytes kept {'uint8' if eight else 'fp32'} states",
               st["state1"].dtype == (torch.uint8 if eight else torch.float32))
    moved = np.abs(p[20:] - p0[20:])
    check_true(f"{tag}: the step moves parameters", float(np.nanmax(moved)) > 0.0)
    lz.release()


# (class, n, lr, betas, eps, weight_decay)
CASES = [
    (bnb.optim.AdamW8bit, 4096, 1e-3, (0.9, 0.999), 1e-8, 1e-2),     # AdamW8bit's defaults
    (bnb.optim.AdamW8bit, 100003, 3e-4, (0.9, 0.95), 1e-8, 0.1),     # a partial last block
    (bnb.optim.Adam8bit, 5000, 1e-2, (0.8, 0.99), 1e-6, 0.0),        # Adam8bit, no decay
    (bnb.optim.AdamW8bit, 4095, 1e-3, (0.9, 0.999), 1e-8, 1e-2),     # under min_8bit_size: fp32
    (bnb.optim.AdamW8bit, 300, 2e-3, (0.9, 0.98), 1e-8, 0.05),       # fp32, small
]


def case_test(c):
    cls, n, lr, betas, eps, wd = c

    def fn():
        run_case(cls, n, lr, betas, eps, wd,
                 f"{cls.__name__}[{n}] lr={lr:g} betas={betas} eps={eps:g} wd={wd:g}")
    fn.__name__ = f"{cls.__name__}_{n}"
    return test(fn)


for _c in CASES:
    case_test(_c)


def main():
    return run(f"test5_adam8bit: {lz.LIB_PATH}, torch {torch.__version__}, bitsandbytes "
               f"{bnb.__version__}, tolerance: bitwise")


if __name__ == "__main__":
    sys.exit(main())
