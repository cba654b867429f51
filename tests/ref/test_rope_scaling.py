"""test_rope_scaling.py — linear RoPE scaling (rope_scaling {"type": "linear",
"factor": 4.0}) of a Llama config.json against transformers 4.40.2's
LlamaForCausalLM (LlamaLinearScalingRotaryEmbedding).

A tiny random Llama (2 layers, hidden 64, 4 query heads, 2 key/value heads)
saved with save_pretrained: luazero's --init loss on tests/ref/hf_loss.lua's
fixed batch equals transformers' within 1e-5 relative (the same model
without the scaling gives another loss: the factor is read), and
tools/ckpt export of a checkpoint trained from it writes rope_scaling back
as transformers 4.x validates it, so from_pretrained loads it with the same
loss. (Gemma 3's linear scaling of its global layers is test5_gemma3.py's.)
transformers 4.40.2 comes from build/ref-venv (tools/setup) or LZ_REF_VENV;
without it this file says it skipped.

    /usr/bin/python3 tests/ref/test_rope_scaling.py     # ends with "N passed, N failed"
"""
import json
import os
import subprocess
import sys
import struct
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks  # noqa: E402
from refenv import LUAZERO, REPO, import_transformers  # noqa: E402


def run(*cmd):
    r = subprocess.run(list(cmd), capture_output=True, text=True, cwd=REPO)
    return r.returncode, r.stdout + r.stderr


def batch_loss(model, tokens):
    t = torch.tensor(tokens, dtype=torch.int64).reshape(2, 2, 16)
    with torch.no_grad():
        logits = model(t[0]).logits
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                   t[1].reshape(-1)))


def luazero_loss(check, name, *args):
    rc, out = run(LUAZERO, os.path.join(REPO, "tests", "ref", "hf_loss.lua"), *args)
    check(f"{name}.runs", rc == 0, "" if rc == 0 else out.strip()[-800:])
    return json.loads(out.strip().splitlines()[-1]) if rc == 0 else None


def main():
    check = Checks("rope_scaling")
    transformers = import_transformers()
    if transformers is None:
        return check.summary()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        folders = {}
        for name, scaling in (("linear", {"type": "linear", "factor": 4.0}), ("none", None)):
            torch.manual_seed(0)
            config = transformers.LlamaConfig(
                vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rope_scaling=scaling, initializer_range=0.2)
            model = transformers.LlamaForCausalLM(config).eval()
            folders[name] = os.path.join(tmp, name)
            model.save_pretrained(folders[name], safe_serialization=True)
            if name == "linear":
                linear = model
        res = luazero_loss(check, "init", "--init", folders["linear"])
        plain = luazero_loss(check, "init_without", "--init", folders["none"])
        if res is None or plain is None:
            return check.summary()
        want, got = batch_loss(linear, res["tokens"]), float(res["loss"])
        rel = abs(got - want) / abs(want)
        check("init.loss", rel < 1e-5, f"(transformers {want:.8f}, luazero {got:.8f}, "
              f"relative {rel:.1e})")
        check("bites", abs(float(plain["loss"]) - got) > 1e-3 * abs(got),
              f"(with {got:.6f}, without {float(plain['loss']):.6f})")
        # trained from it, exported, loaded back in transformers
        corpus = os.path.join(tmp, "corpus.bin")
        with open(corpus, "wb") as f:  # a token file (llm.c's header), ids below 256
            ids = [(i * 7919) % 256 for i in range(4096)]
            f.write(struct.pack("<256i", 20240520, 1, len(ids), *([0] * 253)))
            f.write(struct.pack(f"<{len(ids)}H", *ids))
        ck, out_dir = os.path.join(tmp, "ck"), os.path.join(tmp, "export")
        rc, out = run(LUAZERO, os.path.join(REPO, "scripts", "train.lua"), "--init",
                      folders["linear"], "--data", corpus, "--steps", "2", "--seq-len", "16",
                      "--micro-batch", "2", "--sample", "0", "--save", ck)
        check("train", rc == 0, "" if rc == 0 else out.strip()[-800:])
        rc, out = run(os.path.join(REPO, "tools", "ckpt"), "export", ck, out_dir)
        check("export", rc == 0, out.strip()[-800:])
        if rc != 0:
            return check.summary()
        with open(os.path.join(out_dir, "config.json")) as f:
            written = json.load(f).get("rope_scaling")
        check("export.rope_scaling", written == {"type": "linear", "factor": 4.0}, json.dumps(written))
        try:
            back = transformers.AutoModelForCausalLM.from_pretrained(out_dir).eval()
        except Exception as e:  # noqa: BLE001 - any failure to load is the finding
            check("export.from_pretrained", False, repr(e))
            return check.summary()
        res = luazero_loss(check, "checkpoint", ck)
        if res is not None:
            want, got = batch_loss(back, res["tokens"]), float(res["loss"])
            rel = abs(got - want) / abs(want)
            check("export.loss", rel < 1e-5, f"(transformers {want:.8f}, luazero {got:.8f}, "
                  f"relative {rel:.1e})")
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
