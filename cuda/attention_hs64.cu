// attention_hs64.cu — the attention kernels for head sizes up to 64.
#include "attention_kernels.cuh"

LZ_ATTN_DEFINE(64)
