// attention_hs256.cu — the attention kernels for head sizes up to 256.
#include "attention_kernels.cuh"

LZ_ATTN_DEFINE(256)
