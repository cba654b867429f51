"""test_generate.py — scripts/generate.lua's greedy decoding against
transformers' generate(do_sample=False), token for token.

A tiny random LlamaForCausalLM (grouped-query attention, 2 layers, vocabulary
250 that luazero pads to 256) and a tiny random GPT2LMHeadModel are saved with
save_pretrained (config.json, model.safetensors); scripts/generate.lua --hf
reads the folder and continues several prompts of different lengths at once
(one batch: rows at different positions in the key/value cache), greedy. Each
prompt's new ids must equal transformers' generate of that prompt alone,
max_new_tokens the same, stopping at the config's eos_token_id as
transformers does. The weights are drawn with a wide initializer_range so the
largest logit stands clear of the next (a near tie would compare rounding
noise, not decoding).

First the kernel: lz_attention_decode (core/kernels/attention_decode.c)
against PyTorch's softmax(q k^T / sqrt(hd)) v over each row's cached keys and
the new ones (causal among the new), multi-head and grouped-query, rows at
different positions, one new position and several: out within 1e-5
relative, the new keys and values written at each row's position; with a
bf16 cache, against the same on the bf16-rounded keys and values (within
1e-2 where head_dim is a multiple of 32: the bf16 attention kernel's path,
where the CPU has AVX-512 BF16, rounds the query too).

transformers 4.40.2 comes from build/ref-venv (tools/setup) or LZ_REF_VENV;
without it the comparison with generate() says it skipped.
    /usr/bin/python3 tests/ref/test_generate.py     # ends with "N passed, N failed"
"""
import json
import math
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks  # noqa: E402
from refenv import LUAZERO, REPO, import_transformers  # noqa: E402

NEW = 24
PROMPTS = [[5, 17, 99, 3, 200, 41, 7], [1], [120, 8, 8, 31], [249, 0, 64, 12, 180, 2, 77, 150,
                                                               33, 9, 10]]


def models(transformers):
    llama = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=250, max_position_embeddings=64, rms_norm_eps=1e-5,
        rope_theta=10000.0, initializer_range=0.3, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2)
    gpt2 = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=250, initializer_range=0.3,
        bos_token_id=248, eos_token_id=249, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return [("llama", transformers.LlamaForCausalLM, llama),
            ("gpt2", transformers.GPT2LMHeadModel, gpt2)]


def decode_kernel(check):
    """lz_attention_decode against torch, f32 and bf16 caches."""
    import ctypes
    import numpy as np
    import lz
    T = lz.T
    lz.lib.lz_attention_decode.argtypes = [T, T, T, T, T, ctypes.c_int, ctypes.c_int]
    lz.lib.lz_attention_decode.restype = ctypes.c_int
    rng = np.random.default_rng(3)
    for (NH, NKV, HS, S, pos, Tq) in ((4, 4, 16, 40, [0, 7, 31], 1), (4, 2, 16, 40, [3, 20], 5),
                                      (6, 2, 24, 300, [250, 0], 1), (2, 1, 64, 9, [0], 9)):
        B, kvw = len(pos), NKV * HS
        W = (NH + 2 * NKV) * HS
        for dtype in ("f32", "bf16"):
            qkv = rng.standard_normal((B, Tq, W), dtype=np.float32) * 1.5
            old = rng.standard_normal((2, B, S, kvw), dtype=np.float32)
            if dtype == "bf16":
                kb, kf = lz.bf16_round(old[0])
                vb, vf = lz.bf16_round(old[1])
                kc, vc, kd = kb.copy(), vb.copy(), lz.BF16
            else:
                kc, vc, kf, vf, kd = old[0].copy(), old[1].copy(), old[0], old[1], None
            out = np.zeros((B, Tq, NH * HS), dtype=np.float32)
            p = np.array(pos, dtype=np.int32)
            lz.call("lz_attention_decode", lz.wrap(out), lz.wrap(qkv), lz.wrap(kc, kd),
                    lz.wrap(vc, kd), lz.wrap(p), NH, NKV)
            worst, written = 0.0, True
            for b in range(B):
                n = pos[b] + Tq
                newk = qkv[b, :, NH * HS:NH * HS + kvw]
                newv = qkv[b, :, NH * HS + kvw:]
                if dtype == "bf16":
                    newk, newv = lz.bf16_round(newk)[1], lz.bf16_round(newv)[1]
                    got_k = (kc[b, pos[b]:n].astype(np.uint32) << 16).view(np.float32)
                    got_v = (vc[b, pos[b]:n].astype(np.uint32) << 16).view(np.float32)
                else:
                    got_k, got_v = kc[b, pos[b]:n], vc[b, pos[b]:n]
                written = written and np.array_equal(got_k, newk) and np.array_equal(got_v, newv)
                keys = torch.from_numpy(np.concatenate([kf[b, :pos[b]], newk]))
                vals = torch.from_numpy(np.concatenate([vf[b, :pos[b]], newv]))
                q = torch.from_numpy(qkv[b, :, :NH * HS].copy()).view(Tq, NH, HS).transpose(0, 1)
                k = keys.view(n, NKV, HS).transpose(0, 1).repeat_interleave(NH // NKV, dim=0)
                v = vals.view(n, NKV, HS).transpose(0, 1).repeat_interleave(NH // NKV, dim=0)
                scores = (q.double() @ k.double().transpose(1, 2)) / math.sqrt(HS)
                mask = torch.ones(Tq, n, dtype=torch.bool).triu(pos[b] + 1)
                ref = torch.softmax(scores.masked_fill(mask, float("-inf")), -1) @ v.double()
                ref = ref.transpose(0, 1).reshape(Tq, NH * HS)
                err = float((torch.from_numpy(out[b]).double() - ref).abs().max() /
                            ref.abs().max())
                worst = max(worst, err)
            lz.release()
            tag = f"kernel NH={NH} NKV={NKV} HS={HS} pos={pos} T={Tq} {dtype}"
            tol = 1e-2 if dtype == "bf16" and HS % 32 == 0 else 1e-5
            check(f"{tag} out", worst <= tol, f"err {worst:.2e}")
            check(f"{tag} cache written", written)


def main():
    check = Checks("generate")

    decode_kernel(check)
    transformers = import_transformers()
    if transformers is None:
        return check.summary()

    for name, cls, config in models(transformers):
        torch.manual_seed(11)
        model = cls(config).eval()
        with tempfile.TemporaryDirectory() as tmp:
            folder = os.path.join(tmp, name)
            model.save_pretrained(folder, safe_serialization=True)
            prompts = os.path.join(tmp, "prompts.jsonl")
            with open(prompts, "w") as f:
                for p in PROMPTS:
                    f.write(json.dumps({"prompt_ids": p}) + "\n")
            out = os.path.join(tmp, "out.jsonl")
            run = subprocess.run([LUAZERO, os.path.join(REPO, "scripts", "generate.lua"), "--hf",
                                  folder, "--prompts", prompts, "--max-new-tokens", str(NEW),
                                  "--out", out], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, cwd=REPO)
            if run.returncode != 0:
                check(f"{name}.runs", False, run.stdout[-2000:])
                continue
            with open(out) as f:
                ours = [json.loads(line) for line in f]
            check(f"{name}.one_record_per_prompt", len(ours) == len(PROMPTS), str(len(ours)))
            for i, p in enumerate(PROMPTS):
                with torch.no_grad():
                    ref = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW,
                                         pad_token_id=config.eos_token_id)
                want = ref[0, len(p):].tolist()
                got = ours[i]["ids"] if i < len(ours) else []
                first = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
                check(f"{name}.prompt{i}_greedy_ids", got == want,
                      f"({len(want)} ids" + (f"; first difference at {first}: {got[first]} vs "
                                             f"{want[first]}" if first is not None else "") +
                      (f"; ours {got} theirs {want}" if got != want else "") + ")")
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
