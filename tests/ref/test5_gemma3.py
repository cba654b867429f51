"""test5_gemma3.py — luazero's Gemma 3 text model (models/gemma3.lua) against
transformers 5.23's Gemma3ForCausalLM (eager attention), in the second
reference environment (refenv.VENV5: torch 2.15, transformers 5.23, peft
0.21.2).

A tiny random Gemma3ForCausalLM (2 layers, hidden 64, 4 query heads, 2
key/value heads, head_dim 32, vocabulary 250 padded to 256, every norm weight
drawn, the QK-norms' too) whose first layer is local (RoPE base 10000) and
second global (RoPE base 1000000 with linear scaling of factor 8, as Gemma 3
4B, 12B and 27B have, rope_parameters per layer type as 5.x writes them),
saved with save_pretrained; the checks are test_gemma.py's:
--init loss (1e-5) and gradients (1e-4), 20 steps then tools/ckpt export
loaded back with the same loss, greedy generate of 64 tokens, LoRA adapters
in PEFT. The local layer's window is 4 (T = 16; prompts of up to 11 tokens
and 64 new ones) and query_pre_attn_scalar 24 (not head_dim 32); no
soft-caps, as Gemma 3 has none by default.

    /root/.cache/luazero/ref5-venv/bin/python tests/ref/test5_gemma3.py
    /usr/bin/python3 tests/ref/run.py test5_gemma3.py    # ends with "N passed, N failed"
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from family_ref import gemma_main  # noqa: E402


def build(transformers):
    """The tiny model's class, its config and the options that must bite."""
    config = transformers.Gemma3TextConfig(
        vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        rms_norm_eps=1e-6, initializer_range=0.2, hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=24, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1000000.0}},
        bos_token_id=2, eos_token_id=1, pad_token_id=None, tie_word_embeddings=True,
        attn_implementation="eager")
    return transformers.Gemma3ForCausalLM, config, {
        "sliding_window": 4096, "query_pre_attn_scalar": 32,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}}


if __name__ == "__main__":
    sys.exit(gemma_main("gemma3", "test5_gemma3.py", build))
