"""family_ref.py — what the reference tests of a model family share (not a
test itself): one tiny random *ForCausalLM of transformers, saved with
save_pretrained, against luazero's family of the same architecture.

  init_loss   scripts' --init reading of the folder (tests/ref/family_run.lua):
              the loss on a fixed batch equals transformers' within 1e-5
              relative (fp32)
  grads       one backward on that batch: every parameter's gradient within
              1e-4 relative (max |luazero - torch| / max |torch| per tensor)
  padding_idx the same with pad_token_id set to a token the batch holds:
              transformers' nn.Embedding(padding_idx) gives that row no
              gradient from the inputs, and neither does luazero
  generate    scripts/generate.lua --hf, greedy, 64 new tokens for each of
              several prompts: the ids of transformers' generate(do_sample=False)
  export      scripts/train.lua --init, 20 steps at ZeRO-3 on 2 ranks, --save;
              tools/ckpt export: transformers loads the folder with no missing
              or unexpected tensor, and its loss on a fixed batch equals
              luazero's from the checkpoint (tests/ref/hf_loss.lua) within 1e-5
  lora        scripts/train.lua --init --lora-r 4 (the family's default
              targets), tools/ckpt export: PeftModel.from_pretrained on the
              base gives the loss luazero gives with --adapters, within 1e-5

The weights are drawn with a wide initializer_range (the largest logit stands
clear of the next, so greedy decoding compares decisions, not rounding), and
every 1-D parameter (norm weights, biases) is moved off its start so each
one matters. The config sets no eos_token_id: generation runs all 64 tokens.

    run_family(check, name, transformers, torch, peft, model_class, config, targets=None)

The Gemma families keep test_gemma.py's checks (the same five, there on
transformers 4.40) with every norm weight drawn, after check_bites has shown
that each window, cap and scale of the config moves the loss:

    run_gemma(check, transformers, peft, model_class, config, bites, arch)
    sys.exit(gemma_main(name, test, build))   # a whole test5_gemma*.py
"""
import json
import os
import subprocess
import tempfile

from checks import Checks

from refenv import LUAZERO, REPO

NEW = 64
PROMPTS = [[5, 17, 99, 3, 200, 41, 7], [1], [120, 8, 8, 31],
           [249, 0, 64, 12, 180, 2, 77, 150, 33, 9, 10, 211, 4]]
TOL = 1e-5
GRAD_TOL = 1e-4
CORPUS = "It was the best of times, it was the worst of times; café, naïve, 東京.\n" * 40


def lz(*argv):
    """Runs the luazero executable in the repository: (exit status, output)."""
    r = subprocess.run([LUAZERO, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, errors="replace", cwd=REPO)
    return r.returncode, r.stdout


def last_json(out):
    return json.loads(out.strip().splitlines()[-1])


def batch_loss(torch, model, tokens):
    """Mean cross-entropy of the fixed batch (inputs then targets, 2 x 16)."""
    t = torch.tensor(tokens, dtype=torch.int64).reshape(2, 2, 16)
    logits = model(t[0]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             t[1].reshape(-1))


def rel(a, b):
    return abs(a - b) / abs(b)


def init_and_grads(check, name, torch, model, folder, tmp):
    gfile = os.path.join(tmp, "grads.f32")
    rc, out = lz("tests/ref/family_run.lua", "--init", folder, "--grads", gfile)
    if rc != 0:
        check(f"{name}.init_loss", False, out[-2000:])
        return
    res = last_json(out)
    model.zero_grad()
    loss = batch_loss(torch, model, res["tokens"])
    ours = float(res["loss"])
    err = rel(ours, loss.item())
    check(f"{name}.init_loss", err <= TOL,
          f"(luazero {ours:.9f}, transformers {loss.item():.9f}, relative {err:.1e})")
    loss.backward()
    with open(gfile, "rb") as f:
        flat = torch.frombuffer(bytearray(f.read()), dtype=torch.float32)
    theirs = dict(model.named_parameters())
    worst, where, seen = 0.0, "", 0
    for p in res["params"]:
        ref = theirs.get(p["name"])
        if ref is None:
            check(f"{name}.grads", False, f"transformers has no parameter {p['name']}")
            return
        g = flat[p["offset"]:p["offset"] + p["numel"]].reshape(p["shape"])
        g = g[:ref.shape[0]]  # the token tables: the real vocabulary's rows
        r = ref.grad
        e = float((g - r).abs().max() / r.abs().max().clamp_min(1e-30))
        seen += 1
        if e > worst:
            worst, where = e, p["name"]
    check(f"{name}.grads", worst <= GRAD_TOL and seen == len(theirs),
          f"({seen} of {len(theirs)} tensors, worst {worst:.1e} at {where})")


def padding_idx(check, name, torch, model, folder, tmp):
    import shutil
    from collections import Counter
    rc, out = lz("tests/ref/family_run.lua", "--init", folder)
    if rc != 0:
        check(f"{name}.padding_idx", False, out[-2000:])
        return
    tokens = last_json(out)["tokens"]
    pad = Counter(tokens[:len(tokens) // 2]).most_common(1)[0][0]  # an input token
    padded = os.path.join(tmp, "padded")
    shutil.rmtree(padded, ignore_errors=True)
    shutil.copytree(folder, padded)
    with open(os.path.join(padded, "config.json")) as f:
        config = json.load(f)
    config["pad_token_id"] = pad
    with open(os.path.join(padded, "config.json"), "w") as f:
        json.dump(config, f)
    emb = model.get_input_embeddings()
    kept = emb.padding_idx
    model.zero_grad()
    batch_loss(torch, model, tokens).backward()
    free = emb.weight.grad[pad].clone()  # the row's gradient without padding_idx
    emb.padding_idx = pad
    init_and_grads(check, f"{name}.padding_idx", torch, model, padded, tmp)
    moved = float((emb.weight.grad[pad] - free).abs().max())
    check(f"{name}.padding_idx_bites", moved > 1e-6,
          f"(token {pad}: its row's gradient moved by {moved:.1e})")
    emb.padding_idx = kept


def generate(check, name, torch, model, folder, tmp):
    prompts = os.path.join(tmp, "prompts.jsonl")
    with open(prompts, "w") as f:
        for p in PROMPTS:
            f.write(json.dumps({"prompt_ids": p}) + "\n")
    out_file = os.path.join(tmp, "gen.jsonl")
    rc, out = lz("scripts/generate.lua", "--hf", folder, "--prompts", prompts,
                 "--max-new-tokens", str(NEW), "--out", out_file)
    if rc != 0:
        check(f"{name}.generate", False, out[-2000:])
        return
    with open(out_file, encoding="utf-8", errors="replace") as f:  # text: raw byte tokens
        ours = [json.loads(line)["ids"] for line in f]
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p),
                                                                              dtype=torch.int64),
                                 do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
                                 pad_token_id=0)
        want = ref[0, len(p):].tolist()
        got = ours[i] if i < len(ours) else []
        first = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
        check(f"{name}.generate_prompt{i}", got == want and len(want) == NEW,
              f"({len(got)} ids" + (f"; first difference at {first}: {got[first]} vs "
                                    f"{want[first]}" if first is not None else "") + ")")


def export(check, name, transformers, torch, folder, corpus, tmp):
    ck, out_dir = os.path.join(tmp, "ck"), os.path.join(tmp, "exported")
    rc, out = lz("-n", "2", "scripts/train.lua", "--init", folder, "--data", corpus, "--steps",
                 "20", "--seq-len", "16", "--micro-batch", "2", "--sample", "0", "--stage", "3",
                 "--lr", "3e-3", "--save", ck)
    if rc != 0:
        check(f"{name}.export", False, out[-2000:])
        return
    rc, out = lz("tests/ref/hf_loss.lua", ck)
    rc2, out2 = lz("tools/ckpt.lua", "export", ck, out_dir)
    if rc != 0 or rc2 != 0:
        check(f"{name}.export", False, (out + out2)[-2000:])
        return
    res = last_json(out)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out_dir,
                                                                    output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    check(f"{name}.export_loads", not bad, f"({type(model).__name__}) {bad if bad else ''}")
    with torch.no_grad():
        loss = batch_loss(torch, model.float().eval(), res["tokens"]).item()
    ours = float(res["loss"])
    err = rel(ours, loss)
    check(f"{name}.export_loss", err <= TOL,
          f"(after 20 steps: luazero {ours:.9f}, transformers {loss:.9f}, relative {err:.1e})")


def lora(check, name, transformers, torch, peft, folder, corpus, tmp, want_targets=None):
    ck, peft_dir = os.path.join(tmp, "lora-ck"), os.path.join(tmp, "lora-peft")
    rc, out = lz("scripts/train.lua", "--init", folder, "--data", corpus, "--steps", "6",
                 "--seq-len", "16", "--micro-batch", "2", "--sample", "0", "--lora-r", "4",
                 "--lr", "5e-3", "--save", ck)
    rc2, out2 = (lz("tools/ckpt.lua", "export", ck, peft_dir) if rc == 0 else (1, ""))
    rc3, out3 = (lz("tests/ref/family_run.lua", "--hf", folder, "--adapters", peft_dir)
                 if rc2 == 0 else (1, ""))
    if rc3 != 0:
        check(f"{name}.lora_loss", False, (out + out2 + out3)[-2000:])
        return
    res = last_json(out3)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder).float()
    tuned = peft.PeftModel.from_pretrained(base, peft_dir).eval()
    with torch.no_grad():
        loss = batch_loss(torch, tuned, res["tokens"]).item()
    with open(os.path.join(peft_dir, "adapter_config.json")) as f:
        targets = sorted(json.load(f)["target_modules"])
    ours = float(res["loss"])
    err = rel(ours, loss)
    check(f"{name}.lora_loss", err <= TOL,
          f"(targets {targets}: luazero {ours:.9f}, peft {loss:.9f}, relative {err:.1e})")
    if want_targets is not None:
        check(f"{name}.lora_targets", targets == sorted(want_targets), str(targets))


def run_family(check, name, transformers, torch, peft, model_class, config, targets=None):
    """The checks above on a tiny model_class(config); targets: the LoRA
    targets the family's default must be (checked where given)."""
    torch.manual_seed(7)
    torch.set_num_threads(2)
    model = model_class(config)
    with torch.no_grad():  # norms and biases away from their start
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, name)
        model.save_pretrained(folder, safe_serialization=True)
        corpus = os.path.join(tmp, "corpus.txt")
        with open(corpus, "w", encoding="utf-8") as f:
            f.write(CORPUS)
        model = model.float().eval()
        init_and_grads(check, name, torch, model, folder, tmp)
        padding_idx(check, name, torch, model, folder, tmp)
        generate(check, name, torch, model, folder, tmp)
        export(check, name, transformers, torch, folder, corpus, tmp)
        if peft is not None:
            lora(check, name, transformers, torch, peft, folder, corpus, tmp, targets)


def import5(test):
    """(transformers, torch, peft) of the second reference environment, or
    None after a line saying the test skipped."""
    try:
        import peft
        import torch
        import transformers
    except ImportError as e:
        print(f"skip: {e}; run with the python of the second reference environment "
              f"(tests/ref/run.py {test})")
        return None
    transformers.logging.set_verbosity_error()
    return transformers, torch, peft


def run_gemma(check, transformers, peft, model_class, config, bites, arch):
    """test_gemma.py's checks of a tiny model_class(config) whose norm
    weights are drawn (N(0, 0.3): 1 + weight is tested); `bites`: each
    option's value that turns it off (test_gemma.check_bites), before PEFT
    wraps the model's projections in place."""
    import torch
    import test_gemma as g
    torch.manual_seed(3)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    if bites:
        g.check_bites(check, model_class, model, bites)
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        model.save_pretrained(base, safe_serialization=True)
        g.check_init(check, model, base, tmp)
        padding_idx(check, arch, torch, model, base, tmp)
        g.check_export(check, transformers, base, tmp, arch=arch)
        g.check_generate(check, model, base, tmp)
        g.check_lora(check, model, base, tmp, peft)


def gemma_main(name, test, build):
    """A Gemma test's main in the second reference environment: build(transformers)
    gives (model_class, config, bites) for run_gemma; the summary's exit status."""
    check = Checks(name)
    libs = import5(test)
    if libs is None:
        return check.summary()
    transformers, _, peft = libs
    model_class, config, bites = build(transformers)
    run_gemma(check, transformers, peft, model_class, config, bites, model_class.__name__)
    return check.summary()
