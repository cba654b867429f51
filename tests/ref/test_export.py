"""test_export.py — tools/ckpt export against the PyTorch reference GPT-2.

Trains a small GPT-2 in luazero for 3 steps with --save, exports the
checkpoint to safetensors (fp32, Hugging Face GPT-2 names, Conv1D weights
[in, out]), reads the file with a plain safetensors parser, loads it into
test_gpt2.GPT and compares the loss on a batch with luazero's loss on the
same batch (tests/ref/hf_loss.lua) to 1e-5 relative. Also checks the
names, shapes and the bf16 export against the fp32 one.

    /usr/bin/python3 tests/ref/test_export.py     # ends with "N passed, N failed"
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np
import torch

from checks import Checks
from test_gpt2 import GPT, LUAZERO, REPO

CFG = dict(n_layer=2, n_head=4, n_embd=64, context=32, vocab=250)


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        a, b = e["data_offsets"]
        raw = np.frombuffer(data[a:b], dtype=np.uint16 if e["dtype"] == "BF16" else np.float32)
        if e["dtype"] == "BF16":
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        out[name] = raw.reshape(e["shape"])
    return out


def main():
    check = Checks("export")

    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.txt")
        with open(corpus, "w") as f:
            f.write("It was the best of times, it was the worst of times.\n" * 40)
        flags = ["--model", "gpt2-nano", "--n-layer", "2", "--n-head", "4", "--n-embd", "64",
                 "--context", "32", "--vocab", "250", "--seq-len", "16", "--micro-batch", "2",
                 "--sample", "0", "--steps", "3", "--data", corpus]
        save = os.path.join(tmp, "ck")
        run = subprocess.run([LUAZERO, "-n", "2", os.path.join(REPO, "scripts", "train.lua"),
                              *flags, "--stage", "3", "--save", save],
                             capture_output=True, text=True, cwd=REPO)
        if run.returncode != 0:
            print("FAIL export.train:", run.stdout + run.stderr)
            print("0 passed, 1 failed")
            return 1
        out = {}
        for dtype in ("fp32", "bf16"):
            path = os.path.join(tmp, f"m-{dtype}.safetensors")
            r = subprocess.run([os.path.join(REPO, "tools", "ckpt"), "export", save, path,
                                "--dtype", dtype], capture_output=True, text=True)
            check(f"tool_{dtype}", r.returncode == 0, r.stdout.strip() + r.stderr.strip())
            out[dtype] = read_safetensors(path) if r.returncode == 0 else {}
        st = out["fp32"]
        if not st:
            check.failed += 1
            return check.summary()
        check("names", "wte.weight" in st and "h.1.attn.c_attn.weight" in st
              and "ln_f.bias" in st and not any(k.startswith("transformer.") for k in st))
        check("conv1d_shapes", tuple(st["h.0.attn.c_attn.weight"].shape) == (64, 192)
              and tuple(st["h.0.mlp.c_proj.weight"].shape) == (256, 64)
              and tuple(st["wte.weight"].shape) == (250, 64))
        worst = max(float(np.max(np.abs(out["bf16"][k] - v) / (np.max(np.abs(v)) + 1e-30)))
                    for k, v in st.items())
        check("bf16_is_rounded_fp32", worst <= 2 ** -8, f"(worst relative {worst:.3g})")

        # Luazero's loss on a fixed batch with the checkpoint's weights.
        r = subprocess.run([LUAZERO, os.path.join(REPO, "tests", "ref", "hf_loss.lua"), save],
                           capture_output=True, text=True, cwd=REPO)
        if r.returncode != 0:
            check("luazero_loss", False, r.stdout + r.stderr)
            return check.summary()
        res = json.loads(r.stdout.strip().splitlines()[-1])
        res["loss"] = float(res["loss"])

    cfg = dict(CFG, padded_vocab=256)
    model = GPT(cfg)
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in named.items():
            hf = name[len("transformer."):]
            w = torch.from_numpy(st[hf].copy())
            if hf.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
                w = w.t()  # Conv1D [in, out] -> nn.Linear [out, in]
            if hf == "wte.weight":
                p.zero_()
                p[:cfg["vocab"]] = w
            else:
                p.copy_(w)
    tokens = torch.tensor(res["tokens"], dtype=torch.int64).reshape(2, 2, 16)
    with torch.no_grad():
        _, loss = model(tokens[0], tokens[1])
    err = abs(loss.item() - res["loss"]) / abs(loss.item())
    check("loss_matches_luazero", err <= 1e-5,
          f"(torch {loss.item():.6f}, luazero {res['loss']:.6f}, relative {err:.2g})")
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
