"""training_ref.py — what the whole-model reference tests (test_gpt2.py,
test_llama_model.py) share: the relative error of two arrays, the learning
rate of luazero's schedule (linear warmup, cosine decay to min_lr) at a step,
written from its definition rather than taken from luazero, the files a
*_dump.lua writes, and the checks and AdamW steps run on the torch model."""
import json
import math
import os

import numpy as np
import torch

from checks import Checks


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


class ErrorChecks(Checks):
    """check(name, err, tol): passes when the relative error is within tol."""

    def __init__(self):
        super().__init__("")

    def __call__(self, name, err, tol):
        ok = err <= tol
        print(("ok  " if ok else "FAIL") + f" {name}: relative error {err:.3g} (tolerance {tol:g})")
        if ok:
            self.passed += 1
        else:
            self.failed += 1


def read_dump(out):
    """meta.json and the arrays of a dump folder: the flat fp32 parameters
    before (params0) and after (params10) training, batch 0's logits and
    gradients, and the tokens as an int64 tensor [steps * accum, 2, B, T]."""
    meta = json.load(open(os.path.join(out, "meta.json")))

    def load(name, dtype=np.float32):
        return np.fromfile(os.path.join(out, name), dtype=dtype)

    arrays = {name: load(name + ".f32") for name in ("params0", "params10", "logits", "grads")}
    tokens = load("tokens.i32", np.int32).astype(np.int64)
    arrays["tokens"] = torch.from_numpy(
        tokens.reshape(meta["steps"] * meta["accum"], 2, meta["B"], meta["T"]))
    return meta, arrays


def load_params(named, table, flat):
    """Copies each parameter's slice of the flat array into the model."""
    with torch.no_grad():
        for e in table:
            chunk = flat[e["offset"]:e["offset"] + e["numel"]].reshape(e["shape"])
            named[e["name"]].copy_(torch.from_numpy(chunk))


def worst_gradient(named, table, grads, tol):
    """The largest relative error of a parameter's gradient; prints the ones over tol."""
    worst, worst_name, bad = 0.0, "", []
    for e in table:
        g = grads[e["offset"]:e["offset"] + e["numel"]].reshape(e["shape"])
        err = rel_err(g, named[e["name"]].grad.numpy())
        if err > worst:
            worst, worst_name = err, e["name"]
        if err > tol:
            bad.append(f"{e['name']} {err:.3g}")
    if bad:
        print("    gradients off:", ", ".join(bad))
    print(f"    worst gradient: {worst_name}")
    return worst


def train_adamw(tag, model, named, table, tokens, meta, check):
    """meta's steps of AdamW (decay on 2-D weights only, clipping, warmup +
    cosine) on the tokens; returns the losses, learning rates and grad norms."""
    accum, steps, hp = meta["accum"], meta["steps"], meta["hp"]
    decay = [named[e["name"]] for e in table if e["decay"]]
    no_decay = [named[e["name"]] for e in table if not e["decay"]]
    if any(p.dim() != 2 for p in decay) or any(p.dim() == 2 for p in no_decay):
        print(f"FAIL {tag}.decay_groups: weight decay must apply to exactly the 2-D weights")
        check.failed += 1
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": hp["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"])
    losses, lrs, norms = [], [], []
    k = 0
    for step in range(1, steps + 1):
        opt.zero_grad(set_to_none=False)
        total = 0.0
        for _ in range(accum):
            _, l = model(tokens[k, 0], tokens[k, 1])
            (l / accum).backward()
            total += l.item()
            k += 1
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), hp["clip"])))
        lr = lr_at(hp, steps, step)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        losses.append(total / accum)
        lrs.append(lr)
    print("    losses  luazero:", " ".join(f"{v:.6f}" for v in meta["losses"]))
    print("    losses  torch:  ", " ".join(f"{v:.6f}" for v in losses))
    return losses, lrs, norms
