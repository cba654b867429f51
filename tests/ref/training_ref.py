"""training_ref.py — what the whole-model reference tests (test_gpt2.py,
test_llama_model.py) share: the relative error of two arrays and the
learning rate of luazero's schedule (linear warmup, cosine decay to min_lr)
at a step, written from its definition rather than taken from luazero."""
import math

import numpy as np


def rel_err(a, b):
    """max|a - b| / max|b| (1 where b is all zeros)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    scale = np.max(np.abs(b))
    return float(np.max(np.abs(a - b)) / (scale if scale > 0 else 1.0))


def lr_at(hp, steps, step):
    """hp: lr, warmup, min_lr; the learning rate of optimizer step `step` of `steps`."""
    lr, warmup, min_lr = hp["lr"], hp["warmup"], hp["min_lr"]
    if step <= warmup:
        return lr * step / warmup
    if step >= steps:
        return min_lr
    ratio = (step - warmup) / (steps - warmup)
    return min_lr + 0.5 * (1 + math.cos(math.pi * ratio)) * (lr - min_lr)
