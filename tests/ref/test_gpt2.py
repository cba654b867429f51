"""test_gpt2.py — luazero's GPT-2 against a small PyTorch GPT-2, in fp32.

tests/ref/gpt2_dump.lua builds a GPT-2 in luazero, runs a forward and
backward and 10 AdamW steps (gradient accumulation 2, clipping, warmup and
cosine decay) and writes the initial weights, the batches and its results. This
file loads the same weights into the PyTorch model below, redoes the same work,
and compares:
  logits and loss            <= 1e-4 relative
  every parameter's gradient <= 1e-3 relative
  the 10 step losses         <= 1e-4 relative
Relative error: max |luazero - torch| / max |torch| over the tensor.

    /usr/bin/python3 tests/ref/test_gpt2.py     # ends with "N passed, N failed"
LUAZERO names the executable (default <repo>/build/bin/luazero).
"""
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from training_ref import lr_at, rel_err

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LUAZERO = os.environ.get("LUAZERO") or os.path.join(REPO, "build", "bin", "luazero")


class Attention(nn.Module):
    def __init__(self, C, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(C, 3 * C)
        self.c_proj = nn.Linear(C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        hs = C // self.n_head
        q, k, v = (t.view(B, T, self.n_head, hs).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.c_fc = nn.Linear(C, 4 * C)
        self.c_proj = nn.Linear(4 * C, C)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, C, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(C)
        self.attn = Attention(C, n_head)
        self.ln_2 = nn.LayerNorm(C)
        self.mlp = MLP(C)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 with Hugging Face's parameter names; lm_head tied to wte."""

    def __init__(self, cfg):
        super().__init__()
        C = cfg["n_embd"]
        self.vocab = cfg["vocab"]
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg["padded_vocab"], C),
            wpe=nn.Embedding(cfg["context"], C),
            h=nn.ModuleList([Block(C, cfg["n_head"]) for _ in range(cfg["n_layer"])]),
            ln_f=nn.LayerNorm(C),
        ))

    def forward(self, idx, targets):
        T = idx.shape[1]
        t = self.transformer
        x = t.wte(idx) + t.wpe(torch.arange(T))
        for block in t.h:
            x = block(x)
        logits = F.linear(t.ln_f(x), t.wte.weight)
        loss = F.cross_entropy(logits[..., :self.vocab].reshape(-1, self.vocab),
                               targets.reshape(-1))
        return logits, loss


def main():
    torch.set_num_threads(2)
    passed, failed = 0, 0

    def check(name, err, tol):
        nonlocal passed, failed
        ok = err <= tol
        print(("ok  " if ok else "FAIL") + f" gpt2.{name}: relative error {err:.3g} (tolerance {tol:g})")
        if ok:
            passed += 1
        else:
            failed += 1

    if not os.access(LUAZERO, os.X_OK):
        print(f"FAIL gpt2.dump: {LUAZERO} is missing: build first (tools/setup), or set LUAZERO")
        print("0 passed, 1 failed")
        return 1
    with tempfile.TemporaryDirectory() as out:
        run = subprocess.run([LUAZERO, os.path.join(REPO, "tests", "ref", "gpt2_dump.lua"), out],
                             capture_output=True, text=True)
        if run.returncode != 0:
            print("FAIL gpt2.dump: luazero tests/ref/gpt2_dump.lua exited", run.returncode)
            print(run.stdout + run.stderr)
            print("0 passed, 1 failed")
            return 1
        meta = json.load(open(os.path.join(out, "meta.json")))

        def load(name, dtype=np.float32):
            return np.fromfile(os.path.join(out, name), dtype=dtype)

        params0, logits_lz, grads_lz = load("params0.f32"), load("logits.f32"), load("grads.f32")
        params10 = load("params10.f32")
        tokens = load("tokens.i32", np.int32).astype(np.int64)

    cfg, B, T = meta["config"], meta["B"], meta["T"]
    accum, steps, hp = meta["accum"], meta["steps"], meta["hp"]
    tokens = torch.from_numpy(tokens.reshape(steps * accum, 2, B, T))

    model = GPT(cfg)
    named = dict(model.named_parameters())
    table = meta["params"]
    if sorted(named) != sorted(e["name"] for e in table):
        print("FAIL gpt2.names: parameter names differ:",
              sorted(set(named) ^ set(e["name"] for e in table)))
        failed += 1
    with torch.no_grad():
        for e in table:
            chunk = params0[e["offset"]:e["offset"] + e["numel"]].reshape(e["shape"])
            named[e["name"]].copy_(torch.from_numpy(chunk))

    # One forward and backward on batch 0.
    logits, loss = model(tokens[0, 0], tokens[0, 1])
    loss.backward()
    check("logits", rel_err(logits_lz.reshape(logits.shape), logits.detach().numpy()), 1e-4)
    check("loss", rel_err([meta["loss0"]], [loss.item()]), 1e-4)
    worst, worst_name, bad = 0.0, "", []
    for e in table:
        g = grads_lz[e["offset"]:e["offset"] + e["numel"]].reshape(e["shape"])
        err = rel_err(g, named[e["name"]].grad.numpy())
        if err > worst:
            worst, worst_name = err, e["name"]
        if err > 1e-3:
            bad.append(f"{e['name']} {err:.3g}")
    if bad:
        print("    gradients off:", ", ".join(bad))
    print(f"    worst gradient: {worst_name}")
    check(f"gradients_of_{len(table)}_parameters", worst, 1e-3)

    # 10 AdamW steps: decay on 2-D weights only, clipping at 1.0, warmup + cosine.
    decay = [named[e["name"]] for e in table if e["decay"]]
    no_decay = [named[e["name"]] for e in table if not e["decay"]]
    if any(p.dim() != 2 for p in decay) or any(p.dim() == 2 for p in no_decay):
        print("FAIL gpt2.decay_groups: weight decay must apply to exactly the 2-D weights")
        failed += 1
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
    check("lr_schedule", rel_err(meta["lrs"], lrs), 1e-6)
    check("grad_norms", rel_err(meta["grad_norms"], norms), 1e-3)
    check("adamw_10_step_losses", rel_err(meta["losses"], losses), 1e-4)
    flat = np.concatenate([named[e["name"]].detach().numpy().ravel() for e in table])
    check("params_after_10_steps", rel_err(params10, flat), 1e-3)

    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
