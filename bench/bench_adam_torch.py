"""bench_adam_torch.py — the PyTorch side of bench/bench-adam: torch.optim.AdamW
(its default implementation for CPU tensors in this version) over N fp32
parameters, alone and followed by a bf16 working copy (p.to(bfloat16), what a
mixed-precision loop does after the step). Prints, medians of --reps:
  R torch none <params per second>
  R torch bf16 <params per second>
Run with Debian's /usr/bin/python3 (python3-torch)."""
import argparse
import statistics
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=50_000_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.rand(a.n, generator=g) - 0.5)
    p.grad = torch.rand(a.n, generator=g) * 1e-2
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    working = torch.empty(a.n, dtype=torch.bfloat16)
    print(f"# torch {torch.__version__}, n {a.n}, threads {torch.get_num_threads()}, "
          f"reps {a.reps} (medians)")
    for name in ("none", "bf16"):
        times = []
        for r in range(a.reps + 1):  # the first is a warm-up (state allocation)
            t0 = time.perf_counter()
            with torch.no_grad():
                opt.step()
                if name == "bf16":
                    working.copy_(p)
            if r:
                times.append(time.perf_counter() - t0)
        print(f"R torch {name} {a.n / statistics.median(times):.6e}")


if __name__ == "__main__":
    main()
