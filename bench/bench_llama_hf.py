"""bench_llama_hf.py — the Hugging Face side of bench/bench_llama.lua: training
steps of transformers' LlamaForCausalLM (--attn eager or sdpa attention,
random weights, random tokens) on the CPU: forward, the loss, backward, clipping at 1.0 and
torch.optim.AdamW. --dtype bf16 runs forward and loss under
torch.autocast("cpu", dtype=torch.bfloat16) with fp32 weights. --lora-r R
wraps the model in PEFT LoRA adapters of rank R (alpha R, no dropout) on
--lora-targets, everything else frozen, AdamW over the adapters only.
Run with the reference venv's python (tools/setup: transformers 4.40.2,
peft 0.10.0 over the system PyTorch) or the second one's (torch 2.15,
transformers 5.23, peft 0.21.2). Each step is timed; prints
"hf_params TOTAL TRAINABLE", "hf_step_ms M1 M2 ..." and "hf_tokens_per_s X"
(from the median step).
    build/ref-venv/bin/python bench/bench_llama_hf.py --micro-batch 4 --seq-len 128 --dtype bf16
"""
import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser()
    for name, default in (("n-layer", 12), ("n-head", 12), ("n-kv-head", 4), ("n-embd", 768),
                          ("n-hidden", 2048), ("vocab", 32000), ("tie", 0), ("micro-batch", 4),
                          ("seq-len", 128), ("steps", 2), ("threads", 2), ("lora-r", 0)):
        ap.add_argument("--" + name, type=int, default=default)
    ap.add_argument("--eps", type=float, default=1e-5)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--lora-targets", default="q_proj,v_proj")
    ap.add_argument("--attn", choices=("eager", "sdpa"), default="eager")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(1)
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.n_embd, intermediate_size=a.n_hidden,
                      num_hidden_layers=a.n_layer, num_attention_heads=a.n_head,
                      num_key_value_heads=a.n_kv_head, max_position_embeddings=max(a.seq_len, 2048),
                      rms_norm_eps=a.eps, rope_theta=a.rope_theta,
                      tie_word_embeddings=bool(a.tie), attn_implementation=a.attn)
    model = LlamaForCausalLM(cfg)
    total = sum(p.numel() for p in model.parameters())
    if a.lora_r > 0:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=a.lora_r, lora_alpha=a.lora_r, lora_dropout=0.0,
                                                 target_modules=a.lora_targets.split(",")))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    print("hf_versions torch %s transformers %s attn %s" % (
        torch.__version__, transformers.__version__, model.config._attn_implementation))
    print("hf_params %d %d" % (total, sum(p.numel() for p in params)), flush=True)
    opt = torch.optim.AdamW(params, lr=1e-4)
    B, T = a.micro_batch, a.seq_len
    g = torch.Generator().manual_seed(1)

    def autocast():
        if a.dtype == "bf16":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def step():
        x = torch.randint(0, a.vocab, (B, T), generator=g)
        y = torch.randint(0, a.vocab, (B, T), generator=g)
        with autocast():
            logits = model(input_ids=x).logits
            loss = F.cross_entropy(logits.float().view(-1, a.vocab), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up
    ms = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()
        ms.append((time.perf_counter() - t0) * 1000)
    print("hf_step_ms " + " ".join("%.1f" % m for m in ms))
    print("hf_tokens_per_s %.3f" % (B * T / statistics.median(ms) * 1000))


if __name__ == "__main__":
    main()
