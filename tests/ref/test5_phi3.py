"""test5_phi3.py — luazero's Phi-3 (models/phi3.lua) against transformers 5.23's
Phi3ForCausalLM and PEFT 0.21.2.

Two tiny random models (2 layers, dim 64, 4 query heads, 2 key/value heads,
head_dim 16, vocabulary 256), saved with save_pretrained:
  window    sliding_window 6, shorter than the 16-token batch and the prompts
  longrope  LongRoPE (short and long factors, original_max_position_embeddings
            12, so the 16-token batch turns with the long ones and generation
            passes from the short to the long ones) and partial_rotary_factor
            0.5 (8 of each head's 16 values turn), no window
For each, tests/ref/family_ref.py's checks (run_family; the norms drawn
off their start):
  init      scripts/train.lua's --init reading of the folder (config.json,
            qkv_proj and gate_up_proj as they are) gives transformers' loss on
            a batch within 1e-5 relative, and every parameter's gradient of one
            backward within 1e-4 (max |ours - theirs| / max |theirs|)
  export    20 training steps (2 ranks, ZeRO stage 3, --save), tools/ckpt
            export, transformers loads the folder with nothing missing or
            unexpected and its loss equals the checkpoint's within 1e-5
  generate  scripts/generate.lua --hf, greedy, 64 new tokens of prompts longer
            than the window (and passing original_max_position_embeddings),
            rows at different positions in one batch: the ids of transformers'
            generate of each prompt alone
  lora      a LoRA run (its default target, qkv_proj, checked), tools/ckpt
            export: PEFT 0.21.2 loads the adapters and its loss equals
            luazero's on the base with the same adapters within 1e-5

Runs with the second reference environment (tests/ref/refenv.py: VENV5);
without it this file says it skipped.
    /root/.cache/luazero/ref5-venv/bin/python tests/ref/test5_phi3.py [CASE...]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks  # noqa: E402
from family_ref import import5, run_family  # noqa: E402


def configs(transformers):
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-5, initializer_range=0.2, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=None, pad_token_id=0,
                  attn_implementation="eager")
    window = transformers.Phi3Config(sliding_window=6, **common)
    longrope = transformers.Phi3Config(
        sliding_window=None, original_max_position_embeddings=12,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5,
                         "short_factor": [1.0, 1.25, 1.5, 2.0],
                         "long_factor": [2.0, 3.5, 5.0, 9.0]}, **common)
    return [("window", window), ("longrope", longrope)]


def main():
    check = Checks("phi3")
    libs = import5("test5_phi3.py")
    if libs is None:
        return check.summary()
    transformers, torch, peft = libs
    for name, config in configs(transformers):
        if len(sys.argv) > 1 and name not in sys.argv[1:]:
            continue
        run_family(check, name, transformers, torch, peft, transformers.Phi3ForCausalLM, config,
                   targets=["qkv_proj"])
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
