"""test_hf.py — Hugging Face model folders out of luazero and into transformers.

For a tiny Llama (grouped-query attention, vocabulary 250 padded to 256) and a
tiny GPT-2: trains 3 steps with scripts/train.lua --save, exports the
checkpoint as a folder (tools/ckpt export CKPT FOLDER: model.safetensors and
config.json), loads it with transformers' AutoModelForCausalLM.from_pretrained
as is (no missing or unexpected tensor), and compares its loss on a fixed batch
with luazero's loss on the same batch from the checkpoint (tests/ref/hf_loss.lua)
to 1e-4 relative. luazero's --init of the folder gives that loss bit for bit.
The bf16 export loads too (torch_dtype bfloat16), its loss within 2e-2, and
an fp32 export in shards of at most 100KB (tools/ckpt export --max-shard-size:
model-0000k-of-0000n.safetensors and model.safetensors.index.json) loads with
the fp32 loss, and luazero's --init of it gives that loss bit for bit.

transformers 4.40.2 comes from build/ref-venv (tools/setup) or LZ_REF_VENV;
without it this file says it skipped.
    /usr/bin/python3 tests/ref/test_hf.py     # ends with "N passed, N failed"
"""
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks  # noqa: E402
from refenv import LUAZERO, REPO, import_transformers  # noqa: E402

MODELS = {
    "llama": ["--model", "llama-tiny", "--vocab", "250", "--context", "32"],
    "gpt2": ["--model", "gpt2-nano", "--n-layer", "2", "--n-head", "4", "--n-embd", "64",
             "--context", "32", "--vocab", "250"],
}


def main():
    check = Checks("hf")
    transformers = import_transformers()
    if transformers is None:
        return check.summary()

    def run(cmd):
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        return r.returncode, r.stdout + r.stderr

    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.txt")
        with open(corpus, "w") as f:
            f.write("It was the best of times, it was the worst of times.\n" * 40)
        for family, model_flags in MODELS.items():
            ck = os.path.join(tmp, family + "-ck")
            rc, out = run([LUAZERO, "-n", "2", os.path.join(REPO, "scripts", "train.lua"),
                           *model_flags, "--data", corpus, "--steps", "3", "--seq-len", "16",
                           "--micro-batch", "2", "--sample", "0", "--stage", "3", "--save", ck])
            if rc != 0:
                check(f"{family}.train", False, out)
                continue
            rc, out = run([LUAZERO, os.path.join(REPO, "tests", "ref", "hf_loss.lua"), ck])
            if rc != 0:
                check(f"{family}.luazero_loss", False, out)
                continue
            res = json.loads(out.strip().splitlines()[-1])
            lz_loss = float(res["loss"])
            tokens = torch.tensor(res["tokens"], dtype=torch.int64).reshape(2, 2, 16)
            for dtype in ("fp32", "bf16", "sharded"):
                # (sharded: fp32 in shards of at most 100KB and their index, as
                # save_pretrained's max_shard_size writes them)
                folder = os.path.join(tmp, f"{family}-{dtype}")
                rc, out = run([os.path.join(REPO, "tools", "ckpt"), "export", ck, folder,
                               *(["--max-shard-size", "100KB"] if dtype == "sharded" else
                                 ["--dtype", dtype])])
                if dtype == "sharded":
                    check(f"{family}.sharded_files", rc == 0 and os.path.exists(os.path.join(
                        folder, "model.safetensors.index.json")) and not os.path.exists(
                        os.path.join(folder, "model.safetensors")), out.strip())
                check(f"{family}.export_{dtype}", rc == 0 and os.path.exists(
                    os.path.join(folder, "config.json")), out.strip())
                if rc != 0:
                    continue
                try:
                    model, info = transformers.AutoModelForCausalLM.from_pretrained(
                        folder, output_loading_info=True)
                except Exception as e:  # noqa: BLE001 - any failure to load is the finding
                    check(f"{family}.from_pretrained_{dtype}", False, repr(e))
                    continue
                bad = {k: v for k, v in info.items() if v}  # missing, unexpected, mismatched
                check(f"{family}.from_pretrained_{dtype}", not bad,
                      f"({type(model).__name__}, {model.dtype}) {bad if bad else ''}")
                model = model.float().eval()
                with torch.no_grad():
                    logits = model(tokens[0]).logits
                    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           tokens[1].reshape(-1)).item()
                err = abs(loss - lz_loss) / abs(lz_loss)
                tol = 2e-2 if dtype == "bf16" else 1e-4
                check(f"{family}.loss_{dtype}", err <= tol,
                      f"(transformers {loss:.7f}, luazero {lz_loss:.7f}, relative {err:.2g}, "
                      f"tolerance {tol:g})")
            for kind in ("fp32", "sharded"):
                rc, out = run([LUAZERO, os.path.join(REPO, "tests", "ref", "hf_loss.lua"), "--init",
                               os.path.join(tmp, f"{family}-{kind}")])
                init = json.loads(out.strip().splitlines()[-1])["loss"] if rc == 0 else out
                check(f"{family}.init_loss_bitwise{'_sharded' if kind == 'sharded' else ''}",
                      init == res["loss"], f"(--init {init}, checkpoint {res['loss']})")
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
