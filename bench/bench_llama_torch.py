"""bench_llama_torch.py — the PyTorch side of bench/bench_llama.lua: Llama
training steps (forward, backward, clipping, AdamW) on the CPU, with a Llama
written here from Hugging Face's LlamaForCausalLM equations (LlamaRMSNorm,
rotary embeddings with rotate_half, repeat_kv grouped-query attention, the
SwiGLU LlamaMLP, no biases, the LM head tied to the embedding or not). It
does not import transformers. --dtype bf16 runs forward and loss under
torch.autocast("cpu", dtype=torch.bfloat16) with fp32 master weights.
Each step is timed; prints "torch_step_ms M1 M2 ..." and
"torch_tokens_per_s X" (from the median step).
    /usr/bin/python3 bench/bench_llama_torch.py --micro-batch 4 --seq-len 64 --dtype fp32
"""
import argparse
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    """LlamaRMSNorm: weight * x / sqrt(mean(x^2) + eps), computed in fp32."""

    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.nh, self.nkv, self.hd = c.n_head, c.n_kv_head, c.n_embd // c.n_head
        self.q_proj = nn.Linear(c.n_embd, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(c.n_embd, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(c.n_embd, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, c.n_embd, bias=False)

    def forward(self, x, cos, sin, mask):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        g = self.nh // self.nkv  # repeat_kv: each key/value head serves g query heads
        k = k[:, :, None].expand(B, self.nkv, g, T, self.hd).reshape(B, self.nh, T, self.hd)
        v = v[:, :, None].expand(B, self.nkv, g, T, self.hd).reshape(B, self.nh, T, self.hd)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)
        att = att.masked_fill(mask, float("-inf"))
        att = F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)
        y = (att @ v).transpose(1, 2).reshape(B, T, self.nh * self.hd)
        return self.o_proj(y)


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.n_embd, c.n_hidden, bias=False)
        self.up_proj = nn.Linear(c.n_embd, c.n_hidden, bias=False)
        self.down_proj = nn.Linear(c.n_hidden, c.n_embd, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c.n_embd, c.eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.n_embd, c.eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c.vocab, c.n_embd)
        self.layers = nn.ModuleList([Layer(c) for _ in range(c.n_layer)])
        self.norm = RMSNorm(c.n_embd, c.eps)
        self.lm_head = None if c.tie else nn.Linear(c.n_embd, c.vocab, bias=False)
        for m in self.modules():  # _init_weights
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
        hd = c.n_embd // c.n_head
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, idx, targets):
        B, T = idx.shape
        pos = torch.arange(T, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        x = self.norm(x)
        logits = F.linear(x, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(x)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def main():
    p = argparse.ArgumentParser()
    for name, default in [("n-layer", 12), ("n-head", 12), ("n-kv-head", 4), ("n-embd", 768),
                          ("n-hidden", 2048), ("vocab", 32000), ("tie", 1),
                          ("micro-batch", 4), ("seq-len", 64), ("steps", 2), ("threads", 2)]:
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--eps", type=float, default=1e-5)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = Llama(a)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)

    def step():
        x = torch.randint(0, a.vocab, (a.micro_batch, a.seq_len))
        y = torch.randint(0, a.vocab, (a.micro_batch, a.seq_len))
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    step()  # warm-up
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    print("torch_params %d" % sum(p.numel() for p in model.parameters()))
    print("torch_step_ms " + " ".join("%.1f" % (t * 1000) for t in times))
    print(f"torch_tokens_per_s {a.micro_batch * a.seq_len / dt:.3f}")


if __name__ == "__main__":
    main()
