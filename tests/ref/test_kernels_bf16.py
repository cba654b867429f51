"""test_kernels_bf16.py — bf16 GEMMs on both of the ways luazero runs them
(LZ_BF16_MATMUL=native: oneDNN's bf16 matmul; f32: inputs widened to f32 and
multiplied by sgemm) against PyTorch in fp32 on the same bf16-rounded inputs.
Both accumulate in fp32 and bf16 products are exact in fp32, so test_kernels'
tolerance (1e-5 relative to the largest magnitude) holds for each. Each path
runs in its own process, since a process chooses its path once.
Run with /usr/bin/python3 (Debian's python3-torch).
"""
import ctypes
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
PATHS = ("native", "f32")


def parent():
    passed = failed = 0
    for path in PATHS:
        env = dict(os.environ, LZ_BF16_MATMUL=path)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        print(f"LZ_BF16_MATMUL={path}:")
        sys.stdout.write(proc.stdout)
        found = re.findall(r"^(\d+) passed, (\d+) failed\s*$", proc.stdout, re.M)
        p, f = map(int, found[-1]) if found else (0, 1)
        passed, failed = passed + p, failed + (f or (1 if proc.returncode else 0))
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


def child():
    import torch

    import harness
    import lz
    import test_kernels as tk  # its linear_case, randn and wrap; not its tests
    from harness import check, check_true, run, test, tt, zeros
    harness.TESTS.clear()
    randn, W = tk.randn, tk.W
    want = os.environ["LZ_BF16_MATMUL"]

    @test
    def path_is_the_one_asked_for():
        f = lz.lib.lz_bf16_matmul_path
        f.argtypes, f.restype = [ctypes.POINTER(ctypes.c_char_p)], ctypes.c_int
        what = ctypes.c_char_p()
        check_true("lz_bf16_matmul_path returns LZ_OK", f(ctypes.byref(what)) == 0)
        said = (what.value or b"").decode()
        check_true(f"lz_bf16_matmul_path says {said!r}", said.startswith(want + " "))

    @test
    def matmul_bf16_transposes_and_scales():
        M, N, K = 72, 56, 136
        for ta in (0, 1):
            for tb in (0, 1):
                ab, af = lz.bf16_round(randn(*((K, M) if ta else (M, K))))
                bb, bf = lz.bf16_round(randn(*((N, K) if tb else (K, N))))
                c0 = randn(M, N)
                c = c0.copy()
                lz.call("lz_matmul", W(c), W(ab, lz.BF16), W(bb, lz.BF16), ta, tb, 0.5, 0.25)
                a_ = tt(af).T if ta else tt(af)
                b_ = tt(bf).T if tb else tt(bf)
                check(f"matmul bf16 [{M}x{K}]x[{K}x{N}] ta={ta} tb={tb} alpha=.5 beta=.25", c,
                      0.5 * (a_ @ b_) + 0.25 * tt(c0))

    @test
    def matmul_bf16_batched():
        B, M, N, K = 6, 48, 40, 32
        ab, af = lz.bf16_round(randn(B, M, K))
        bb, bf = lz.bf16_round(randn(B, N, K))
        c = zeros(B, M, N)
        lz.call("lz_matmul", W(c), W(ab, lz.BF16), W(bb, lz.BF16), 0, 1, 1.0, 0.0)
        check(f"matmul bf16 batched [{B},{M},{K}]x[{B},{N},{K}]^T", c,
              torch.bmm(tt(af), tt(bf).transpose(1, 2)))
        sb, sf = lz.bf16_round(randn(K, N))  # one b shared by every batch
        lz.call("lz_matmul", W(c), W(ab, lz.BF16), W(sb, lz.BF16), 0, 0, 1.0, 0.0)
        check(f"matmul bf16 batched [{B},{M},{K}]x[{K},{N}] shared b", c, tt(af) @ tt(sf))

    @test
    def linear_bf16_forward_backward():
        tk.linear_case(2, 32, 128, 384, bf16=True)
        tk.linear_case(1, 17, 96, 50, bf16=True)  # odd rows and columns

    return run(f"test_kernels_bf16: {lz.LIB_PATH}, LZ_BF16_MATMUL={want}, torch "
               f"{torch.__version__}")


if __name__ == "__main__":
    sys.exit(child() if sys.argv[1:] == ["--child"] else parent())
