"""bench_train_torch.py — the PyTorch side of bench/bench_train.lua: GPT-2
training steps (forward, backward, clipping, AdamW) in fp32 on the CPU, with
the model of tests/ref/test_gpt2.py. Prints "torch_tokens_per_s X".
    /usr/bin/python3 bench/bench_train_torch.py --micro-batch 4 --seq-len 64
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests", "ref"))
from test_gpt2 import GPT  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    for name, default in [("n-layer", 12), ("n-head", 12), ("n-embd", 768), ("context", 1024),
                          ("vocab", 50257), ("micro-batch", 4), ("seq-len", 64), ("steps", 2),
                          ("threads", 2)]:
        p.add_argument("--" + name, type=int, default=default)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    padded = (a.vocab + 63) // 64 * 64
    model = GPT(dict(n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd, context=a.context,
                     vocab=a.vocab, padded_vocab=padded))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)

    def step():
        x = torch.randint(0, a.vocab, (a.micro_batch, a.seq_len))
        y = torch.randint(0, a.vocab, (a.micro_batch, a.seq_len))
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    step()  # warm-up
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    dt = (time.perf_counter() - t0) / a.steps
    print(f"torch_tokens_per_s {a.micro_batch * a.seq_len / dt:.3f}")


if __name__ == "__main__":
    main()
