"""test_gemma.py — luazero's Gemma (models/gemma.lua) against transformers'
GemmaForCausalLM: GeGLU with the tanh GELU, RMSNorm scaling by 1 + weight,
embeddings times sqrt(hidden_size), head_dim apart from hidden / heads,
multi-query attention (one key/value head), the head tied to the embedding.

A tiny random GemmaForCausalLM (2 layers, hidden 64, 4 query heads, 1
key/value head, head_dim 32, vocabulary 250 that luazero pads to 256; every
norm weight drawn too, so 1 + weight is tested) saved with save_pretrained:

  init      --init of the folder (tests/ref/hf_grads.lua): the loss on a batch
            within 1e-5 relative of transformers', every parameter's gradient
            of that batch within 1e-4 (max |luazero - torch| / max |torch|)
  export    20 steps of scripts/train.lua --init, tools/ckpt export: the folder
            loads in transformers (no missing or unexpected tensor) with the
            loss luazero has from the checkpoint (1e-5)
  generate  scripts/generate.lua --hf, greedy, 64 new tokens of several prompts
            at once: transformers' generate(do_sample=False) token for token
  lora      scripts/train.lua --init --lora-r 4, tools/ckpt export: PEFT loads
            the adapters on the base and its loss is scripts/eval.lua's
            --adapters loss on the same window (1e-5)

transformers 4.40.2 and peft come from build/ref-venv (tools/setup) or
LZ_REF_VENV; without them this file says it skipped.
    /usr/bin/python3 tests/ref/test_gemma.py     # ends with "N passed, N failed"
"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks  # noqa: E402
from refenv import LUAZERO, REPO, import_from_venv, import_transformers  # noqa: E402

B, T, STEPS, NEW = 2, 16, 20, 64
PROMPTS = [[5, 17, 99, 3, 200, 41, 7], [1], [120, 8, 8, 31, 249, 0, 64, 12, 180, 2, 77]]
TEXT = "It was the best of times, it was the worst of times.\n"


def run(*argv):
    r = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       errors="replace", cwd=REPO)
    return r.returncode, r.stdout


def lz(*argv):
    return run(LUAZERO, *argv)


def last_json(out):
    return json.loads(out.strip().splitlines()[-1])


def loss_of(model, x, y):
    logits = model(x).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def make_model(transformers):
    config = transformers.GemmaConfig(
        vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
        rms_norm_eps=1e-6, rope_theta=10000.0, initializer_range=0.2,
        hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
        bos_token_id=2, eos_token_id=1, tie_word_embeddings=True,
        # no padding_idx: torch's embedding would give its row no gradient
        pad_token_id=None)
    torch.manual_seed(3)
    model = transformers.GemmaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    return model


def check_init(check, model, base, tmp):
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 250, (B, T), generator=g)
    y = torch.randint(0, 250, (B, T), generator=g)
    path = os.path.join(tmp, "tokens.i32")
    np.concatenate([x.numpy().ravel(), y.numpy().ravel()]).astype("<i4").tofile(path)
    st, out = lz(os.path.join("tests", "ref", "hf_grads.lua"), base, path, str(B), str(T), tmp)
    if st != 0:
        check("init.runs", False, out[-2000:])
        return
    res = last_json(out)
    ours = float(res["loss"])
    model.zero_grad()
    loss = loss_of(model, x, y)
    loss.backward()
    err = abs(ours - loss.item()) / abs(loss.item())
    check("init.loss", err <= 1e-5,
          f"(transformers {loss.item():.7f}, luazero {ours:.7f}, relative {err:.2g})")
    grads = np.fromfile(os.path.join(tmp, "grads.f32"), dtype="<f4")
    theirs = dict(model.named_parameters())
    worst, where, n = 0.0, None, 0
    for p in res["params"]:
        ref = theirs[p["name"]].grad
        got = torch.from_numpy(grads[p["offset"]:p["offset"] + p["numel"]].copy())
        got = got.reshape(p["shape"])[:ref.shape[0]]
        e = float((got - ref).abs().max() / ref.abs().max())
        n += 1
        if e > worst:
            worst, where = e, p["name"]
    check("init.gradients", n == len(theirs) and worst <= 1e-4,
          f"({n} of {len(theirs)} tensors; worst {worst:.2g} at {where})")


def check_export(check, transformers, base, tmp, arch="GemmaForCausalLM"):
    corpus = os.path.join(tmp, "corpus.txt")
    with open(corpus, "w") as f:
        f.write(TEXT * 40)
    ck = os.path.join(tmp, "ck")
    st, out = lz("scripts/train.lua", "--init", base, "--data", corpus, "--steps", str(STEPS),
                 "--seq-len", str(T), "--micro-batch", str(B), "--sample", "0", "--lr", "0.003",
                 "--save", ck)
    if st != 0:
        check("export.train", False, out[-2000:])
        return
    st, out = lz(os.path.join("tests", "ref", "hf_loss.lua"), ck)
    if st != 0:
        check("export.luazero_loss", False, out[-2000:])
        return
    res = last_json(out)
    ours = float(res["loss"])
    tokens = torch.tensor(res["tokens"], dtype=torch.int64).reshape(2, 2, 16)
    folder = os.path.join(tmp, "exported")
    st, out = run(os.path.join(REPO, "tools", "ckpt"), "export", ck, folder)
    if st != 0:
        check("export.runs", False, out[-2000:])
        return
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder,
                                                                    output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    check("export.from_pretrained", not bad and type(model).__name__ == arch,
          f"({type(model).__name__}) {bad if bad else ''}")
    with torch.no_grad():
        loss = loss_of(model.float().eval(), tokens[0], tokens[1]).item()
    err = abs(loss - ours) / abs(ours)
    check("export.loss", err <= 1e-5,
          f"(transformers {loss:.7f}, luazero {ours:.7f}, relative {err:.2g})")


def check_bites(check, cls, model, changes):
    """Each option of `changes` (name -> the value that turns it off) moves
    the loss on a batch by more than 1e-4 relative: the test exercises it."""
    g = torch.Generator().manual_seed(6)
    x = torch.randint(0, model.config.vocab_size, (B, T), generator=g)
    y = torch.randint(0, model.config.vocab_size, (B, T), generator=g)
    with torch.no_grad():
        ref = loss_of(model, x, y).item()
        for name, off in changes.items():
            config = type(model.config).from_dict(model.config.to_dict())
            setattr(config, name, off)
            other = cls(config).eval()
            other.load_state_dict(model.state_dict())
            loss = loss_of(other, x, y).item()
            err = abs(loss - ref) / abs(ref)
            check(f"bites.{name}", err > 1e-4, f"(with {ref:.6f}, without {loss:.6f})")


def check_generate(check, model, base, tmp):
    prompts = os.path.join(tmp, "prompts.jsonl")
    with open(prompts, "w") as f:
        for p in PROMPTS:
            f.write(json.dumps({"prompt_ids": p}) + "\n")
    out_path = os.path.join(tmp, "gen.jsonl")
    st, out = lz("scripts/generate.lua", "--hf", base, "--prompts", prompts, "--max-new-tokens",
                 str(NEW), "--out", out_path)
    if st != 0:
        check("generate.runs", False, out[-2000:])
        return
    with open(out_path) as f:
        ours = [json.loads(line) for line in f]
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW,
                                 pad_token_id=model.config.eos_token_id)
        want = ref[0, len(p):].tolist()
        got = ours[i]["ids"] if i < len(ours) else []
        first = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
        check(f"generate.prompt{i}", got == want,
              f"({len(want)} ids" + (f"; first difference at {first}" if first is not None
                                     else "") + ")")


def check_lora(check, model, base, tmp, peft):
    corpus = os.path.join(tmp, "corpus.txt")
    ck, adapters = os.path.join(tmp, "lora-ck"), os.path.join(tmp, "lora-peft")
    st, out = lz("scripts/train.lua", "--init", base, "--data", corpus, "--steps", "6",
                 "--seq-len", str(T), "--micro-batch", str(B), "--sample", "0", "--lora-r", "4",
                 "--lr", "0.01", "--save", ck)
    if st != 0:
        check("lora.train", False, out[-2000:])
        return
    st, out = lz("tools/ckpt.lua", "export", ck, adapters)
    if st != 0:
        check("lora.export", False, out[-2000:])
        return
    # One window: T + 1 bytes, the inputs and the targets one apart.
    window = TEXT[:T + 1]
    one = os.path.join(tmp, "one.txt")
    with open(one, "w") as f:
        f.write(window)
    st, out = lz("scripts/eval.lua", "--hf", base, "--adapters", adapters, "--data", one,
                 "--seq-len", str(T), "--micro-batch", "1", "--json")
    if st != 0:
        check("lora.eval", False, out[-2000:])
        return
    ours = float(last_json(out)["loss"])
    ids = torch.tensor([list(window.encode())])
    tuned = peft.PeftModel.from_pretrained(model, adapters).eval()
    with torch.no_grad():
        ref = loss_of(tuned, ids[:, :-1], ids[:, 1:]).item()
    err = abs(ours - ref) / abs(ref)
    check("lora.peft_loss", err <= 1e-5,
          f"(peft {ref:.7f}, luazero {ours:.7f}, relative {err:.2g})")


def main():
    check = Checks("gemma")
    transformers = import_transformers()
    if transformers is None:
        return check.summary()
    model = make_model(transformers)
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        model.save_pretrained(base, safe_serialization=True)
        check_init(check, model, base, tmp)
        check_export(check, transformers, base, tmp)
        check_generate(check, model, base, tmp)
        peft, why = import_from_venv("peft")
        if peft is None:
            print(f"  skip lora: {why}")
        else:
            check_lora(check, model, base, tmp, peft)
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
