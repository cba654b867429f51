"""test5_qwen3.py — luazero's Qwen3 (models/qwen3.lua: QK-norm, no biases,
head_dim 32 where hidden / heads is 16) against transformers 5.23's
Qwen3ForCausalLM, and its Qwen2 against 5.23's Qwen2ForCausalLM (a config.json
as 5.x writes it: rope_parameters, dtype, layer_types), plain and with a
sliding window of 6 on its second layer (use_sliding_window,
max_window_layers 1; the batches are 16 long, the longest prompt 13, so the
window bites; 4.40 masks windows differently, hence here): tiny random models (2
layers, hidden 64, 4 query heads, 2 key/value heads, vocabulary 256, eager
attention) saved with save_pretrained, then tests/ref/family_ref.py's checks —
--init loss (1e-5), one step's gradients (1e-4), greedy generate.lua over 64
new tokens, 20 ZeRO-3 steps exported and loaded by transformers with the same
loss (1e-5), LoRA adapters (q_proj, v_proj) loaded by PEFT 0.21.2 with the
same loss (1e-5).

Runs with the second reference environment's python (refenv.VENV5: torch
2.15, transformers 5.23, peft 0.21.2; tools/setup installs it):
    tests/ref/run.py test5_qwen3.py     # or that python directly; "N passed, N failed"
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks  # noqa: E402


def main():
    check = Checks("qwen3")
    try:
        import peft
        import torch
        import transformers
    except ImportError as e:
        print(f"skip: cannot import {e.name}: run with the python of the second reference "
              "environment (tests/ref/run.py test5_qwen3.py)")
        return check.summary()
    from family_ref import run_family
    transformers.logging.set_verbosity_error()
    shape = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                 max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.2,
                 attn_implementation="eager", bos_token_id=None, eos_token_id=None,
                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    qwen3 = transformers.Qwen3Config(head_dim=32, tie_word_embeddings=False, **shape)
    run_family(check, "qwen3", transformers, torch, peft, transformers.Qwen3ForCausalLM, qwen3)
    qwen2 = transformers.Qwen2Config(tie_word_embeddings=True, **shape)
    run_family(check, "qwen2", transformers, torch, peft, transformers.Qwen2ForCausalLM, qwen2)
    windowed = transformers.Qwen2Config(tie_word_embeddings=False, use_sliding_window=True,
                                        sliding_window=6, max_window_layers=1, **shape)
    check("qwen2_window.layer_types", windowed.layer_types == ["full_attention",
                                                               "sliding_attention"],
          str(windowed.layer_types))
    run_family(check, "qwen2_window", transformers, torch, peft, transformers.Qwen2ForCausalLM,
               windowed)
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
