"""test_attention_bf16.py — the attention of bf16 training (lz_attention_bf16_*:
its tile products on bf16 operands, fp32 accumulation) against PyTorch's
attention in fp32, with grouped-query heads, windows, soft-capping, a scale
and document masks; forward, lse and the gradient of q|k|v through autograd.

Error as in test_kernels.py (the worst difference relative to the tensor's
largest magnitude). Rounding the products' operands to bf16 (8 bits) costs a
few 1e-3 of that; a check passes at 2e-2, and the fp32 entries on the same
inputs still pass test_kernels' 1e-5 (asserted here too, so a broken
reference cannot pass both). Run with /usr/bin/python3 (Debian's python3-torch).
"""
import math
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import refenv  # noqa: E402

refenv.require_torch()
import numpy as np  # noqa: E402
import torch  # noqa: E402
import lz  # noqa: E402
from harness import TOL, check, check_true, randn_with, run, test, tt, zeros  # noqa: E402

torch.set_num_threads(2)
rng = np.random.default_rng(20251205)
randn = randn_with(rng)
W = lz.wrap
BF16_TOL = 2e-2


def torch_attention(qkv, seg, NH, NKV, HS, window, cap, scale):
    B, Tn, _ = qkv.shape
    q = qkv[..., :NH * HS].view(B, Tn, NH, HS).transpose(1, 2)
    k = qkv[..., NH * HS:(NH + NKV) * HS].view(B, Tn, NKV, HS).transpose(1, 2)
    v = qkv[..., (NH + NKV) * HS:].view(B, Tn, NKV, HS).transpose(1, 2)
    k = k.repeat_interleave(NH // NKV, dim=1)
    v = v.repeat_interleave(NH // NKV, dim=1)
    s = (q @ k.transpose(-2, -1)) * (scale or 1.0 / math.sqrt(HS))
    if cap:
        s = cap * torch.tanh(s / cap)
    i = torch.arange(Tn).view(Tn, 1)
    j = torch.arange(Tn).view(1, Tn)
    hidden = (j > i).expand(B, 1, Tn, Tn)
    if window:
        hidden = hidden | (i - j >= window)
    if seg is not None:
        sg = torch.from_numpy(seg)
        hidden = hidden | (sg.view(B, 1, Tn, 1) != sg.view(B, 1, 1, Tn))
    s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    y = torch.softmax(s, dim=-1) @ v
    return y.transpose(1, 2).reshape(B, Tn, NH * HS), lse


@test
def attention_bf16_options():
    cases = (  # B, T, NH, NKV, HS, window, cap, scale, documents
        (2, 100, 4, 4, 64, 0, 0.0, 0.0, 0),
        (1, 200, 4, 2, 32, 0, 0.0, 0.0, 0),
        (1, 150, 6, 2, 64, 40, 0.0, 0.0, 0),
        (2, 90, 4, 1, 32, 0, 3.0, 0.0, 0),
        (1, 130, 2, 2, 48, 0, 0.0, 0.3, 0),
        (2, 120, 4, 2, 32, 0, 0.0, 0.0, 3),
        (1, 170, 4, 2, 32, 20, 2.5, 0.2, 2),
    )
    for (B, Tn, NH, NKV, HS, window, cap, scale, docs) in cases:
        row = (NH + 2 * NKV) * HS
        qkv = randn(B, Tn, row)
        dout = randn(B, Tn, NH * HS)
        seg = None
        if docs:
            t = np.arange(Tn)
            seg = np.stack([(t * t * docs) // (Tn * Tn) + b for b in range(B)]).astype(np.int32)
        qt = tt(qkv, True)
        ref, ref_lse = torch_attention(qt, seg, NH, NKV, HS, window, cap, scale)
        ref.backward(tt(dout))
        tag = (f"B={B} T={Tn} NH={NH} NKV={NKV} HS={HS} window={window} cap={cap} "
               f"scale={scale} docs={docs}")
        for entry, tol in (("bf16", BF16_TOL), ("opts", TOL)):
            out, lse, dqkv = zeros(B, Tn, NH * HS), zeros(B, NH, Tn), zeros(B, Tn, row)
            sg = W(seg) if seg is not None else None
            lz.call(f"lz_attention_{entry}_forward", W(out), W(lse), W(qkv), sg, NH, NKV, window,
                    cap, scale)
            lz.call(f"lz_attention_{entry}_backward", W(dqkv), W(dout), W(qkv), W(out), W(lse),
                    sg, NH, NKV, window, cap, scale)
            check(f"{entry} {tag} out", out, ref, tol)
            check(f"{entry} {tag} lse", lse, ref_lse, tol)
            check(f"{entry} {tag} dqkv", dqkv, qt.grad, tol)


def override_child():
    """Under LZ_BF16_ATTENTION (set by the parent): the bf16 entries' bytes
    against the fp32 entries' on one case, or the refusal of a bad value."""
    B, Tn, NH, NKV, HS = 1, 150, 4, 2, 32
    row = (NH + 2 * NKV) * HS
    qkv, dout = randn(B, Tn, row), randn(B, Tn, NH * HS)
    got = {}
    for entry in ("bf16", "opts"):
        out, lse, dqkv = zeros(B, Tn, NH * HS), zeros(B, NH, Tn), zeros(B, Tn, row)
        try:
            lz.call(f"lz_attention_{entry}_forward", W(out), W(lse), W(qkv), None, NH, NKV, 0,
                    0.0, 0.0)
            lz.call(f"lz_attention_{entry}_backward", W(dqkv), W(dout), W(qkv), W(out), W(lse),
                    None, NH, NKV, 0, 0.0, 0.0)
        except Exception as e:  # noqa: BLE001 - the refusal is what is printed
            print(f"refused: {e}")
            return 0
        got[entry] = out.tobytes() + lse.tobytes() + dqkv.tobytes()
    print("bitwise" if got["bf16"] == got["opts"] else "differ")
    return 0


def with_override(value):
    env = dict(os.environ, LZ_BF16_ATTENTION=value)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--override-child"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr


@test
def attention_bf16_override():
    """LZ_BF16_ATTENTION=f32 makes the bf16 entries the fp32 ones, bit for
    bit; native rounds (where the CPU has AVX512-BF16); a bad value is
    refused naming the variable."""
    check_true("LZ_BF16_ATTENTION=f32: bf16 entries are the fp32 ones",
               with_override("f32") == "bitwise")
    if lz.lib.lz_cpu_has(b"avx512bf16"):
        check_true("LZ_BF16_ATTENTION=native: bf16 entries round",
                   with_override("native") == "differ")
    said = with_override("fast")
    check_true(f"LZ_BF16_ATTENTION=fast is refused ({said[:90]})",
               said.startswith("refused") and "LZ_BF16_ATTENTION is 'fast'" in said)


if __name__ == "__main__":
    if sys.argv[1:] == ["--override-child"]:
        sys.exit(override_child())
    sys.exit(run(f"test_attention_bf16: {lz.LIB_PATH}, torch {torch.__version__}"))
