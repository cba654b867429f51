"""rope_ref.py — Hugging Face's rotary-embedding equations (transformers
4.40's LlamaRotaryEmbedding), in torch fp32, for the reference tests of the
rope kernels (test_llama.py) and of the whole Llama (test_llama_model.py)."""
import math

import torch


def default_inv_freq(theta, d):
    """_compute_default_rope_parameters: LlamaRotaryEmbedding's inv_freq."""
    return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))


def llama3_inv_freq(theta, d, s):
    """_compute_llama3_parameters; s holds rope_scaling's factor,
    low_freq_factor, high_freq_factor and original_max_position_embeddings."""
    inv_freq = default_inv_freq(theta, d)
    factor, low_freq_factor = s["factor"], s["low_freq_factor"]
    high_freq_factor, old_context_len = s["high_freq_factor"], s["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)
