// attention_hs128.cu — the attention kernels for head sizes up to 128.
#include "attention_kernels.cuh"

LZ_ATTN_DEFINE(128)
