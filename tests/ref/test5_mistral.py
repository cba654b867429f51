"""test5_mistral.py — the Mistral family (models/mistral.lua) against
transformers 5.x's MistralForCausalLM, sliding window included.

A tiny random MistralForCausalLM (2 layers, dim 64, 4 query heads, 2
key/value heads, vocabulary 250 that luazero pads to 256, sliding_window 6:
shorter than every sequence here, so the window bites) is saved with
save_pretrained (config.json as 5.x writes it: rope_parameters, dtype).

  init      tests/ref/hf_loss.lua --init: the loss on a batch (T 16) equals
            transformers' within 1e-5 relative (fp32), and every parameter's
            gradient of that loss within 1e-4 (max |ours - theirs| / max
            |theirs|)
  export    scripts/train.lua --init, 20 steps, --save; tools/ckpt export:
            transformers loads the folder as is and its loss equals the
            checkpoint's (1e-5)
  generate  scripts/generate.lua --hf, greedy, 64 new tokens, prompts longer
            than the window (one batch, rows at different positions): the
            ids of transformers' generate(do_sample=False), each prompt alone
  lora      scripts/train.lua --init --lora-r 4 (Mistral's default targets,
            q_proj and v_proj), tools/ckpt export: PEFT loads the adapters on
            the same base, and its loss equals scripts/eval.lua --adapters'
            (1e-5); the adapter config names the targets

The window differs by one between transformers 4.40 (W + 1 keys) and 5.x (W
keys, as luazero), so this runs in the second reference environment:
    /root/.cache/luazero/ref5-venv/bin/python tests/ref/test5_mistral.py
    tests/ref/run.py test5_mistral.py       # ends with "N passed, N failed"
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks  # noqa: E402
from refenv import LUAZERO, REPO, VERSIONS5  # noqa: E402

WINDOW, NEW, TOL_LOSS, TOL_GRAD = 6, 64, 1e-5, 1e-4
PROMPTS = [[5, 17, 99, 3, 200, 41, 7, 9, 14, 100, 11, 3], [1, 2, 3, 4, 5, 6, 7, 8],
           [249, 0, 64, 12, 180, 2, 77, 150, 33, 9, 10, 48, 52, 7, 1, 90, 91, 120, 8, 5]]


def lz(*argv):
    r = subprocess.run([LUAZERO, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, cwd=REPO)
    return r.returncode, r.stdout


def last_json(out):
    return json.loads(out.strip().splitlines()[-1])


def ce(torch, model, x, y):
    with torch.no_grad():
        logits = model(x).logits.float()
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                   y.reshape(-1)))


def rel(a, b):
    return abs(a - b) / abs(b)


def main():
    check = Checks("mistral")
    try:
        import numpy as np
        import torch
        import transformers
        import peft
    except ImportError as e:
        print(f"skip: cannot import {e.name}: run with the second reference environment's "
              f"python (tests/ref/run.py {os.path.basename(__file__)})")
        return check.summary()
    if transformers.__version__ != VERSIONS5["transformers"]:
        print(f"skip: transformers {transformers.__version__}, not {VERSIONS5['transformers']}")
        return check.summary()
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(2)
    config = transformers.MistralConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=250, max_position_embeddings=128, rms_norm_eps=1e-5,
        initializer_range=0.3, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        sliding_window=WINDOW, attn_implementation="eager")
    torch.manual_seed(13)
    model = transformers.MistralForCausalLM(config).float().eval()

    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        model.save_pretrained(base, safe_serialization=True)
        with open(os.path.join(base, "config.json")) as f:
            written = json.load(f)
        check("config_is_5x", "rope_parameters" in written and written["sliding_window"] == WINDOW,
              f"(rope_parameters {written.get('rope_parameters')}, sliding_window "
              f"{written.get('sliding_window')})")

        # init: loss and gradients of one batch
        st, out = lz("tests/ref/hf_loss.lua", "--init", base, "--grads", tmp)
        if st != 0:
            check("init.runs", False, out[-2000:])
            return check.summary()
        res = last_json(out)
        tokens = torch.tensor(res["tokens"], dtype=torch.int64).reshape(2, 2, 16)
        ours = float(res["loss"])
        model.zero_grad()
        logits = model(tokens[0]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 tokens[1].reshape(-1))
        loss.backward()
        err = rel(ours, loss.item())
        check("init.loss", err <= TOL_LOSS, f"(luazero {ours:.8f}, transformers "
              f"{loss.item():.8f}, relative {err:.1e})")
        full = transformers.MistralForCausalLM(
            transformers.MistralConfig(**{**config.to_dict(), "sliding_window": None}))
        full.load_state_dict(model.state_dict())
        unwindowed = ce(torch, full.float().eval(), tokens[0], tokens[1])
        check("init.window_bites", rel(unwindowed, loss.item()) > 1e-4,
              f"(without the window {unwindowed:.8f})")
        with open(os.path.join(tmp, "params.json")) as f:
            table = json.load(f)
        grads = np.fromfile(os.path.join(tmp, "grads.f32"), dtype=np.float32)
        named = dict(model.named_parameters())
        worst, worst_name = 0.0, ""
        for e in table:
            g = grads[e["offset"]:e["offset"] + e["numel"]].reshape(e["shape"])
            theirs = named[e["name"]].grad.numpy()
            g = g[:theirs.shape[0]]  # the vocabulary's padding rows
            err = float(np.abs(g - theirs).max() / np.abs(theirs).max())
            if err > worst:
                worst, worst_name = err, e["name"]
        check(f"init.gradients_of_{len(table)}_parameters", worst <= TOL_GRAD,
              f"(worst {worst:.1e}: {worst_name})")

        # export after 20 steps
        corpus = os.path.join(tmp, "corpus.txt")
        with open(corpus, "w") as f:
            f.write("It was the best of times, it was the worst of times.\n" * 40)
        ck = os.path.join(tmp, "ck")
        st, out = lz("scripts/train.lua", "--init", base, "--data", corpus, "--steps", "20",
                     "--seq-len", "16", "--micro-batch", "2", "--sample", "0", "--lr", "1e-3",
                     "--save", ck)
        check("train_20_steps", st == 0, "" if st == 0 else out[-2000:])
        st, out = lz("tests/ref/hf_loss.lua", ck)
        check("trained.loss", st == 0, "" if st == 0 else out[-2000:])
        if st == 0:
            trained = float(last_json(out)["loss"])
            folder = os.path.join(tmp, "export")
            st, out = subprocess.run([os.path.join(REPO, "tools", "ckpt"), "export", ck, folder],
                                     capture_output=True, text=True, cwd=REPO).returncode, ""
            check("export", st == 0)
            try:
                back, info = transformers.AutoModelForCausalLM.from_pretrained(
                    folder, output_loading_info=True)
                bad = {k: v for k, v in info.items() if v}
                check("export.loads", not bad and type(back).__name__ == "MistralForCausalLM",
                      f"({type(back).__name__}, sliding_window {back.config.sliding_window}) "
                      f"{bad if bad else ''}")
                back = back.float().eval()
                theirs = ce(torch, back, tokens[0], tokens[1])
                err = rel(trained, theirs)
                check("export.loss", err <= TOL_LOSS and abs(trained - ours) > 1e-3,
                      f"(luazero {trained:.8f}, transformers {theirs:.8f}, relative {err:.1e}; "
                      f"at init {ours:.4f})")
            except Exception as e:  # noqa: BLE001 - a failure to load is the finding
                check("export.loads", False, repr(e))

        # generate: greedy, prompts longer than the window
        prompts = os.path.join(tmp, "prompts.jsonl")
        with open(prompts, "w") as f:
            for p in PROMPTS:
                f.write(json.dumps({"prompt_ids": p}) + "\n")
        gen = os.path.join(tmp, "gen.jsonl")
        st, out = lz("scripts/generate.lua", "--hf", base, "--prompts", prompts,
                     "--max-new-tokens", str(NEW), "--out", gen)
        if st != 0:
            check("generate.runs", False, out[-2000:])
        else:
            with open(gen) as f:
                got_all = [json.loads(line)["ids"] for line in f]
            for i, p in enumerate(PROMPTS):
                with torch.no_grad():
                    ref = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW,
                                         pad_token_id=config.eos_token_id)
                want = ref[0, len(p):].tolist()
                got = got_all[i] if i < len(got_all) else []
                first = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
                check(f"generate.prompt{i}_{len(p)}_tokens", got == want and len(want) > 8,
                      f"({len(want)} ids" + (f"; first difference at {first}" if first is not None
                                             else "") + ")")

        # lora: adapters into PEFT
        ck = os.path.join(tmp, "lora-ck")
        st, out = lz("scripts/train.lua", "--init", base, "--data", corpus, "--steps", "6",
                     "--seq-len", "16", "--micro-batch", "2", "--sample", "0", "--lora-r", "4",
                     "--lr", "0.01", "--save", ck)
        check("lora.train", st == 0, "" if st == 0 else out[-2000:])
        adapters = os.path.join(tmp, "adapters")
        st, out = lz("tools/ckpt.lua", "export", ck, adapters)
        check("lora.export", st == 0, "" if st == 0 else out[-2000:])
        if st == 0:
            with open(os.path.join(adapters, "adapter_config.json")) as f:
                targets = sorted(json.load(f)["target_modules"])
            check("lora.default_targets", targets == ["q_proj", "v_proj"], str(targets))
            ids = [(7 * i + 3) % 250 for i in range(17)]
            data = os.path.join(tmp, "one.bin")
            with open(data, "wb") as f:
                f.write(struct.pack("<256i", 20240520, 1, len(ids), *([0] * 253)))
                f.write(struct.pack(f"<{len(ids)}H", *ids))
            st, out = lz("scripts/eval.lua", "--hf", base, "--adapters", adapters, "--data", data,
                         "--micro-batch", "1", "--seq-len", "16")
            line = next((x for x in out.splitlines() if x.startswith("val_loss ")), None)
            if line is None:
                check("lora.eval", False, out[-2000:])
            else:
                got = float(line.split()[1])
                tuned = peft.PeftModel.from_pretrained(model, adapters).eval()
                x = torch.tensor([ids[:16]])
                theirs = ce(torch, tuned, x, torch.tensor([ids[1:]]))
                err = rel(got, theirs)
                check("lora.peft_loss", err <= TOL_LOSS,
                      f"(luazero {got:.8f}, peft {theirs:.8f}, relative {err:.1e})")
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
