"""test5_gemma.py — luazero's Gemma (models/gemma.lua) against transformers
5.23's GemmaForCausalLM, and its LoRA adapters loaded by PEFT 0.21.2, in the
second reference environment (refenv.VENV5: torch 2.15, transformers 5.23,
peft 0.21.2); test_gemma.py makes the same checks on transformers 4.40 and
PEFT 0.10.

test_gemma.py's tiny random GemmaForCausalLM (2 layers, hidden 64, 4 query
heads, 1 key/value head, head_dim 32, vocabulary 250 padded to 256, every
norm weight drawn), its config.json as 5.x writes it (rope_parameters,
dtype), saved with save_pretrained: --init loss (1e-5) and gradients (1e-4),
20 steps then tools/ckpt export loaded back with the same loss, greedy
generate of 64 tokens, LoRA adapters (PEFT 0.21.2's default targets for
gemma: q_proj, v_proj) loaded by PEFT with the same loss.

    /root/.cache/luazero/ref5-venv/bin/python tests/ref/test5_gemma.py
    /usr/bin/python3 tests/ref/run.py test5_gemma.py    # ends with "N passed, N failed"
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from family_ref import gemma_main  # noqa: E402


def build(transformers):
    """The tiny model's class, its config and the options that must bite."""
    config = transformers.GemmaConfig(
        vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=0.2, hidden_act="gelu_pytorch_tanh",
        hidden_activation="gelu_pytorch_tanh", bos_token_id=2, eos_token_id=1,
        pad_token_id=None, tie_word_embeddings=True, attn_implementation="eager")
    return transformers.GemmaForCausalLM, config, None


if __name__ == "__main__":
    sys.exit(gemma_main("gemma", "test5_gemma.py", build))
