"""test5_gemma2.py — luazero's Gemma 2 (models/gemma2.lua) against transformers
5.23's Gemma2ForCausalLM (eager attention), in the second reference
environment (refenv.VENV5: torch 2.15, transformers 5.23, peft 0.21.2).

A tiny random Gemma2ForCausalLM (2 layers, hidden 64, 4 query heads, 2
key/value heads, head_dim 32, vocabulary 250 padded to 256, every norm weight
drawn) with the four norms of a layer, caps and a window that bite at the
test's lengths: attention scores soft-capped at 2, final logits at 2, a
sliding window of 4 on the first layer (T = 16; prompts of up to 11 tokens
and 64 new ones), query_pre_attn_scalar 24 (not head_dim 32); saved with
save_pretrained. The checks are test_gemma.py's: --init loss (1e-5) and
gradients (1e-4), 20 steps then tools/ckpt export loaded back with the same
loss, greedy generate of 64 tokens, LoRA adapters in PEFT.

    /root/.cache/luazero/ref5-venv/bin/python tests/ref/test5_gemma2.py
    /usr/bin/python3 tests/ref/run.py test5_gemma2.py    # ends with "N passed, N failed"
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from family_ref import gemma_main  # noqa: E402


def build(transformers):
    """The tiny model's class, its config and the options that must bite."""
    config = transformers.Gemma2Config(
        vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=0.2, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24,
        sliding_window=4, attn_logit_softcapping=2.0, final_logit_softcapping=2.0,
        bos_token_id=2, eos_token_id=1, pad_token_id=None, tie_word_embeddings=True,
        attn_implementation="eager")
    return transformers.Gemma2ForCausalLM, config, {
        "attn_logit_softcapping": None, "final_logit_softcapping": None,
        "sliding_window": 4096, "query_pre_attn_scalar": 32}


if __name__ == "__main__":
    sys.exit(gemma_main("gemma2", "test5_gemma2.py", build))
