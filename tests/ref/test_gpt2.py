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
import math
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from training_ref import ErrorChecks, load_params, read_dump, rel_err, train_adamw, worst_gradient

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
    check = ErrorChecks()

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
        meta, dump = read_dump(out)
    tokens = dump["tokens"]

    model = GPT(meta["config"])
    named = dict(model.named_parameters())
    table = meta["params"]
    if sorted(named) != sorted(e["name"] for e in table):
        print("FAIL gpt2.names: parameter names differ:",
              sorted(set(named) ^ set(e["name"] for e in table)))
        check.failed += 1
    load_params(named, table, dump["params0"])

    # One forward and backward on batch 0.
    logits, loss = model(tokens[0, 0], tokens[0, 1])
    loss.backward()
    check("gpt2.logits", rel_err(dump["logits"].reshape(logits.shape), logits.detach().numpy()),
          1e-4)
    check("gpt2.loss", rel_err([meta["loss0"]], [loss.item()]), 1e-4)
    worst = worst_gradient(named, table, dump["grads"], 1e-3)
    check(f"gpt2.gradients_of_{len(table)}_parameters", worst, 1e-3)

    # 10 AdamW steps: decay on 2-D weights only, clipping at 1.0, warmup + cosine.
    losses, lrs, norms = train_adamw("gpt2", model, named, table, tokens, meta, check)
    check("gpt2.lr_schedule", rel_err(meta["lrs"], lrs), 1e-6)
    check("gpt2.grad_norms", rel_err(meta["grad_norms"], norms), 1e-3)
    check("gpt2.adamw_10_step_losses", rel_err(meta["losses"], losses), 1e-4)
    flat = np.concatenate([named[e["name"]].detach().numpy().ravel() for e in table])
    check("gpt2.params_after_10_steps", rel_err(dump["params10"], flat), 1e-3)
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
