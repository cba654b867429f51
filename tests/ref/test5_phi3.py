"""test5_phi3.py — luazero's Phi-3 (models/phi3.lua) against transformers 5.23's
Phi3ForCausalLM and PEFT 0.21.2.

Two tiny random models (2 layers, dim 64, 4 query heads, 2 key/value heads,
head_dim 16, vocabulary 256), saved with save_pretrained:
  window    sliding_window 6, shorter than the 16-token batch and the prompts
  longrope  LongRoPE (short and long factors, original_max_position_embeddings
            12, so the 16-token batch turns with the long ones and generation
            passes from the short to the long ones) and partial_rotary_factor
            0.5 (8 of each head's 16 values turn), no window
For each:
  init      scripts/train.lua's --init reading of the folder (config.json,
            qkv_proj and gate_up_proj as they are) gives transformers' loss on
            a batch within 1e-5 relative, and every parameter's gradient of one
            backward within 1e-4 (max |ours - theirs| / max |theirs|)
  export    20 training steps (2 ranks, ZeRO stage 3, --save), tools/ckpt
            export, transformers loads the folder with nothing missing or
            unexpected and its loss equals the checkpoint's within 1e-5
  generate  scripts/generate.lua --hf, greedy, 64 new tokens of prompts longer
            than the window, rows at different positions in one batch: the ids
            of transformers' generate of each prompt alone
  lora      a LoRA run (its default target, qkv_proj), tools/ckpt export:
            PEFT 0.21.2 loads the adapters and its loss equals luazero's on
            the base with the same adapters within 1e-5

Runs with the second reference environment (tests/ref/refenv.py: VENV5);
without it this file says it skipped.
    /root/.cache/luazero/ref5-venv/bin/python tests/ref/test5_phi3.py [CASE...]
"""
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks  # noqa: E402
from refenv import LUAZERO, REPO  # noqa: E402

NEW = 64
PROMPTS = [[5, 17, 99, 3, 200, 41, 7, 250, 11, 90], [1, 2, 3], [120, 8, 8, 31, 77, 64, 12, 180]]
STEPS = 20
TOL = 1e-5


def configs(transformers):
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-5, initializer_range=0.2, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=None, pad_token_id=0)
    window = transformers.Phi3Config(sliding_window=6, **common)
    longrope = transformers.Phi3Config(
        sliding_window=None, original_max_position_embeddings=12,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5,
                         "short_factor": [1.0, 1.25, 1.5, 2.0],
                         "long_factor": [2.0, 3.5, 5.0, 9.0]}, **common)
    return [("window", window), ("longrope", longrope)]


def lz(*argv):
    r = subprocess.run([LUAZERO, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, errors="replace", cwd=REPO)
    return r.returncode, r.stdout


def last_json(out):
    return json.loads(out.strip().splitlines()[-1])


def batch_loss(torch, model, tokens):
    x, y = tokens[0], tokens[1]
    logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def init_case(check, torch, name, model, folder, tmp):
    gdir = os.path.join(tmp, name + "-grads")
    os.makedirs(gdir)
    st, out = lz("tests/ref/hf_loss.lua", "--init", folder, "--grads", gdir)
    if st != 0:
        check(f"{name}.init", False, out[-2000:])
        return
    res = last_json(out)
    tokens = torch.tensor(res["tokens"], dtype=torch.int64).reshape(2, 2, 16)
    model.zero_grad()
    loss = batch_loss(torch, model, tokens)
    loss.backward()
    ours = float(res["loss"])
    err = abs(ours - loss.item()) / abs(loss.item())
    check(f"{name}.init_loss", err <= TOL,
          f"(luazero {ours:.8f}, transformers {loss.item():.8f}, relative {err:.2g})")
    import numpy as np
    grads = np.fromfile(os.path.join(gdir, "grads.f32"), dtype=np.float32)
    with open(os.path.join(gdir, "params.json")) as f:
        params = json.load(f)
    theirs = dict(model.named_parameters())
    worst, where, missing = 0.0, "", []
    for p in params:
        ref = theirs.get(p["name"])
        if ref is None:
            missing.append(p["name"])
            continue
        n = int(np.prod(p["shape"]))
        g = grads[p["offset"]:p["offset"] + n].reshape(p["shape"])
        r = ref.grad.detach().numpy()
        rows = r.shape[0]
        e = float(np.abs(g[:rows] - r).max() / max(np.abs(r).max(), 1e-30))
        if e > worst:
            worst, where = e, p["name"]
    check(f"{name}.init_grads", worst <= 1e-4 and not missing,
          f"(worst {worst:.2g} at {where}; tolerance 1e-4){' missing ' + str(missing) if missing else ''}")


def export_case(check, transformers, torch, name, folder, corpus, tmp):
    ck = os.path.join(tmp, name + "-ck")
    st, out = lz("-n", "2", "scripts/train.lua", "--init", folder, "--data", corpus, "--steps",
                 str(STEPS), "--seq-len", "16", "--micro-batch", "2", "--sample", "0", "--stage",
                 "3", "--save", ck)
    if st != 0:
        check(f"{name}.train", False, out[-2000:])
        return
    st, out = lz("tests/ref/hf_loss.lua", ck)
    if st != 0:
        check(f"{name}.checkpoint_loss", False, out[-2000:])
        return
    res = last_json(out)
    ours = float(res["loss"])
    tokens = torch.tensor(res["tokens"], dtype=torch.int64).reshape(2, 2, 16)
    exported = os.path.join(tmp, name + "-export")
    st, out = lz("tools/ckpt.lua", "export", ck, exported)
    if st != 0:
        check(f"{name}.export", False, out[-2000:])
        return
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        exported, output_loading_info=True, attn_implementation="eager")
    bad = {k: v for k, v in info.items() if v}
    check(f"{name}.from_pretrained", not bad and type(model).__name__ == "Phi3ForCausalLM",
          f"({type(model).__name__}) {bad if bad else ''}")
    with torch.no_grad():
        loss = batch_loss(torch, model.float().eval(), tokens).item()
    err = abs(ours - loss) / abs(loss)
    check(f"{name}.export_loss", err <= TOL,
          f"(transformers {loss:.8f}, luazero {ours:.8f}, relative {err:.2g})")


def generate_case(check, torch, name, model, folder, tmp):
    prompts = os.path.join(tmp, name + "-prompts.jsonl")
    with open(prompts, "w") as f:
        for p in PROMPTS:
            f.write(json.dumps({"prompt_ids": p}) + "\n")
    out_file = os.path.join(tmp, name + "-gen.jsonl")
    st, out = lz("scripts/generate.lua", "--hf", folder, "--prompts", prompts,
                 "--max-new-tokens", str(NEW), "--out", out_file)
    if st != 0:
        check(f"{name}.generate", False, out[-2000:])
        return
    with open(out_file, encoding="utf-8", errors="replace") as f:
        ours = [json.loads(line) for line in f]
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p),
                                 dtype=torch.int64), do_sample=False, max_new_tokens=NEW,
                                 pad_token_id=0)
        want = ref[0, len(p):].tolist()
        got = ours[i]["ids"] if i < len(ours) else []
        first = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
        check(f"{name}.prompt{i}_greedy_ids", got == want,
              f"({len(want)} ids" + (f"; first difference at {first}: {got[first]} vs "
                                     f"{want[first]}" if first is not None else "") + ")")


def lora_case(check, torch, peft, name, model, folder, corpus, tmp):
    ck, adapters = os.path.join(tmp, name + "-lora"), os.path.join(tmp, name + "-peft")
    st, out = lz("scripts/train.lua", "--init", folder, "--data", corpus, "--steps", "6",
                 "--seq-len", "16", "--micro-batch", "2", "--sample", "0", "--lora-r", "4",
                 "--lr", "0.01", "--save", ck)
    if st != 0:
        check(f"{name}.lora_train", False, out[-2000:])
        return
    st, out = lz("tools/ckpt.lua", "export", ck, adapters)
    if st != 0:
        check(f"{name}.lora_export", False, out[-2000:])
        return
    with open(os.path.join(adapters, "adapter_config.json")) as f:
        targets = json.load(f).get("target_modules")
    check(f"{name}.lora_targets", sorted(targets or []) == ["qkv_proj"], str(targets))
    st, out = lz("tests/ref/hf_loss.lua", "--init", folder, "--adapters", adapters)
    if st != 0:
        check(f"{name}.lora_luazero_loss", False, out[-2000:])
        return
    res = last_json(out)
    ours = float(res["loss"])
    tokens = torch.tensor(res["tokens"], dtype=torch.int64).reshape(2, 2, 16)
    tuned = peft.PeftModel.from_pretrained(model, adapters).eval()
    with torch.no_grad():
        ref = batch_loss(torch, tuned, tokens).item()
    base = None
    with torch.no_grad(), tuned.disable_adapter():
        base = batch_loss(torch, tuned, tokens).item()
    err = abs(ours - ref) / abs(ref)
    check(f"{name}.peft_loss", err <= TOL and abs(ref - base) > 1e-4,
          f"(peft {ref:.8f}, luazero {ours:.8f}, relative {err:.2g}; base {base:.8f})")


def main():
    check = Checks("phi3")
    try:
        import peft
        import torch
        import transformers
    except ImportError as e:
        print(f"skip: cannot import {e.name}: run with the reference environment 5 "
              "(tests/ref/run.py test5_phi3.py)")
        return check.summary()
    transformers.logging.set_verbosity_error()
    print(f"transformers {transformers.__version__}, peft {peft.__version__}")
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.txt")
        with open(corpus, "w") as f:
            f.write("It was the best of times, it was the worst of times.\n" * 40)
        for name, config in configs(transformers):
            if len(sys.argv) > 1 and name not in sys.argv[1:]:
                continue
            torch.manual_seed(11)
            model = transformers.Phi3ForCausalLM._from_config(
                config, attn_implementation="eager").float()
            folder = os.path.join(tmp, name)
            model.save_pretrained(folder, safe_serialization=True)
            model.eval()
            init_case(check, torch, name, model, folder, tmp)
            export_case(check, transformers, torch, name, folder, corpus, tmp)
            generate_case(check, torch, name, model, folder, tmp)
            lora_case(check, torch, peft, name, model, folder, corpus, tmp)
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
