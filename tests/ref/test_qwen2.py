"""test_qwen2.py — luazero's Qwen2 (models/qwen2.lua: a bias on q, k and v,
rope_theta 1e6, the head tied to the embedding) against transformers 4.40.2's
Qwen2ForCausalLM: a tiny random model (2 layers, hidden 64, 4 query heads, 2
key/value heads, vocabulary 256, eager attention) saved with save_pretrained,
then tests/ref/family_ref.py's checks — --init loss (1e-5), one step's
gradients (1e-4), greedy generate.lua over 64 new tokens, 20 ZeRO-3 steps
exported and loaded by transformers with the same loss (1e-5), LoRA adapters
(q_proj, v_proj) loaded by PEFT 0.10.0 with the same loss (1e-5).

transformers 4.40.2 and peft come from build/ref-venv (tools/setup) or
LZ_REF_VENV; without transformers this file says it skipped.
    /usr/bin/python3 tests/ref/test_qwen2.py     # ends with "N passed, N failed"
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks  # noqa: E402
from family_ref import run_family  # noqa: E402
from refenv import import_from_venv, import_transformers  # noqa: E402


def main():
    check = Checks("qwen2")
    transformers = import_transformers()
    if transformers is None:
        return check.summary()
    peft, why = import_from_venv("peft")
    if peft is None:
        print(f"skip: the LoRA check: {why}")
    config = transformers.Qwen2Config(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, rms_norm_eps=1e-6,
        rope_theta=1000000.0, initializer_range=0.2, tie_word_embeddings=True,
        use_sliding_window=False, attn_implementation="eager", bos_token_id=None,
        eos_token_id=None)
    run_family(check, "qwen2", transformers, torch, peft, transformers.Qwen2ForCausalLM, config)
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
