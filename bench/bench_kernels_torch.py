"""bench_kernels_torch.py — PyTorch's side of bench/bench-kernels.

Times forward+backward of attention (causal, matmul + mask + softmax, on
GPT-2's qkv layout), layernorm, GELU (tanh) and cross-entropy in PyTorch on
the shapes bench/bench_kernels.c uses, and prints "OP <op> <shape> <ms>"
lines (median milliseconds) for the wrapper to join with ours.
    /usr/bin/python3 bench/bench_kernels_torch.py [--threads N]
"""
import argparse
import math
import time

import torch
import torch.nn.functional as F


def time_ms(step, lo):
    """Median of fwd+bwd runs after one warm-up: at least `lo`, about 2 s, at most 50."""
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    reps = max(lo, min(50, int(2.0 / first) if first > 0 else 50))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    n = len(ts)
    return 1e3 * (ts[n // 2] if n % 2 else 0.5 * (ts[n // 2 - 1] + ts[n // 2]))


def attention(qkv, n_head):
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head
    q, k, v = qkv.split(C, dim=2)
    q = q.view(B, T, n_head, hs).transpose(1, 2)
    k = k.view(B, T, n_head, hs).transpose(1, 2)
    v = v.view(B, T, n_head, hs).transpose(1, 2)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)
    att = F.softmax(att.masked_fill(mask, float("-inf")), dim=-1)
    return (att @ v).transpose(1, 2).contiguous().view(B, T, C)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"# PyTorch {torch.__version__}, {torch.get_num_threads()} threads")
    B, C, NH = 4, 768, 12

    for T in (256, 1024):
        qkv = torch.randn(B, T, 3 * C, requires_grad=True)
        dout = torch.randn(B, T, C)

        def step():
            qkv.grad = None
            attention(qkv, NH).backward(dout)
        print(f"OP attention B={B},T={T},C={C},NH={NH} {time_ms(step, 5):.3f}", flush=True)

    for T in (256, 1024):
        x = (torch.randn(B, T, C) * 2).requires_grad_()
        w = torch.randn(C, requires_grad=True)
        b = torch.randn(C, requires_grad=True)
        dy = torch.randn(B, T, C)

        def step():
            x.grad = w.grad = b.grad = None
            F.layer_norm(x, (C,), w, b, 1e-5).backward(dy)
        print(f"OP layernorm B={B},T={T},C={C} {time_ms(step, 10):.3f}", flush=True)

    for T in (256, 1024):
        x = (torch.randn(B, T, 4 * C) * 3).requires_grad_()
        dy = torch.randn(B, T, 4 * C)

        def step():
            x.grad = None
            F.gelu(x, approximate="tanh").backward(dy)
        print(f"OP gelu B={B},T={T},C={4 * C} {time_ms(step, 10):.3f}", flush=True)

    T, V = 256, 50257
    logits = (torch.randn(B, T, V) * 4).requires_grad_()
    targets = torch.randint(0, V, (B, T))

    def step():
        logits.grad = None
        F.cross_entropy(logits.view(-1, V), targets.view(-1)).backward()
    print(f"OP cross_entropy B={B},T={T},V={V} {time_ms(step, 5):.3f}", flush=True)


if __name__ == "__main__":
    main()
