"""test_masking.py — masked loss and packed documents against transformers.

A tiny random LlamaForCausalLM (grouped-query attention) and GPT2LMHeadModel,
vocabulary 250 (luazero pads to 256), saved with save_pretrained and loaded
into luazero with --init's loader (tests/ref/masking_loss.lua: one forward
and backward, fp32). Compared, loss to 1e-5 relative and every parameter's
gradient to 1e-5 (max |luazero - torch| / max |torch|; padded vocabulary rows
must get no gradient):

  prompt   labels -100 on each row's prompt: transformers' own loss
           (CrossEntropyLoss(ignore_index=-100) on the shifted labels)
  packed   rows packing several documents (luazero: extra.pos restarting at
           each document, extra.seg its id; the first token of each document
           and a short prompt labelled -100), against
             - Llama: one transformers run with position_ids and a 4D
               block-diagonal causal attention mask [B, 1, T, T] (4.40's
               form: 1 where a query sees a key, 0 elsewhere)
             - both: each document run alone, losses combined as the mean
               over all counted targets (each document's loss weighted by
               its count)

transformers 4.40.2 comes from build/ref-venv (tools/setup) or LZ_REF_VENV;
without it this file says it skipped.
    /usr/bin/python3 tests/ref/test_masking.py     # ends with "N passed, N failed"
"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks  # noqa: E402
from refenv import LUAZERO, REPO, import_transformers  # noqa: E402

B, T, VOCAB = 2, 16, 250
DOCS = [[5, 7, 4], [3, 13]]  # document lengths in each row
PROMPTS = [5, 9]  # labels -100 on this many first tokens of each row (prompt case)
TOL_LOSS, TOL_GRAD = 1e-5, 1e-5

check = Checks("masking")


def tiny_model(transformers, family, folder):
    torch.manual_seed(11)
    if family == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="eager")
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
        model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():  # norms and biases away from their 1 and 0 starts
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    return model.float().eval()


def luazero_run(folder, tmp, batch, tag):
    out = os.path.join(tmp, tag)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "batch.json")
    with open(path, "w") as f:
        json.dump(batch, f)
    r = subprocess.run([LUAZERO, os.path.join(REPO, "tests", "ref", "masking_loss.lua"), folder,
                        path, out], capture_output=True, text=True, cwd=REPO)
    if r.returncode != 0:
        return None, r.stdout + r.stderr
    meta = json.load(open(os.path.join(out, "meta.json")))
    grads = np.fromfile(os.path.join(out, "grads.f32"), dtype=np.float32)
    return (float(meta["loss"]), meta["params"], grads), ""


def shifted(labels):
    """luazero's targets: the label of the next position (-100 past the end)."""
    y = torch.full_like(labels, -100)
    y[:, :-1] = labels[:, 1:]
    return y


def conv1d(name):
    """GPT-2's projections (Conv1D): their weights are stored transposed."""
    return name.endswith(".weight") and any(
        k in name for k in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))


def compare_grads(name, model, params, grads):
    named = dict(model.named_parameters())
    worst, worst_name, missing, pad_ok = 0.0, "", [], True
    for e in params:
        ours = grads[e["offset"]:e["offset"] + e["numel"]].reshape(e["shape"]).astype(np.float64)
        p = named.get(e["name"])
        if p is None or p.grad is None:
            missing.append(e["name"])
            continue
        ref = p.grad.detach().double().numpy()
        if conv1d(e["name"]):
            ref = ref.T  # GPT-2's Conv1D stores [in, out]
        if ref.shape != ours.shape and ref.shape[1:] == ours.shape[1:]:
            pad_ok = pad_ok and not np.any(ours[ref.shape[0]:])  # padded vocabulary rows
            ours = ours[:ref.shape[0]]
        scale = max(float(np.max(np.abs(ref))), 1e-30)
        err = float(np.max(np.abs(ours - ref))) / scale
        if err > worst:
            worst, worst_name = err, e["name"]
    check(f"{name}.parameters_match", not missing, f"(unmatched: {missing})" if missing else "")
    check(f"{name}.padded_rows_get_no_gradient", pad_ok)
    check(f"{name}.gradients", worst <= TOL_GRAD,
          f"(worst {worst:.3g} at {worst_name}, tolerance {TOL_GRAD:g})")


def compare_loss(name, ours, ref):
    err = abs(ours - ref) / abs(ref)
    check(f"{name}.loss", err <= TOL_LOSS,
          f"(luazero {ours:.8f}, transformers {ref:.8f}, relative {err:.2g}, "
          f"tolerance {TOL_LOSS:g})")


def packed_batch(tokens):
    """pos, seg and labels of rows packing DOCS: each document's first token,
    and the first two of documents longer than 3 (a prompt), labelled -100."""
    pos = torch.zeros(B, T, dtype=torch.int64)
    seg = torch.zeros(B, T, dtype=torch.int64)
    labels = tokens.clone()
    spans = []
    for b, lens in enumerate(DOCS):
        t = 0
        for d, n in enumerate(lens):
            pos[b, t:t + n] = torch.arange(n)
            seg[b, t:t + n] = d
            labels[b, t] = -100
            if n > 3:
                labels[b, t + 1] = -100
            spans.append((b, t, n))
            t += n
        assert t == T
    return pos, seg, labels, spans


def run_family(transformers, family, tmp):
    folder = os.path.join(tmp, family)
    model = tiny_model(transformers, family, folder)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (B, T), generator=g)

    # prompt: labels -100 on each row's prompt, no packing
    labels = tokens.clone()
    for b, p in enumerate(PROMPTS):
        labels[b, :p] = -100
    res, err = luazero_run(folder, tmp, {"B": B, "T": T, "tokens": tokens.flatten().tolist(),
                                         "targets": shifted(labels).flatten().tolist()},
                           family + "-prompt")
    check(f"{family}.prompt.luazero_ran", res is not None, err)
    if res:
        model.zero_grad()
        loss = model(input_ids=tokens, labels=labels).loss
        loss.backward()
        compare_loss(f"{family}.prompt", res[0], loss.item())
        compare_grads(f"{family}.prompt", model, res[1], res[2])

    # packed: documents side by side in each row
    pos, seg, labels, spans = packed_batch(tokens)
    res, err = luazero_run(folder, tmp, {
        "B": B, "T": T, "tokens": tokens.flatten().tolist(),
        "targets": shifted(labels).flatten().tolist(), "pos": pos.flatten().tolist(),
        "seg": seg.flatten().tolist()}, family + "-packed")
    check(f"{family}.packed.luazero_ran", res is not None, err)
    if not res:
        return

    # each document alone, weighted by its counted targets
    counts = [int((labels[b, t + 1:t + n] >= 0).sum()) for b, t, n in spans]
    total = sum(counts)
    model.zero_grad()
    combined = 0.0
    for (b, t, n), c in zip(spans, counts):
        if c == 0:
            continue
        loss = model(input_ids=tokens[b:b + 1, t:t + n], labels=labels[b:b + 1, t:t + n]).loss
        (loss * (c / total)).backward()
        combined += loss.item() * c / total
    compare_loss(f"{family}.packed_vs_documents_alone", res[0], combined)
    compare_grads(f"{family}.packed_vs_documents_alone", model, res[1], res[2])

    if family == "llama":
        visible = (seg[:, None, :, None] == seg[:, None, None, :]) & torch.ones(
            T, T, dtype=torch.bool).tril()
        mask = visible.float()
        model.zero_grad()
        loss = model(input_ids=tokens, labels=labels, position_ids=pos, attention_mask=mask).loss
        loss.backward()
        compare_loss(f"{family}.packed_vs_4d_mask", res[0], loss.item())
        compare_grads(f"{family}.packed_vs_4d_mask", model, res[1], res[2])


def main():
    transformers = import_transformers()
    if transformers is None:
        return check.summary()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for family in ("llama", "gpt2"):
            run_family(transformers, family, tmp)
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
