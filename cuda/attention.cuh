// attention.cuh — what attention.cu (the ops) shares with attention_hs64.cu,
// attention_hs128.cu and attention_hs256.cu (the kernels compiled for one
// head-size bound each; attention_kernels.cuh has their code). One file per
// bound lets the three ptxas runs, of which the 256-wide one is by far the
// longest, go side by side under make -j.
#ifndef LZ_ATTENTION_CUH
#define LZ_ATTENTION_CUH

#include "lz_cuda.h"


#include <float.h>  // FLT_MAX

#define QPB 64    // queries (or keys) per block: one per thread
#define KTILE 16  // rows staged in shared memory at a time

// The shape of one call. Offsets are in floats within a qkv row.
struct attn_dims {
  int64_t B, T, C;  // C = NH * HS: the width of out and of q
  int64_t row;      // floats per qkv row: (NH + 2 NKV) * HS
  int NH, NKV, HS;
  int64_t W;  // window; 0 = none
  float scale;
  float cap;  // soft-capping; 0 = none
};

// The launches of the forward, dQ and dK/dV kernels with head sizes up to HSM
// on the compute stream, defined by attention_hsHSM.cu.
#define LZ_ATTN_LAUNCHERS(HSM)                                                            \
  lz_status lz_cu_attn_forward_##HSM(dim3 grid, float *out, float *lse, const float *qkv, \
                                     const int32_t *seg, attn_dims d);                    \
  lz_status lz_cu_attn_dq_##HSM(dim3 grid, float *dqkv, float *dsum, const float *dout,   \
                                const float *qkv, const float *out, const float *lse,     \
                                const int32_t *seg, attn_dims d);                         \
  lz_status lz_cu_attn_dkv_##HSM(dim3 grid, float *dqkv, const float *dsum,               \
                                 const float *dout, const float *qkv, const float *lse,   \
                                 const int32_t *seg, attn_dims d);

LZ_ATTN_LAUNCHERS(64)
LZ_ATTN_LAUNCHERS(128)
LZ_ATTN_LAUNCHERS(256)

#endif
