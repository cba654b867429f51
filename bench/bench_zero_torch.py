"""bench_zero_torch.py — the PyTorch yardstick of bench/bench_zero.lua: the
GPT-2 of tests/ref/test_gpt2.py trained data-parallel on 2 CPU ranks (gloo),
with DistributedDataParallel + AdamW ("ddp") or with ZeroRedundancyOptimizer
("zero1"). Prints "torch_<mode>_tokens_per_s X" and "torch_<mode>_peak_rss X".
    /usr/bin/python3 bench/bench_zero_torch.py --mode ddp --n-layer 8 --n-embd 768
"""
import argparse
import os
import resource
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests", "ref"))
from test_gpt2 import GPT  # noqa: E402


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, a, port, q):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(a.threads)
    torch.set_num_interop_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=a.world)
    torch.manual_seed(0)
    padded = (a.vocab + 63) // 64 * 64
    model = GPT(dict(n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd, context=a.context,
                     vocab=a.vocab, padded_vocab=padded))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    kw = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    if a.mode == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **kw)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), **kw)
    x = torch.randint(0, a.vocab, (a.micro_batch, a.seq_len))
    y = torch.randint(0, a.vocab, (a.micro_batch, a.seq_len))

    def step():
        opt.zero_grad(set_to_none=True)
        _, loss = ddp(x, y)  # GPT.forward(idx, targets) -> (logits, mean loss)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()

    step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    dist.barrier()
    dt = (time.perf_counter() - t0) / a.steps
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if rank == 0:
        q.put((a.world * a.micro_batch * a.seq_len / dt, rss))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="ddp", choices=["ddp", "zero1"])
    for name, default in [("n-layer", 8), ("n-head", 12), ("n-embd", 768), ("context", 256),
                          ("vocab", 50257), ("micro-batch", 2), ("seq-len", 64), ("steps", 2),
                          ("threads", 1), ("world", 2)]:
        p.add_argument("--" + name, type=int, default=default)
    a = p.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    # Each rank runs --threads intra-op threads (luazero's launcher gives each
    # of N ranks cpus/N threads); a free port so runs never collide.
    mp.spawn(worker, args=(a, free_port(), q), nprocs=a.world, join=True)
    tps, rss = q.get()
    print(f"torch_{a.mode}_tokens_per_s {tps:.3f}")
    print(f"torch_{a.mode}_peak_rss {rss}")


if __name__ == "__main__":
    main()
