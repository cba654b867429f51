"""test_llama_model.py — luazero's Llama (models/llama.lua) against a tiny
Llama written here from Hugging Face's LlamaForCausalLM equations
(LlamaRMSNorm, LlamaRotaryEmbedding with rotate_half and, for rope_scaling
llama3, _compute_llama3_parameters; repeat_kv grouped-query attention;
LlamaMLP's down_proj(silu(gate_proj(x)) * up_proj(x)); no biases). It does
not import transformers.

tests/ref/llama_dump.lua builds the model in luazero (2 layers, dim 64, 4
query heads, 2 key/value heads, head_dim 16, vocab 250 padded to 256), runs a
forward and backward and 10 AdamW steps (gradient accumulation 2, clipping,
warmup and cosine decay) and writes the initial weights, the batches and
its results. This file loads the same weights, redoes the same work and
compares, as test_gpt2.py does (relative error: max |luazero - torch| /
max |torch| over the tensor):

  fp32            logits and loss <= 1e-4, every parameter's gradient <= 1e-3,
                  the 10 step losses <= 1e-4, the parameters after them <= 1e-3
  bf16            against the same model made bf16-aware as luazero's bf16
                  mode computes: each GEMM takes its input and weight (and,
                  backward, its output gradient) rounded to bf16 with fp32
                  accumulation; the embedding and RMSNorm read bf16-rounded
                  weights; everything else fp32, fp32 master weights. Only
                  summation order differs, but that can move a value across
                  a bf16 rounding boundary (a 2^-8 relative step for that
                  element), so: logits <= 5e-3, loss <= 1e-3, gradients
                  <= 1e-2, step losses <= 1e-3, parameters after 10 steps
                  <= 3e-2 (AdamW moves a weight whose gradient is near zero
                  by up to lr per step whichever its sign: a flipped sign
                  there is a difference of the order of lr; measured 1e-2).

Variants: plain (rope_theta 10000), llama3 (rope_scaling llama3: factor 8,
low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 64,
so head_dim 16's frequencies fall in all three bands), tied (LM head tied to
the embedding); fp32 for each, bf16 for plain and llama3.

    /usr/bin/python3 tests/ref/test_llama_model.py     # ends with "N passed, N failed"
"""
import math
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from rope_ref import default_inv_freq, llama3_inv_freq, rotate_half
from training_ref import ErrorChecks, load_params, read_dump, rel_err, train_adamw, worst_gradient

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LUAZERO = os.environ.get("LUAZERO") or os.path.join(REPO, "build", "bin", "luazero")


# ------------------------------------------------------------- bf16 rounding


class RoundBF16(torch.autograd.Function):
    """Forward: the value rounded to bf16 (to nearest even), as f32.
    Backward: the gradient unchanged (the fp32 master takes it)."""

    @staticmethod
    def forward(ctx, x):
        return x.to(torch.bfloat16).to(torch.float32)

    @staticmethod
    def backward(ctx, g):
        return g


def bf16(x):
    return x.to(torch.bfloat16).to(torch.float32)


class LinearBF16(torch.autograd.Function):
    """luazero's bf16 GEMM: y = bf16(x) @ bf16(w)^T; dx = bf16(dy) @ bf16(w),
    dw = bf16(dy)^T @ bf16(x), fp32 accumulation."""

    @staticmethod
    def forward(ctx, x, w):
        xb, wb = bf16(x), bf16(w)
        ctx.save_for_backward(xb, wb)
        return xb @ wb.t()

    @staticmethod
    def backward(ctx, dy):
        xb, wb = ctx.saved_tensors
        dyb = bf16(dy)
        dw = dyb.reshape(-1, dyb.shape[-1]).t() @ xb.reshape(-1, xb.shape[-1])
        return dyb @ wb, dw


class Linear(nn.Module):
    """nn.Linear without bias; bf16-aware when the model is."""

    def __init__(self, n_in, n_out, half):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in))
        self.half = half

    def forward(self, x):
        if self.half:
            return LinearBF16.apply(x, self.weight)
        return F.linear(x, self.weight)


# ------------------------------------------------------- Llama, from HF's equations


class RMSNorm(nn.Module):
    def __init__(self, n, eps, half):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps, self.half = eps, half

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        h = x * torch.rsqrt(variance + self.eps)
        return (RoundBF16.apply(self.weight) if self.half else self.weight) * h


class Attention(nn.Module):
    def __init__(self, cfg, half):
        super().__init__()
        C, hd = cfg["n_embd"], cfg["head_dim"]
        self.nh, self.nkv, self.hd = cfg["n_head"], cfg["n_kv_head"], hd
        self.q_proj = Linear(C, self.nh * hd, half)
        self.k_proj = Linear(C, self.nkv * hd, half)
        self.v_proj = Linear(C, self.nkv * hd, half)
        self.o_proj = Linear(self.nh * hd, C, half)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin  # apply_rotary_pos_emb
        k = k * cos + rotate_half(k) * sin
        g = self.nh // self.nkv  # repeat_kv
        k = k[:, :, None].expand(B, self.nkv, g, T, self.hd).reshape(B, self.nh, T, self.hd)
        v = v[:, :, None].expand(B, self.nkv, g, T, self.hd).reshape(B, self.nh, T, self.hd)
        att = q @ k.transpose(2, 3) / math.sqrt(self.hd)
        att = att + torch.full((T, T), float("-inf")).triu(1)
        att = F.softmax(att, dim=-1, dtype=torch.float32)
        y = (att @ v).transpose(1, 2).reshape(B, T, self.nh * self.hd)
        return self.o_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg, half):
        super().__init__()
        C, H = cfg["n_embd"], cfg["n_hidden"]
        self.gate_proj = Linear(C, H, half)
        self.up_proj = Linear(C, H, half)
        self.down_proj = Linear(H, C, half)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, half):
        super().__init__()
        self.self_attn = Attention(cfg, half)
        self.mlp = MLP(cfg, half)
        self.input_layernorm = RMSNorm(cfg["n_embd"], cfg["eps"], half)
        self.post_attention_layernorm = RMSNorm(cfg["n_embd"], cfg["eps"], half)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg, half):
        super().__init__()
        C, V = cfg["n_embd"], cfg["padded_vocab"]
        self.vocab, self.half, self.tie = cfg["vocab"], half, cfg["tie"]
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(V, C)
        self.model.layers = nn.ModuleList([DecoderLayer(cfg, half) for _ in range(cfg["n_layer"])])
        self.model.norm = RMSNorm(C, cfg["eps"], half)
        if not self.tie:
            self.lm_head = Linear(C, V, half)
        s, theta, hd = cfg.get("rope_scaling"), cfg["rope_theta"], cfg["head_dim"]
        self.inv_freq = llama3_inv_freq(theta, hd, s) if s else default_inv_freq(theta, hd)

    def forward(self, idx, targets):
        T = idx.shape[1]
        m = self.model
        table = RoundBF16.apply(m.embed_tokens.weight) if self.half else m.embed_tokens.weight
        x = F.embedding(idx, table)
        # LlamaRotaryEmbedding: fp32 angles position * inv_freq, cos and sin.
        pos = torch.arange(T)[None, :].float()
        freqs = (self.inv_freq[None, :, None].float() @ pos[:, None, :]).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        for layer in m.layers:
            x = layer(x, cos, sin)
        x = m.norm(x)
        if self.tie:
            w = m.embed_tokens.weight
            logits = LinearBF16.apply(x, w) if self.half else F.linear(x, w)
        else:
            logits = self.lm_head(x)
        loss = F.cross_entropy(logits[..., :self.vocab].reshape(-1, self.vocab),
                               targets.reshape(-1))
        return logits, loss


# -------------------------------------------------------------------- checks


TOLS = {"f32": dict(logits=1e-4, loss=1e-4, grads=1e-3, losses=1e-4, params=1e-3),
        "bf16": dict(logits=5e-3, loss=1e-3, grads=1e-2, losses=1e-3, params=3e-2)}
CASES = [("f32", "plain"), ("f32", "llama3"), ("f32", "tied"), ("bf16", "plain"),
         ("bf16", "llama3")]

check = ErrorChecks()


def run_case(dtype, variant):
    tag = f"llama.{dtype}.{variant}"
    tol = TOLS[dtype]
    with tempfile.TemporaryDirectory() as out:
        run = subprocess.run([LUAZERO, os.path.join(REPO, "tests", "ref", "llama_dump.lua"), out,
                              dtype, variant], capture_output=True, text=True)
        if run.returncode != 0:
            print(f"FAIL {tag}.dump: luazero tests/ref/llama_dump.lua exited", run.returncode)
            print(run.stdout + run.stderr)
            check.failed += 1
            return
        meta, dump = read_dump(out)
    tokens = dump["tokens"]
    model = LlamaForCausalLM(meta["config"], dtype == "bf16")
    ours = np.array(meta["inv_freq"], dtype=np.float32)
    theirs = model.inv_freq.numpy()
    ulps = int(np.abs(ours.view(np.int32) - theirs.view(np.int32)).max())
    print(f"    inv_freq: luazero's within {ulps} fp32 ulp of Hugging Face's")
    check(f"{tag}.inv_freq", rel_err(ours, theirs), 1e-6)
    model.inv_freq = torch.from_numpy(ours)  # the rest of the equations, on one set of angles

    named = dict(model.named_parameters())
    table = meta["params"]
    if sorted(named) != sorted(e["name"] for e in table):
        print(f"FAIL {tag}.names: parameter names differ:",
              sorted(set(named) ^ set(e["name"] for e in table)))
        check.failed += 1
        return
    load_params(named, table, dump["params0"])

    logits, loss = model(tokens[0, 0], tokens[0, 1])
    loss.backward()
    check(f"{tag}.logits", rel_err(dump["logits"].reshape(logits.shape), logits.detach().numpy()),
          tol["logits"])
    check(f"{tag}.loss", rel_err([meta["loss0"]], [loss.item()]), tol["loss"])
    worst = worst_gradient(named, table, dump["grads"], tol["grads"])
    check(f"{tag}.gradients_of_{len(table)}_parameters", worst, tol["grads"])

    losses, _, _ = train_adamw(tag, model, named, table, tokens, meta, check)
    check(f"{tag}.adamw_10_step_losses", rel_err(meta["losses"], losses), tol["losses"])
    flat = np.concatenate([named[e["name"]].detach().numpy().ravel() for e in table])
    check(f"{tag}.params_after_10_steps", rel_err(dump["params10"], flat), tol["params"])


def main():
    torch.set_num_threads(2)
    if not os.access(LUAZERO, os.X_OK):
        print(f"FAIL llama.dump: {LUAZERO} is missing: build first (tools/setup), or set LUAZERO")
        print("0 passed, 1 failed")
        return 1
    for dtype, variant in CASES:
        run_case(dtype, variant)
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
