"""test_kernels.py — luazero's CPU kernels against the same ops in PyTorch.

Both sides read the same numpy arrays (luazero through lz_tensor_wrap), and
PyTorch computes in fp32, backward through autograd. Error of a tensor:

    err = max|ours - torch| / max(max|torch|, 1e-30)

(the worst difference relative to the tensor's largest magnitude), and a
check passes when err <= 1e-5. NaN anywhere fails. bf16 GEMMs take
bf16-rounded inputs on both sides (their products are exact in fp32), so the
same 1e-5 applies. Run with /usr/bin/python3 (Debian's python3-torch).
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
from harness import (TOL, check, check_true, randn_with, rel_err, run, test, tt,  # noqa: E402
                     zeros)

torch.set_num_threads(2)
rng = np.random.default_rng(20240520)
randn = randn_with(rng)
W = lz.wrap  # lz_tensor* over an array, alive until the test ends

# ------------------------------------------------------------------ metric


@test
def metric_can_fail():
    """The comparison rejects a 2e-5 error and a NaN: the tests can fail."""
    ref = torch.from_numpy(randn(64, 64))
    bad = ref.numpy().copy()
    bad[3, 5] += 2e-5 * float(ref.abs().max())
    nan = ref.numpy().copy()
    nan[0, 0] = np.nan
    check_true("metric: 2e-5 relative error is caught", rel_err(bad, ref) > TOL)
    check_true("metric: NaN is caught", not (rel_err(nan, ref) <= TOL))
    check_true("metric: identical arrays pass", rel_err(ref.numpy(), ref) == 0.0)


# ------------------------------------------------------------------ matmul


@test
def matmul_2d():
    M, N, K = 96, 80, 112
    for ta in (0, 1):
        for tb in (0, 1):
            a = randn(*((K, M) if ta else (M, K)))
            b = randn(*((N, K) if tb else (K, N)))
            c0 = randn(M, N)
            c = c0.copy()
            lz.call("lz_matmul", W(c), W(a), W(b), ta, tb, 0.5, 0.25)
            ta_ = tt(a).T if ta else tt(a)
            tb_ = tt(b).T if tb else tt(b)
            ref = 0.5 * (ta_ @ tb_) + 0.25 * tt(c0)
            check(f"matmul [{M}x{K}]x[{K}x{N}] ta={ta} tb={tb} alpha=.5 beta=.25", c, ref)


@test
def matmul_batched():
    B, M, N, K = 8, 64, 64, 32  # attention-like: [B*NH, T, hs]
    a, b = randn(B, M, K), randn(B, N, K)
    c = zeros(B, M, N)
    lz.call("lz_matmul", W(c), W(a), W(b), 0, 1, 1.0 / math.sqrt(K), 0.0)
    check(f"matmul batched [{B},{M},{K}]x[{B},{N},{K}]^T", c,
          torch.bmm(tt(a), tt(b).transpose(1, 2)) / math.sqrt(K))
    bs = randn(K, N)  # one b shared by every batch
    c = zeros(B, M, N)
    lz.call("lz_matmul", W(c), W(a), W(bs), 0, 0, 1.0, 0.0)
    check(f"matmul batched [{B},{M},{K}]x[{K},{N}] shared b", c, tt(a) @ tt(bs))


@test
def matmul_bf16():  # either bf16 path (test_kernels_bf16 runs both)
    M, N, K = 128, 96, 256
    ab, af = lz.bf16_round(randn(M, K))
    bb, bf = lz.bf16_round(randn(N, K))
    c = zeros(M, N)
    lz.call("lz_matmul", W(c), W(ab, lz.BF16), W(bb, lz.BF16), 0, 1, 1.0, 0.0)
    check(f"matmul bf16 [{M}x{K}]x[{N}x{K}]^T (fp32 accumulation)", c, tt(af) @ tt(bf).T)


# ------------------------------------------------------------------ linear


def linear_case(B, Tn, C, OC, bf16=False):
    x, w, b, dy = randn(B, Tn, C), randn(OC, C, scale=0.02), randn(OC), randn(B, Tn, OC)
    dt = lz.F32
    if bf16:
        (xb, x), (wb, w), (dyb, dy) = lz.bf16_round(x), lz.bf16_round(w), lz.bf16_round(dy)
        dt = lz.BF16
    else:
        xb, wb, dyb = x, w, dy
    out, dx, dw, db = zeros(B, Tn, OC), zeros(B, Tn, C), zeros(OC, C), zeros(OC)
    lz.call("lz_linear_forward", W(out), W(xb, dt), W(wb, dt), W(b))
    lz.call("lz_linear_backward", W(dx), W(dw), W(db), W(dyb, dt), W(xb, dt), W(wb, dt))
    xt, wt, bt = tt(x, True), tt(w, True), tt(b, True)
    ref = F.linear(xt, wt, bt)
    ref.backward(tt(dy))
    tag = f"linear{' bf16' if bf16 else ''} [{B},{Tn},{C}]->{OC}"
    check(f"{tag} forward", out, ref)
    check(f"{tag} dx", dx, xt.grad)
    check(f"{tag} dw", dw, wt.grad)
    check(f"{tag} db", db, bt.grad)


@test
def linear():
    linear_case(2, 32, 128, 384)  # qkv
    linear_case(2, 64, 128, 512)  # fc
    linear_case(2, 64, 512, 128)  # fc proj
    # no bias; dw accumulates onto what is there
    x, w = randn(2, 16, 64), randn(96, 64)
    out = zeros(2, 16, 96)
    lz.call("lz_linear_forward", W(out), W(x), W(w), None)
    check("linear [2,16,64]->96 without bias", out, tt(x) @ tt(w).T)
    dy, dw0 = randn(2, 16, 96), randn(96, 64)
    dw = dw0.copy()
    lz.call("lz_linear_backward", None, W(dw), None, W(dy), W(x), W(w))
    check("linear backward dw accumulates (+=)", dw,
          tt(dw0) + tt(dy).reshape(-1, 96).T @ tt(x).reshape(-1, 64))


@test
def linear_bf16():
    linear_case(2, 32, 128, 384, bf16=True)


# --------------------------------------------------------------- layernorm


@test
def layernorm():
    for (B, Tn, C) in ((2, 16, 64), (2, 64, 128), (4, 64, 768)):
        x = randn(B, Tn, C, scale=3.0, shift=5.0)  # offset mean: variance must not cancel
        w, b, dy = randn(C, scale=0.5, shift=1.0), randn(C), randn(B, Tn, C)
        out, mean, rstd = zeros(B, Tn, C), zeros(B, Tn), zeros(B, Tn)
        dx, dw, db = zeros(B, Tn, C), zeros(C), zeros(C)
        eps = 1e-5
        lz.call("lz_layernorm_forward", W(out), W(mean), W(rstd), W(x), W(w), W(b), eps)
        lz.call("lz_layernorm_backward", W(dx), W(dw), W(db), W(dy), W(x), W(w), W(mean),
                W(rstd))
        xt, wt, bt = tt(x, True), tt(w, True), tt(b, True)
        ref = F.layer_norm(xt, (C,), wt, bt, eps)
        ref.backward(tt(dy))
        xd = tt(x)
        tag = f"layernorm [{B},{Tn},{C}]"
        check(f"{tag} forward", out, ref)
        check(f"{tag} mean", mean, xd.mean(-1))
        check(f"{tag} rstd", rstd, 1.0 / torch.sqrt(xd.var(-1, unbiased=False) + eps))
        check(f"{tag} dx", dx, xt.grad)
        check(f"{tag} dw", dw, wt.grad)
        check(f"{tag} db", db, bt.grad)


# -------------------------------------------------------------------- gelu


@test
def gelu():
    for shape in ((2, 32, 256), (2, 64, 512)):
        x = randn(*shape, scale=2.0)
        x.flat[:4] = (12.0, -12.0, 0.0, -30.0)  # saturated tails
        dy = randn(*shape)
        out, dx = zeros(*shape), zeros(*shape)
        lz.call("lz_gelu_forward", W(out), W(x))
        lz.call("lz_gelu_backward", W(dx), W(dy), W(x))
        xt = tt(x, True)
        ref = F.gelu(xt, approximate="tanh")
        ref.backward(tt(dy))
        check(f"gelu {list(shape)} forward", out, ref)
        check(f"gelu {list(shape)} dx", dx, xt.grad)
    # in place: out aliases x, dx aliases dy
    x, dy = randn(4096), randn(4096)
    xi, dyi = x.copy(), dy.copy()
    lz.call("lz_gelu_backward", W(dyi), W(dyi), W(x))
    lz.call("lz_gelu_forward", W(xi), W(xi))
    xt = tt(x, True)
    ref = F.gelu(xt, approximate="tanh")
    ref.backward(tt(dy))
    check("gelu [4096] in place forward", xi, ref)
    check("gelu [4096] in place dx (aliases dy)", dyi, xt.grad)


# --------------------------------------------------------------- attention


def torch_attention(qkv, B, Tn, C, NH):
    hs = C // NH
    q, k, v = qkv.split(C, dim=2)
    q = q.view(B, Tn, NH, hs).transpose(1, 2)
    k = k.view(B, Tn, NH, hs).transpose(1, 2)
    v = v.view(B, Tn, NH, hs).transpose(1, 2)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
    mask = torch.ones(Tn, Tn, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    y = F.softmax(scores, dim=-1) @ v
    return y.transpose(1, 2).reshape(B, Tn, C), lse


@test
def attention():
    # several 64-key tiles, T not a multiple of a tile, GPT-2's head size 64,
    # and a head size that is not a multiple of a vector
    for (B, Tn, C, NH) in ((2, 16, 64, 4), (2, 64, 128, 4), (2, 200, 256, 4),
                           (1, 130, 768, 12), (1, 100, 72, 3)):
        qkv = randn(B, Tn, 3 * C, scale=1.5)
        dout = randn(B, Tn, C)
        out, lse, dqkv = zeros(B, Tn, C), zeros(B, NH, Tn), zeros(B, Tn, 3 * C)
        lz.call("lz_attention_forward", W(out), W(lse), W(qkv), NH)
        lz.call("lz_attention_backward", W(dqkv), W(dout), W(qkv), W(out), W(lse), NH)
        qt = tt(qkv, True)
        ref, ref_lse = torch_attention(qt, B, Tn, C, NH)
        ref.backward(tt(dout))
        tag = f"attention B={B} T={Tn} C={C} NH={NH}"
        check(f"{tag} forward", out, ref)
        check(f"{tag} lse", lse, ref_lse)
        check(f"{tag} dqkv", dqkv, qt.grad)


# --------------------------------------------------------------- embedding


@test
def embedding():
    for (B, Tn, C, V, maxT) in ((2, 16, 64, 256, 16), (2, 64, 128, 256, 128),
                                (2, 32, 768, 1000, 64)):
        tokens = rng.integers(0, V, size=(B, Tn), dtype=np.int32)
        tokens[0, :4] = 7  # repeats: gradients of one row add up
        wte, wpe = randn(V, C, scale=0.02), randn(maxT, C, scale=0.01)
        dout = randn(B, Tn, C)
        out, dwte, dwpe = zeros(B, Tn, C), zeros(V, C), zeros(maxT, C)
        lz.call("lz_embedding_forward", W(out), W(tokens), W(wte), W(wpe))
        lz.call("lz_embedding_backward", W(dwte), W(dwpe), W(dout), W(tokens))
        wt, pt = tt(wte, True), tt(wpe, True)
        ref = F.embedding(torch.from_numpy(tokens).long(), wt) + pt[:Tn]
        ref.backward(tt(dout))
        tag = f"embedding B={B} T={Tn} C={C} V={V} wpe rows {maxT}"
        check(f"{tag} forward", out, ref)
        check(f"{tag} dwte", dwte, wt.grad)
        check(f"{tag} dwpe", dwpe, pt.grad)


# ----------------------------------------------------------- cross-entropy


@test
def cross_entropy():
    for (B, Tn, V, Vp) in ((2, 32, 256, 256), (2, 32, 250, 256), (2, 16, 50257, 50304)):
        logits = randn(B, Tn, Vp, scale=2.0)
        logits[..., V:] = 1e4  # padding must not take part, whatever it holds
        targets = rng.integers(0, V, size=(B, Tn), dtype=np.int32)
        targets[1, 3] = -1  # ignored position
        targets[0, 0] = V - 1
        losses, dlogits = zeros(B, Tn), zeros(B, Tn, Vp)
        dloss = 1.0 / (B * Tn)
        lz.call("lz_cross_entropy_forward", W(losses), W(logits), W(targets), V)
        lz.call("lz_cross_entropy_backward", W(dlogits), W(logits), W(targets), V, dloss)
        lt = tt(logits, True)
        tg = torch.from_numpy(targets).long()
        ref = F.cross_entropy(lt[..., :V].reshape(-1, V), tg.reshape(-1), ignore_index=-1,
                              reduction="none").view(B, Tn)
        (ref * dloss).sum().backward()
        tag = f"cross_entropy B={B} T={Tn} V={V} Vp={Vp}"
        check(f"{tag} losses", losses, ref)
        check(f"{tag} dlogits (dloss=1/(B*T))", dlogits, lt.grad)
        check_true(f"{tag} ignored position: loss 0, gradient 0",
                   losses[1, 3] == 0.0 and not dlogits[1, 3].any())
    # dlogits aliasing logits
    B, Tn, V = 2, 16, 256
    logits = randn(B, Tn, V, scale=2.0)
    targets = rng.integers(0, V, size=(B, Tn), dtype=np.int32)
    inplace = logits.copy()
    lz.call("lz_cross_entropy_backward", W(inplace), W(inplace), W(targets), V, 0.5)
    lt = tt(logits, True)
    (0.5 * F.cross_entropy(lt.view(-1, V), torch.from_numpy(targets).long().view(-1),
                           reduction="sum")).backward()
    check(f"cross_entropy B={B} T={Tn} V={V} backward in place (dlogits aliases logits)",
          inplace, lt.grad)


# ------------------------------------------------------------- elementwise


@test
def elementwise():
    n = 3 * 65536 + 17  # not a multiple of any block or vector width
    a, b = randn(n), randn(n)
    out = zeros(n)
    lz.call("lz_add", W(out), W(a), W(b))
    check(f"add [{n}]", out, tt(a) + tt(b))
    ai = a.copy()
    lz.call("lz_add", W(ai), W(ai), W(b))
    check(f"add [{n}] in place (out aliases a)", ai, tt(a) + tt(b))
    y = b.copy()
    lz.call("lz_axpy", W(y), -0.375, W(a))
    check(f"axpy [{n}] y += -0.375 x", y, tt(b) + (-0.375) * tt(a))
    s = a.copy()
    lz.call("lz_scale", W(s), 1.0 / 3.0)
    check(f"scale [{n}] by 1/3", s, tt(a) * (1.0 / 3.0))
    f = a.copy()
    lz.call("lz_fill", W(f), 2.5)
    check(f"fill [{n}] with 2.5", f, torch.full((n,), 2.5))
    sq = lz.ctypes.c_double()
    lz.call("lz_sq_norm", W(a), lz.ctypes.byref(sq))
    check(f"sq_norm f32 [{n}]", np.array([sq.value]), (tt(a).double() ** 2).sum().view(1))
    hb, hf = lz.bf16_round(a)
    lz.call("lz_sq_norm", W(hb, lz.BF16), lz.ctypes.byref(sq))
    check(f"sq_norm bf16 [{n}]", np.array([sq.value]), (tt(hf).double() ** 2).sum().view(1))
    hs = hb.copy()
    lz.call("lz_scale", W(hs, lz.BF16), 0.3)
    ref = (torch.from_numpy(hf) * 0.3).bfloat16().view(torch.int16).numpy().view(np.uint16)
    check_true(f"scale bf16 [{n}] by 0.3: bitwise torch's bf16 rounding",
               np.array_equal(hs, ref), f"({int(np.sum(hs != ref))} elements differ)")


# ------------------------------------------------------------------- adamw


@test
def adamw():
    n = 100003
    lr, b1, b2, eps, wd, gscale = 1e-2, 0.9, 0.95, 1e-8, 0.1, 0.5
    p0 = randn(n, scale=0.02)  # GPT-2's init scale
    grads = [randn(n, scale=0.1) for _ in range(5)]
    for g in grads:
        g[:8] = 0.0  # untouched entries
    p, m, v = p0.copy(), zeros(n), zeros(n)
    work16 = np.zeros(n, dtype=np.uint16)
    workh = np.zeros(n, dtype=np.float16)
    pt = torch.nn.Parameter(tt(p0))
    opt = torch.optim.AdamW([pt], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    for step, g in enumerate(grads, start=1):
        args = lz.AdamwArgs(lr, b1, b2, eps, wd, gscale, step)
        work = W(work16, lz.BF16) if step % 2 else W(workh, lz.F16)
        lz.call("lz_adamw_step", W(p), W(g), W(m), W(v), work, lz.ctypes.byref(args))
        pt.grad = tt(g) * gscale
        opt.step()
    st = opt.state[pt]
    tag = f"adamw [{n}] 5 steps lr={lr} wd={wd} grad_scale={gscale}"
    check(f"{tag} param", p, pt)
    check(f"{tag} param - initial (the updates)", p - p0, pt.detach() - tt(p0))
    check(f"{tag} m (exp_avg)", m, st["exp_avg"])
    check(f"{tag} v (exp_avg_sq)", v, st["exp_avg_sq"])
    want16 = lz.bf16_round(p)[0]  # written by step 5
    check_true(f"{tag} bf16 working copy = bf16(param)", np.array_equal(work16, want16))
    lz.call("lz_adamw_step", W(p), W(grads[0]), W(m), W(v), W(workh, lz.F16),
            lz.ctypes.byref(lz.AdamwArgs(lr, b1, b2, eps, wd, gscale, 6)))
    check_true(f"{tag} f16 working copy = f16(param)",
               np.array_equal(workh, p.astype(np.float16)))


def main():
    return run(f"test_kernels: {lz.LIB_PATH}, torch {torch.__version__}, tolerance {TOL:.0e} "
               "(max|ours-torch| / max|torch|)")


if __name__ == "__main__":
    sys.exit(main())
