"""test_llama.py — luazero's Llama kernels (RMSNorm, rotary embeddings,
with Llama 3's scaled frequencies too, SwiGLU, grouped-query attention) against the same layers written here from Hugging Face's Llama
equations (LlamaRMSNorm, LlamaRotaryEmbedding with apply_rotary_pos_emb and
rotate_half, LlamaMLP's silu(gate) * up), in fp32, backward through autograd.

Both sides read the same numpy arrays. Error of a tensor:

    err = max|ours - torch| / max(max|torch|, 1e-30)

and a check passes when err <= 1e-5. The kernels also take bf16 inputs
(fp32 arithmetic, f32 outputs): those are checked at the same 1e-5 against
the reference run in fp32 on the same bf16-rounded values, which is what the
kernels promise (no bf16 rounding of their own).

Rotary inverse frequencies: luazero rounds theta^(-2i/d), worked out in
double, to fp32. Hugging Face computes 1 / theta ** (arange(0, d, 2) / d) in
fp32 arithmetic, which lands up to a few fp32 ulps away; the angle
pos * inv_freq carries that difference times pos. The reference takes
luazero's inv_freq, so the checks at 1e-5 test the rest of the equations;
one more check takes Hugging Face's own inv_freq at positions below 64,
where that difference stays under the tolerance (worked out there).
Run with /usr/bin/python3 (Debian's python3-torch).
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import refenv  # noqa: E402

refenv.require_torch()
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import lz  # noqa: E402
from harness import TOL, check, check_true, randn_with, run, test, tt, zeros  # noqa: E402
from rope_ref import default_inv_freq, llama3_inv_freq, rotate_half  # noqa: E402

torch.set_num_threads(2)
randn = randn_with(np.random.default_rng(20250101))
W = lz.wrap


def refused(name, fn, needle):
    """fn() must raise LzError whose message holds needle."""
    try:
        fn()
    except lz.LzError as e:
        check_true(f"{name}: refused", needle in str(e), f"(message: {e})")
        return
    check_true(f"{name}: refused", False, "(no error)")


# ----------------------------------------------------------------- rmsnorm


def llama_rmsnorm(x, w, eps):
    """LlamaRMSNorm.forward."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return w * h.to(x.dtype)


@test
def rmsnorm():
    for (B, Tn, C) in ((2, 16, 64), (2, 5, 37), (4, 32, 1024), (1, 8, 4096 + 40)):
        x = randn(B, Tn, C, scale=2.0, shift=0.5)
        w, dy, dw0 = randn(C, scale=0.5, shift=1.0), randn(B, Tn, C), randn(C)
        out, rstd, dx, dw = zeros(B, Tn, C), zeros(B, Tn), zeros(B, Tn, C), dw0.copy()
        eps = 1e-6
        lz.call("lz_rmsnorm_forward", W(out), W(rstd), W(x), W(w), eps)
        lz.call("lz_rmsnorm_backward", W(dx), W(dw), W(dy), W(x), W(w), W(rstd))
        xt, wt = tt(x, True), tt(w, True)
        ref = llama_rmsnorm(xt, wt, eps)
        ref.backward(tt(dy))
        tag = f"rmsnorm [{B},{Tn},{C}]"
        check(f"{tag} forward", out, ref)
        check(f"{tag} rstd", rstd, torch.rsqrt(tt(x).pow(2).mean(-1) + eps))
        check(f"{tag} dx", dx, xt.grad)
        check(f"{tag} dw (accumulated onto dw0)", dw, tt(dw0) + wt.grad)
    # dx written over dy
    x, w, dy = randn(3, 100), randn(100), randn(3, 100)
    out, rstd, dw = zeros(3, 100), zeros(3), zeros(100)
    lz.call("lz_rmsnorm_forward", W(out), W(rstd), W(x), W(w), 1e-5)
    dyi = dy.copy()
    lz.call("lz_rmsnorm_backward", W(dyi), W(dw), W(dyi), W(x), W(w), W(rstd))
    xt = tt(x, True)
    llama_rmsnorm(xt, tt(w), 1e-5).backward(tt(dy))
    check("rmsnorm [3,100] dx written over dy", dyi, xt.grad)
    for C in (100, 4096 + 40):  # the one-pass and the two-pass backward
        (xb, xf), (wb, wf), (dyb, dyf) = (lz.bf16_round(randn(3, C, scale=2.0)),
                                          lz.bf16_round(randn(C, shift=1.0)),
                                          lz.bf16_round(randn(3, C)))
        out, rstd, dx, dw = zeros(3, C), zeros(3), zeros(3, C), zeros(C)
        lz.call("lz_rmsnorm_forward", W(out), W(rstd), W(xb, lz.BF16), W(wb, lz.BF16), 1e-5)
        lz.call("lz_rmsnorm_backward", W(dx), W(dw), W(dyb, lz.BF16), W(xb, lz.BF16),
                W(wb, lz.BF16), W(rstd))
        xt, wt = tt(xf, True), tt(wf, True)
        llama_rmsnorm(xt, wt, 1e-5).backward(tt(dyf))
        check(f"rmsnorm bf16 [3,{C}] forward", out, llama_rmsnorm(tt(xf), tt(wf), 1e-5))
        check(f"rmsnorm bf16 [3,{C}] dx", dx, xt.grad)
        check(f"rmsnorm bf16 [3,{C}] dw", dw, wt.grad)
    refused("rmsnorm bf16 x with an f32 w",
            lambda: lz.call("lz_rmsnorm_forward", W(out), W(rstd), W(xb, lz.BF16), W(wf), 1e-5),
            "both must be f32 or both bf16")


# -------------------------------------------------------------------- rope


def inv_freq_luazero(theta, d):
    return torch.tensor([np.float32(float(theta) ** (-2.0 * i / d)) for i in range(d // 2)],
                        dtype=torch.float32)


def llama_rope(x, n_head, head_dim, pos_offset, inv_freq):
    """x [B, T, n_head * head_dim] through LlamaRotaryEmbedding and
    apply_rotary_pos_emb (q laid out [B, n_head, T, head_dim])."""
    B, Tn, _ = x.shape
    position_ids = (torch.arange(Tn, dtype=torch.int64) + pos_offset)[None, :].expand(B, -1)
    inv_freq_expanded = inv_freq[None, :, None].float().expand(B, -1, 1)
    freqs = (inv_freq_expanded @ position_ids[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)
    q = x.view(B, Tn, n_head, head_dim).transpose(1, 2)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    return q_embed.transpose(1, 2).reshape(B, Tn, n_head * head_dim)


def rope_case(B, Tn, n_head, head_dim, pos_offset, theta):
    C = n_head * head_dim
    x, dy = randn(B, Tn, C), randn(B, Tn, C)
    out, dx = zeros(B, Tn, C), zeros(B, Tn, C)
    lz.call("lz_rope_forward", W(out), W(x), n_head, head_dim, pos_offset, theta)
    lz.call("lz_rope_backward", W(dx), W(dy), n_head, head_dim, pos_offset, theta)
    xt = tt(x, True)
    ref = llama_rope(xt, n_head, head_dim, pos_offset, inv_freq_luazero(theta, head_dim))
    ref.backward(tt(dy))
    tag = f"rope [{B},{Tn},{n_head}x{head_dim}] pos {pos_offset}+ theta {theta:g}"
    check(f"{tag} forward", out, ref)
    check(f"{tag} dx", dx, xt.grad)
    return x, out


@test
def rope():
    rope_case(2, 16, 4, 64, 0, 10000.0)
    rope_case(2, 32, 8, 128, 7, 10000.0)
    rope_case(1, 24, 3, 12, 1000, 500000.0)  # 2i/d not exact in fp32
    # in place: out over x, dx over dy
    x, out = rope_case(2, 8, 2, 16, 3, 10000.0)
    xi = x.copy()
    lz.call("lz_rope_forward", W(xi), W(xi), 2, 16, 3, 10000.0)
    check("rope [2,8,2x16] in place forward", xi, torch.from_numpy(out))
    lz.call("lz_rope_backward", W(xi), W(xi), 2, 16, 3, 10000.0)
    check("rope [2,8,2x16] backward of forward = x", xi, torch.from_numpy(x))
    # Hugging Face's own fp32 inv_freq, positions 0..63: for head_dim 128 and
    # theta 10000 it lies within 1 fp32 ulp (1.2e-7 relative) of luazero's,
    # so the angles differ by at most 63 * 1.2e-7 = 7.5e-6 rad, and so the
    # outputs (relative to the largest): 1e-5 holds.
    B, Tn, NH, HD = 1, 64, 4, 128
    hf, ours = default_inv_freq(10000.0, HD), inv_freq_luazero(10000.0, HD)
    ulps = int((hf.numpy().view(np.int32) - ours.numpy().view(np.int32)).__abs__().max())
    check_true("rope inv_freq: HF's fp32 within 1 ulp of luazero's (head_dim 128)", ulps <= 1,
               f"({ulps} ulps)")
    x = randn(B, Tn, NH * HD)
    out = zeros(B, Tn, NH * HD)
    lz.call("lz_rope_forward", W(out), W(x), NH, HD, 0, 10000.0)
    check(f"rope [1,{Tn},{NH}x{HD}] forward against HF's own fp32 inv_freq", out,
          llama_rope(tt(x), NH, HD, 0, hf))
    xb, xf = lz.bf16_round(x)
    lz.call("lz_rope_forward", W(out), W(xb, lz.BF16), NH, HD, 0, 10000.0)
    check(f"rope bf16 [1,{Tn},{NH}x{HD}] forward", out, llama_rope(tt(xf), NH, HD, 0, ours))
    lz.call("lz_rope_backward", W(out), W(xb, lz.BF16), NH, HD, 0, 10000.0)
    check(f"rope bf16 [1,{Tn},{NH}x{HD}] backward", out, llama_rope(tt(xf), NH, HD, 0, -ours))


@test
def rope_scaled():
    # Llama 3.1's rope_scaling on head_dim 128, theta 500000: the given
    # inv_freq turns the pairs, forward and backward (its transpose).
    B, Tn, NH, HD = 2, 48, 3, 128
    inv = llama3_inv_freq(500000.0, HD, dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                              original_max_position_embeddings=8192))
    x, dy = randn(B, Tn, NH * HD), randn(B, Tn, NH * HD)
    out, dx = zeros(B, Tn, NH * HD), zeros(B, Tn, NH * HD)
    freqs = inv.numpy().astype(np.float32)
    lz.call("lz_rope_freqs_forward", W(out), W(x), W(freqs), NH, 5)
    lz.call("lz_rope_freqs_backward", W(dx), W(dy), W(freqs), NH, 5)
    xt = tt(x, True)
    ref = llama_rope(xt, NH, HD, 5, inv)
    ref.backward(tt(dy))
    check(f"rope llama3-scaled [{B},{Tn},{NH}x{HD}] forward", out, ref)
    check(f"rope llama3-scaled [{B},{Tn},{NH}x{HD}] backward", dx, xt.grad)


# ------------------------------------------------------------------ swiglu


@test
def swiglu():
    for shape in ((2, 16, 172), (2, 64, 1376)):
        gate, up, dy = randn(*shape, scale=3.0), randn(*shape), randn(*shape)
        gate.flat[:3] = (30.0, -30.0, 0.0)  # saturated tails and the middle
        out, dgate, dup = zeros(*shape), zeros(*shape), zeros(*shape)
        lz.call("lz_swiglu_forward", W(out), W(gate), W(up))
        lz.call("lz_swiglu_backward", W(dgate), W(dup), W(dy), W(gate), W(up))
        gt, ut = tt(gate, True), tt(up, True)
        ref = F.silu(gt) * ut
        ref.backward(tt(dy))
        tag = f"swiglu {list(shape)}"
        check(f"{tag} forward", out, ref)
        check(f"{tag} dgate", dgate, gt.grad)
        check(f"{tag} dup", dup, ut.grad)
    (gb, gf), (ub, uf), (db, df) = (lz.bf16_round(gate), lz.bf16_round(up),
                                    lz.bf16_round(dy))
    lz.call("lz_swiglu_forward", W(out), W(gb, lz.BF16), W(ub, lz.BF16))
    lz.call("lz_swiglu_backward", W(dgate), W(dup), W(db, lz.BF16), W(gb, lz.BF16),
            W(ub, lz.BF16))
    gt, ut = tt(gf, True), tt(uf, True)
    ref = F.silu(gt) * ut
    ref.backward(tt(df))
    check("swiglu bf16 [2,64,1376] forward", out, ref)
    check("swiglu bf16 [2,64,1376] dgate", dgate, gt.grad)
    check("swiglu bf16 [2,64,1376] dup", dup, ut.grad)


# ------------------------------------------------------- grouped-query attention


def gqa_reference(qkv, NH, NKV, HD):
    """LlamaAttention's core: repeat_kv, causal softmax(q k^T / sqrt(hd)) v."""
    B, Tn, _ = qkv.shape
    q = qkv[..., :NH * HD].view(B, Tn, NH, HD).transpose(1, 2)
    k = qkv[..., NH * HD:(NH + NKV) * HD].view(B, Tn, NKV, HD).transpose(1, 2)
    v = qkv[..., (NH + NKV) * HD:].view(B, Tn, NKV, HD).transpose(1, 2)
    k = k.repeat_interleave(NH // NKV, dim=1)  # repeat_kv
    v = v.repeat_interleave(NH // NKV, dim=1)
    s = q @ k.transpose(2, 3) / math.sqrt(HD)
    mask = torch.full((Tn, Tn), float("-inf")).triu(1)
    p = torch.softmax(s + mask, dim=-1)
    return (p @ v).transpose(1, 2).reshape(B, Tn, NH * HD), torch.logsumexp(s + mask, dim=-1)


@test
def attention_gqa():
    for (B, Tn, NH, NKV, HD) in ((2, 33, 4, 2, 16), (1, 100, 8, 2, 64), (2, 70, 6, 1, 32)):
        row = (NH + 2 * NKV) * HD
        qkv, dout = randn(B, Tn, row), randn(B, Tn, NH * HD)
        out, lse, dqkv = zeros(B, Tn, NH * HD), zeros(B, NH, Tn), zeros(B, Tn, row)
        lz.call("lz_attention_gqa_forward", W(out), W(lse), W(qkv), NH, NKV)
        lz.call("lz_attention_gqa_backward", W(dqkv), W(dout), W(qkv), W(out), W(lse), NH, NKV)
        qt = tt(qkv, True)
        ref, ref_lse = gqa_reference(qt, NH, NKV, HD)
        ref.backward(tt(dout))
        tag = f"attention gqa B={B} T={Tn} NH={NH} NKV={NKV} hd={HD}"
        check(f"{tag} forward", out, ref)
        check(f"{tag} lse", lse, ref_lse)
        check(f"{tag} dqkv", dqkv, qt.grad)


def main():
    return run(f"test_llama: {lz.LIB_PATH}, torch {torch.__version__}, tolerance {TOL:.0e} "
               "(max|ours-torch| / max|torch|)")


if __name__ == "__main__":
    sys.exit(main())
