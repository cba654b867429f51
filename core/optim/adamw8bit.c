/* adamw8bit.c — fused 8-bit AdamW, bitsandbytes' AdamW8bit/Adam8bit scheme:
 * m and v are one byte per element, each an index into a 256-entry map (m:
 * the signed dynamic map, v: the unsigned one) times the absmax of its block
 * of LZ_ADAMW8BIT_BLOCK elements. One pass per block dequantises, updates
 * param, m and v in fp32, writes the working copy, and requantises: each
 * element is the map's nearest entry to m / absmax (ties to the lower
 * index). bitsandbytes 0.50.2's CPU quantiser picks from a table over 2^16
 * equal cells of [-1, 1] instead, so a few percent of the indices differ
 * (where a cell holds a midpoint, and below 2^-15); the update itself and
 * the absmaxes are its bits (tests/ref/test5_adam8bit.py). bitsandbytes keeps tensors under its
 * min_8bit_size in fp32; the same op with f32 m, v runs that update (a different arrangement of the
 * AdamW formula from adamw.c's, hence its own path).
 *
 * The arithmetic is bitsandbytes' CPU update op for op, in torch's
 * roundings: its `add_(x, alpha)` and `addcmul_` are fused multiply-adds in
 * torch's vector code, its `addcdiv_` and divisions are not:
 *   m  = fma(g, 1 - b1, m b1)          v = fma((1 - b2) g, g, v b2)
 *   8-bit:  p = p (1 - lr wd) + ((-lr / c1) m) / (sqrt(v) / c2 + eps)
 *   fp32:   p = fma(m / (sqrt(v) + eps c2), -lr c2 / c1, p (1 - lr wd))
 * with c1 = 1 - b1^t, c2 = sqrt(1 - b2^t), g = grad * grad_scale. */
#include "mem/lz_backend.h"
#include "optim/lz_optim.h"

#include <immintrin.h> /* the gathers of the vector quantisers */
#include <math.h>      /* fmaf, sqrtf, fabsf, pow, sqrt */

/* bitsandbytes' create_dynamic_map(signed=True) and (signed=False): the
 * values it builds in fp32, sorted. */
static const float signed_map[256] = {
    -0x1.fc6666p-1f,  -0x1.f53334p-1f,  -0x1.eep-1f,      -0x1.e6ccccp-1f,  -0x1.df999ap-1f,
    -0x1.d86666p-1f,  -0x1.d13334p-1f,  -0x1.cap-1f,      -0x1.c2ccccp-1f,  -0x1.bb999ap-1f,
    -0x1.b46666p-1f,  -0x1.ad3334p-1f,  -0x1.a6p-1f,      -0x1.9eccccp-1f,  -0x1.97999ap-1f,
    -0x1.906666p-1f,  -0x1.893334p-1f,  -0x1.82p-1f,      -0x1.7accccp-1f,  -0x1.73999ap-1f,
    -0x1.6c6668p-1f,  -0x1.653334p-1f,  -0x1.5ep-1f,      -0x1.56ccccp-1f,  -0x1.4f999ap-1f,
    -0x1.486668p-1f,  -0x1.413334p-1f,  -0x1.3ap-1f,      -0x1.32ccccp-1f,  -0x1.2b999ap-1f,
    -0x1.246668p-1f,  -0x1.1d3334p-1f,  -0x1.16p-1f,      -0x1.0eccccp-1f,  -0x1.079998p-1f,
    -0x1.006666p-1f,  -0x1.f26664p-2f,  -0x1.e4p-2f,      -0x1.d59998p-2f,  -0x1.c73334p-2f,
    -0x1.b8ccccp-2f,  -0x1.aa6666p-2f,  -0x1.9cp-2f,      -0x1.8d9998p-2f,  -0x1.7f3334p-2f,
    -0x1.70ccccp-2f,  -0x1.626666p-2f,  -0x1.54p-2f,      -0x1.459998p-2f,  -0x1.373334p-2f,
    -0x1.28ccccp-2f,  -0x1.1a6668p-2f,  -0x1.0cp-2f,      -0x1.fb3332p-3f,  -0x1.de6666p-3f,
    -0x1.c1999ap-3f,  -0x1.a4ccccp-3f,  -0x1.88p-3f,      -0x1.6b3334p-3f,  -0x1.4e6666p-3f,
    -0x1.31999ap-3f,  -0x1.14ccccp-3f,  -0x1.fp-4f,       -0x1.b66668p-4f,  -0x1.93d70ap-4f,
    -0x1.8851eep-4f,  -0x1.7ccccep-4f,  -0x1.7147aep-4f,  -0x1.65c29p-4f,   -0x1.5a3d7p-4f,
    -0x1.4eb854p-4f,  -0x1.433334p-4f,  -0x1.37ae14p-4f,  -0x1.2c28f6p-4f,  -0x1.20a3d6p-4f,
    -0x1.151ebap-4f,  -0x1.09999ap-4f,  -0x1.fc28f6p-5f,  -0x1.e51ebap-5f,  -0x1.ce147ap-5f,
    -0x1.b70a3ep-5f,  -0x1.ap-5f,       -0x1.88f5c2p-5f,  -0x1.71eb86p-5f,  -0x1.5ae146p-5f,
    -0x1.43d70ap-5f,  -0x1.2ccccep-5f,  -0x1.15c29p-5f,   -0x1.fd70a4p-6f,  -0x1.cf5c2ap-6f,
    -0x1.a147aep-6f,  -0x1.733334p-6f,  -0x1.451ebap-6f,  -0x1.170a3ep-6f,  -0x1.d1eb86p-7f,
    -0x1.75c29p-7f,   -0x1.3e76c8p-7f,  -0x1.2c083p-7f,   -0x1.19999ap-7f,  -0x1.072b02p-7f,
    -0x1.e978d4p-8f,  -0x1.c49ba6p-8f,  -0x1.9fbe76p-8f,  -0x1.7ae148p-8f,  -0x1.56041ap-8f,
    -0x1.3126e8p-8f,  -0x1.0c49bap-8f,  -0x1.ced914p-9f,  -0x1.851eb8p-9f,  -0x1.3b645ap-9f,
    -0x1.e353f8p-10f, -0x1.4fdf3ap-10f, -0x1.eecbfep-11f, -0x1.b3d07cp-11f, -0x1.78d5p-11f,
    -0x1.3dd982p-11f, -0x1.02de02p-11f, -0x1.8fc506p-12f, -0x1.19ce0ap-12f, -0x1.47ae16p-13f,
    -0x1.743e96p-14f, -0x1.15df66p-14f, -0x1.6f0068p-15f, -0x1.64840cp-16f, -0x1.040bfep-17f,
    -0x1.b43528p-19f, -0x1.27476ep-21f, 0x0p+0f,          0x1.27476ep-21f,  0x1.b43528p-19f,
    0x1.040bfep-17f,  0x1.64840cp-16f,  0x1.6f0068p-15f,  0x1.15df66p-14f,  0x1.743e96p-14f,
    0x1.47ae16p-13f,  0x1.19ce0ap-12f,  0x1.8fc506p-12f,  0x1.02de02p-11f,  0x1.3dd982p-11f,
    0x1.78d5p-11f,    0x1.b3d07cp-11f,  0x1.eecbfep-11f,  0x1.4fdf3ap-10f,  0x1.e353f8p-10f,
    0x1.3b645ap-9f,   0x1.851eb8p-9f,   0x1.ced914p-9f,   0x1.0c49bap-8f,   0x1.3126e8p-8f,
    0x1.56041ap-8f,   0x1.7ae148p-8f,   0x1.9fbe76p-8f,   0x1.c49ba6p-8f,   0x1.e978d4p-8f,
    0x1.072b02p-7f,   0x1.19999ap-7f,   0x1.2c083p-7f,    0x1.3e76c8p-7f,   0x1.75c29p-7f,
    0x1.d1eb86p-7f,   0x1.170a3ep-6f,   0x1.451ebap-6f,   0x1.733334p-6f,   0x1.a147aep-6f,
    0x1.cf5c2ap-6f,   0x1.fd70a4p-6f,   0x1.15c29p-5f,    0x1.2ccccep-5f,   0x1.43d70ap-5f,
    0x1.5ae146p-5f,   0x1.71eb86p-5f,   0x1.88f5c2p-5f,   0x1.ap-5f,        0x1.b70a3ep-5f,
    0x1.ce147ap-5f,   0x1.e51ebap-5f,   0x1.fc28f6p-5f,   0x1.09999ap-4f,   0x1.151ebap-4f,
    0x1.20a3d6p-4f,   0x1.2c28f6p-4f,   0x1.37ae14p-4f,   0x1.433334p-4f,   0x1.4eb854p-4f,
    0x1.5a3d7p-4f,    0x1.65c29p-4f,    0x1.7147aep-4f,   0x1.7ccccep-4f,   0x1.8851eep-4f,
    0x1.93d70ap-4f,   0x1.b66668p-4f,   0x1.fp-4f,        0x1.14ccccp-3f,   0x1.31999ap-3f,
    0x1.4e6666p-3f,   0x1.6b3334p-3f,   0x1.88p-3f,       0x1.a4ccccp-3f,   0x1.c1999ap-3f,
    0x1.de6666p-3f,   0x1.fb3332p-3f,   0x1.0cp-2f,       0x1.1a6668p-2f,   0x1.28ccccp-2f,
    0x1.373334p-2f,   0x1.459998p-2f,   0x1.54p-2f,       0x1.626666p-2f,   0x1.70ccccp-2f,
    0x1.7f3334p-2f,   0x1.8d9998p-2f,   0x1.9cp-2f,       0x1.aa6666p-2f,   0x1.b8ccccp-2f,
    0x1.c73334p-2f,   0x1.d59998p-2f,   0x1.e4p-2f,       0x1.f26664p-2f,   0x1.006666p-1f,
    0x1.079998p-1f,   0x1.0eccccp-1f,   0x1.16p-1f,       0x1.1d3334p-1f,   0x1.246668p-1f,
    0x1.2b999ap-1f,   0x1.32ccccp-1f,   0x1.3ap-1f,       0x1.413334p-1f,   0x1.486668p-1f,
    0x1.4f999ap-1f,   0x1.56ccccp-1f,   0x1.5ep-1f,       0x1.653334p-1f,   0x1.6c6668p-1f,
    0x1.73999ap-1f,   0x1.7accccp-1f,   0x1.82p-1f,       0x1.893334p-1f,   0x1.906666p-1f,
    0x1.97999ap-1f,   0x1.9eccccp-1f,   0x1.a6p-1f,       0x1.ad3334p-1f,   0x1.b46666p-1f,
    0x1.bb999ap-1f,   0x1.c2ccccp-1f,   0x1.cap-1f,       0x1.d13334p-1f,   0x1.d86666p-1f,
    0x1.df999ap-1f,   0x1.e6ccccp-1f,   0x1.eep-1f,       0x1.f53334p-1f,   0x1.fc6666p-1f,
    0x1p+0f,
};
static const float unsigned_map[256] = {
    0x0p+0f,         0x1.5cf754p-22f, 0x1.a0133p-21f,  0x1.1d367p-19f,  0x1.2599ecp-18f,
    0x1.bc98a2p-18f, 0x1.29cbaap-17f, 0x1.0624dcp-16f, 0x1.c2e34p-16f,  0x1.3fd0dp-15f,
    0x1.9e3p-15f,    0x1.fc8f34p-15f, 0x1.2d7732p-14f, 0x1.5ca6c8p-14f, 0x1.8bd662p-14f,
    0x1.0cb296p-13f, 0x1.82a994p-13f, 0x1.f8a092p-13f, 0x1.374bc8p-12f, 0x1.724744p-12f,
    0x1.ad42c6p-12f, 0x1.e83e44p-12f, 0x1.119ce2p-11f, 0x1.2f1aap-11f,  0x1.4c986p-11f,
    0x1.6a162p-11f,  0x1.8793dep-11f, 0x1.a511ap-11f,  0x1.c28f5ep-11f, 0x1.e00d1cp-11f,
    0x1.fd8adcp-11f, 0x1.2b020cp-10f, 0x1.74bc6ap-10f, 0x1.be76c8p-10f, 0x1.041894p-9f,
    0x1.28f5c2p-9f,  0x1.4dd2fp-9f,   0x1.72b02p-9f,   0x1.978d4ep-9f,  0x1.bc6a8p-9f,
    0x1.e147aep-9f,  0x1.03126ep-8f,  0x1.158104p-8f,  0x1.27ef9ep-8f,  0x1.3a5e34p-8f,
    0x1.4cccccp-8f,  0x1.5f3b64p-8f,  0x1.71a9fap-8f,  0x1.841894p-8f,  0x1.96872ap-8f,
    0x1.a8f5c2p-8f,  0x1.bb645cp-8f,  0x1.cdd2fp-8f,   0x1.e0418ap-8f,  0x1.f2b01ep-8f,
    0x1.028f5cp-7f,  0x1.0bc6a8p-7f,  0x1.14fdf2p-7f,  0x1.1e354p-7f,   0x1.276c8ap-7f,
    0x1.30a3d6p-7f,  0x1.39db24p-7f,  0x1.43126ep-7f,  0x1.5eb854p-7f,  0x1.8ccccep-7f,
    0x1.bae146p-7f,  0x1.e8f5c4p-7f,  0x1.0b851ep-6f,  0x1.228f5ep-6f,  0x1.39999ap-6f,
    0x1.50a3d6p-6f,  0x1.67ae16p-6f,  0x1.7eb852p-6f,  0x1.95c28ep-6f,  0x1.accccep-6f,
    0x1.c3d70ep-6f,  0x1.dae146p-6f,  0x1.f1eb86p-6f,  0x1.047aep-5f,   0x1.1p-5f,
    0x1.1b851ep-5f,  0x1.270a3ep-5f,  0x1.328f5ep-5f,  0x1.3e147ap-5f,  0x1.49999ap-5f,
    0x1.551eb8p-5f,  0x1.60a3d6p-5f,  0x1.6c28f6p-5f,  0x1.77ae14p-5f,  0x1.833334p-5f,
    0x1.8eb85p-5f,   0x1.9a3d7p-5f,   0x1.a5c28ep-5f,  0x1.b147aep-5f,  0x1.bccccep-5f,
    0x1.c851eep-5f,  0x1.d3d70ep-5f,  0x1.df5c2ap-5f,  0x1.eae146p-5f,  0x1.f66666p-5f,
    0x1.00f5c4p-4f,  0x1.06b854p-4f,  0x1.0c7ae2p-4f,  0x1.123d7p-4f,   0x1.18p-4f,
    0x1.1dc29p-4f,   0x1.23852p-4f,   0x1.2947aep-4f,  0x1.2f0a3ep-4f,  0x1.34cccep-4f,
    0x1.3a8f5ep-4f,  0x1.4051ecp-4f,  0x1.46147cp-4f,  0x1.4bd70ap-4f,  0x1.51999ap-4f,
    0x1.575c2ap-4f,  0x1.5d1eb8p-4f,  0x1.62e148p-4f,  0x1.68a3d6p-4f,  0x1.6e6666p-4f,
    0x1.7428f6p-4f,  0x1.79eb86p-4f,  0x1.7fae16p-4f,  0x1.8570a4p-4f,  0x1.8b3334p-4f,
    0x1.90f5c4p-4f,  0x1.96b852p-4f,  0x1.a8p-4f,      0x1.c4ccccp-4f,  0x1.e1999ap-4f,
    0x1.fe6666p-4f,  0x1.0d9998p-3f,  0x1.1cp-3f,      0x1.2a6668p-3f,  0x1.38ccccp-3f,
    0x1.473334p-3f,  0x1.559998p-3f,  0x1.64p-3f,      0x1.726668p-3f,  0x1.80ccccp-3f,
    0x1.8f3334p-3f,  0x1.9d9998p-3f,  0x1.acp-3f,      0x1.ba6668p-3f,  0x1.c8ccccp-3f,
    0x1.d73334p-3f,  0x1.e59998p-3f,  0x1.f4p-3f,      0x1.013332p-2f,  0x1.086666p-2f,
    0x1.0f999ap-2f,  0x1.16ccccp-2f,  0x1.1ep-2f,      0x1.253334p-2f,  0x1.2c6666p-2f,
    0x1.339998p-2f,  0x1.3accccp-2f,  0x1.42p-2f,      0x1.493334p-2f,  0x1.506666p-2f,
    0x1.579998p-2f,  0x1.5eccccp-2f,  0x1.66p-2f,      0x1.6d3334p-2f,  0x1.746666p-2f,
    0x1.7b9998p-2f,  0x1.82ccccp-2f,  0x1.8ap-2f,      0x1.913334p-2f,  0x1.986666p-2f,
    0x1.9f9998p-2f,  0x1.a6ccccp-2f,  0x1.aep-2f,      0x1.b53334p-2f,  0x1.bc6666p-2f,
    0x1.c39998p-2f,  0x1.caccccp-2f,  0x1.d2p-2f,      0x1.d93334p-2f,  0x1.e06666p-2f,
    0x1.e79998p-2f,  0x1.eeccccp-2f,  0x1.f6p-2f,      0x1.fd3332p-2f,  0x1.023334p-1f,
    0x1.05ccccp-1f,  0x1.096666p-1f,  0x1.0dp-1f,      0x1.109998p-1f,  0x1.143334p-1f,
    0x1.17ccccp-1f,  0x1.1b6668p-1f,  0x1.1fp-1f,      0x1.22999ap-1f,  0x1.263334p-1f,
    0x1.29ccccp-1f,  0x1.2d6668p-1f,  0x1.31p-1f,      0x1.34999ap-1f,  0x1.383334p-1f,
    0x1.3bccccp-1f,  0x1.3f6668p-1f,  0x1.43p-1f,      0x1.46999ap-1f,  0x1.4a3334p-1f,
    0x1.4dccccp-1f,  0x1.516668p-1f,  0x1.55p-1f,      0x1.58999ap-1f,  0x1.5c3334p-1f,
    0x1.5fccccp-1f,  0x1.636668p-1f,  0x1.67p-1f,      0x1.6a999ap-1f,  0x1.6e3334p-1f,
    0x1.71ccccp-1f,  0x1.756668p-1f,  0x1.79p-1f,      0x1.7c999ap-1f,  0x1.803334p-1f,
    0x1.83ccccp-1f,  0x1.876668p-1f,  0x1.8bp-1f,      0x1.8e9998p-1f,  0x1.923334p-1f,
    0x1.95ccccp-1f,  0x1.996668p-1f,  0x1.9dp-1f,      0x1.a09998p-1f,  0x1.a43334p-1f,
    0x1.a7ccccp-1f,  0x1.ab6668p-1f,  0x1.afp-1f,      0x1.b29998p-1f,  0x1.b63334p-1f,
    0x1.b9ccccp-1f,  0x1.bd6668p-1f,  0x1.c1p-1f,      0x1.c49998p-1f,  0x1.c83334p-1f,
    0x1.cbccccp-1f,  0x1.cf6668p-1f,  0x1.d3p-1f,      0x1.d69998p-1f,  0x1.da3334p-1f,
    0x1.ddccccp-1f,  0x1.e16668p-1f,  0x1.e5p-1f,      0x1.e89998p-1f,  0x1.ec3334p-1f,
    0x1.efccccp-1f,  0x1.f36668p-1f,  0x1.f7p-1f,      0x1.fa9998p-1f,  0x1.fe3334p-1f,
    0x1p+0f,
};

/* Per-step scalars, worked out once in double as bitsandbytes does in
 * Python, each rounded to fp32 where torch takes it as an operand. */
typedef struct {
  float beta1, beta2;
  float one_minus_beta1, one_minus_beta2;
  float decay;    /* 1 - lr wd; 1 without weight decay (p * 1 is p) */
  float neg_step; /* 8-bit: -lr / c1;  fp32: -lr c2 / c1 */
  float c2;       /* 8-bit: sqrt(1 - b2^t) */
  float eps;      /* 8-bit: eps;  fp32: eps c2 */
  float grad_scale;
} a8_consts;

/* The map's nearest entry to z: the last entry <= z by a branch-free binary
 * search, then the next one if strictly nearer. NaN (a block of zeros, or
 * inf / inf) compares false everywhere and gets entry 0, as in
 * bitsandbytes' quantiser. */
static inline __attribute__((always_inline)) uint8_t nearest(const float *map, float z) {
  unsigned i = 0;
  for (unsigned s = 128; s; s >>= 1) i += map[i + s] <= z ? s : 0;
  if (i < 255 && fabsf(z - map[i + 1]) < fabsf(z - map[i])) i++;
  return (uint8_t)i;
}

/* q[i] = the map's nearest entry to x[i] / absmax, for n <= one block. */
typedef void (*quantize_fn)(const float *map, const float *x, float absmax, uint8_t *q, int64_t n);

static void quantize_scalar(const float *map, const float *x, float absmax, uint8_t *q, int64_t n) {
  for (int64_t i = 0; i < n; i++) q[i] = nearest(map, x[i] / absmax);
}

/* The same search, 16 lanes at a time: each halving step gathers the
 * candidate entries (a NaN lane never moves, as in nearest()). */
__attribute__((target("avx512f"))) static void quantize_avx512(const float *map, const float *x,
                                                               float absmax, uint8_t *q,
                                                               int64_t n) {
  const __m512 vmax = _mm512_set1_ps(absmax);
  const __m512i last = _mm512_set1_epi32(255), one = _mm512_set1_epi32(1);
  const __m512i sixteen = _mm512_set1_epi32(16);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 z = _mm512_div_ps(_mm512_loadu_ps(x + i), vmax);
    /* The first four halvings land on a multiple of 16: count the
     * entries 16, 32, ..., 240 at or below z (broadcasts, no gather). */
    __m512i idx = _mm512_setzero_si512();
    for (int e = 16; e < 256; e += 16)
      idx = _mm512_mask_add_epi32(idx, _mm512_cmp_ps_mask(_mm512_set1_ps(map[e]), z, _CMP_LE_OQ),
                                  idx, sixteen);
    for (int s = 8; s; s >>= 1) {
      const __m512i cand = _mm512_add_epi32(idx, _mm512_set1_epi32(s));
      const __m512 c = _mm512_i32gather_ps(cand, map, 4);
      idx = _mm512_mask_mov_epi32(idx, _mm512_cmp_ps_mask(c, z, _CMP_LE_OQ), cand);
    }
    const __m512i up = _mm512_min_epi32(_mm512_add_epi32(idx, one), last);
    const __m512 dl = _mm512_abs_ps(_mm512_sub_ps(z, _mm512_i32gather_ps(idx, map, 4)));
    const __m512 dr = _mm512_abs_ps(_mm512_sub_ps(z, _mm512_i32gather_ps(up, map, 4)));
    idx = _mm512_mask_mov_epi32(idx, _mm512_cmp_ps_mask(dr, dl, _CMP_LT_OQ), up);
    _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8(idx));
  }
  quantize_scalar(map, x + i, absmax, q + i, n - i);
}

__attribute__((target("avx2"))) static void quantize_avx2(const float *map, const float *x,
                                                          float absmax, uint8_t *q, int64_t n) {
  const __m256 vmax = _mm256_set1_ps(absmax);
  const __m256i last = _mm256_set1_epi32(255), one = _mm256_set1_epi32(1);
  const __m256i sixteen = _mm256_set1_epi32(16);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 z = _mm256_div_ps(_mm256_loadu_ps(x + i), vmax);
    __m256i idx = _mm256_setzero_si256();
    for (int e = 16; e < 256; e += 16) {
      const __m256 le = _mm256_cmp_ps(_mm256_set1_ps(map[e]), z, _CMP_LE_OQ);
      idx = _mm256_add_epi32(idx, _mm256_and_si256(_mm256_castps_si256(le), sixteen));
    }
    for (int s = 8; s; s >>= 1) {
      const __m256i cand = _mm256_add_epi32(idx, _mm256_set1_epi32(s));
      const __m256 le = _mm256_cmp_ps(_mm256_i32gather_ps(map, cand, 4), z, _CMP_LE_OQ);
      idx = _mm256_blendv_epi8(idx, cand, _mm256_castps_si256(le));
    }
    const __m256i up = _mm256_min_epi32(_mm256_add_epi32(idx, one), last);
    const __m256 dl = _mm256_andnot_ps(sign, _mm256_sub_ps(z, _mm256_i32gather_ps(map, idx, 4)));
    const __m256 dr = _mm256_andnot_ps(sign, _mm256_sub_ps(z, _mm256_i32gather_ps(map, up, 4)));
    idx = _mm256_blendv_epi8(idx, up, _mm256_castps_si256(_mm256_cmp_ps(dr, dl, _CMP_LT_OQ)));
    int32_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, idx);
    for (int j = 0; j < 8; j++) q[i + j] = (uint8_t)lanes[j];
  }
  quantize_scalar(map, x + i, absmax, q + i, n - i);
}

/* One block (n <= LZ_ADAMW8BIT_BLOCK) of the 8-bit update: dequantise,
 * update, then requantise against the block's new absmax (from 0, skipping
 * NaN as fmaxf does: a block of NaN keeps absmax 0, as bitsandbytes' does). fmaf is the one
 * contraction allowed: the rest is rounded op by op, as torch's is. */
static inline __attribute__((always_inline)) void block8_body(
    float *restrict p, const float *restrict grad, uint8_t *restrict qm, uint8_t *restrict qv,
    float *restrict absmax_m, float *restrict absmax_v, const a8_consts *k, int64_t n,
    quantize_fn quantize) {
  float m[LZ_ADAMW8BIT_BLOCK], v[LZ_ADAMW8BIT_BLOCK];
  const float am = *absmax_m, av = *absmax_v;
  float max_m = 0.0f, max_v = 0.0f;
  for (int64_t i = 0; i < n; i++) {
    const float g = grad[i] * k->grad_scale;
    const float mi = fmaf(g, k->one_minus_beta1, signed_map[qm[i]] * am * k->beta1);
    const float vi = fmaf(k->one_minus_beta2 * g, g, unsigned_map[qv[i]] * av * k->beta2);
    const float denom = sqrtf(vi) / k->c2 + k->eps;
    p[i] = p[i] * k->decay + k->neg_step * mi / denom;
    m[i] = mi, v[i] = vi;
    /* fmaxf's NaN rule (the other operand) without its libm call: max_m
     * starts at 0 and is never NaN, and a NaN |mi| compares false. */
    const float am_i = fabsf(mi), av_i = fabsf(vi);
    max_m = am_i > max_m ? am_i : max_m, max_v = av_i > max_v ? av_i : max_v;
  }
  *absmax_m = max_m, *absmax_v = max_v;
  quantize(signed_map, m, max_m, qm, n);
  quantize(unsigned_map, v, max_v, qv, n);
}

static inline __attribute__((always_inline)) void block32_body(float *restrict p,
                                                               const float *restrict grad,
                                                               float *restrict m, float *restrict v,
                                                               const a8_consts *k, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    const float g = grad[i] * k->grad_scale;
    const float mi = fmaf(g, k->one_minus_beta1, m[i] * k->beta1);
    const float vi = fmaf(k->one_minus_beta2 * g, g, v[i] * k->beta2);
    p[i] = fmaf(mi / (sqrtf(vi) + k->eps), k->neg_step, p[i] * k->decay);
    m[i] = mi, v[i] = vi;
  }
}

/* fmaf is one instruction only where FMA is enabled, which target_clones'
 * "avx2" does not imply: hence clones of our own, picked once. */
#define A8_CLONES(X)                                                                              \
  X(avx512, __attribute__((target("avx512f,fma"), optimize("fp-contract=off"))), quantize_avx512) \
  X(avx2, __attribute__((target("avx2,fma"), optimize("fp-contract=off"))), quantize_avx2)        \
  X(base, __attribute__((optimize("fp-contract=off"))), quantize_scalar)

#define A8_DEFINE(suffix, attrs, quantize)                                                       \
  attrs static void block8_##suffix(                                                             \
      float *restrict p, const float *restrict grad, uint8_t *restrict qm, uint8_t *restrict qv, \
      float *restrict absmax_m, float *restrict absmax_v, const a8_consts *k, int64_t n) {       \
    block8_body(p, grad, qm, qv, absmax_m, absmax_v, k, n, quantize);                            \
  }                                                                                              \
  attrs static void block32_##suffix(float *restrict p, const float *restrict grad,              \
                                     float *restrict m, float *restrict v, const a8_consts *k,   \
                                     int64_t n) {                                                \
    block32_body(p, grad, m, v, k, n);                                                           \
  }
A8_CLONES(A8_DEFINE)

typedef void (*block8_fn)(float *restrict, const float *restrict, uint8_t *restrict,
                          uint8_t *restrict, float *restrict, float *restrict, const a8_consts *,
                          int64_t);
typedef void (*block32_fn)(float *restrict, const float *restrict, float *restrict, float *restrict,
                           const a8_consts *, int64_t);

static int isa_level(void) {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma")) return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
  return 0;
}

/* ------------------------------------------------------------------ checks */

static lz_status check_args(const char *op, const lz_adamw_args *a) {
  if (!a) return lz_fail(LZ_ERR_INVALID, "%s: args is NULL", op);
  if (a->step < 1)
    return lz_fail(LZ_ERR_INVALID, "%s: args->step is %lld; steps count from 1", op,
                   (long long)a->step);
  LZ_TRY(lz_optim_check_arg(op, "lr", a->lr, LZ_OPTIM_NONNEG));
  LZ_TRY(lz_optim_check_arg(op, "beta1", a->beta1, LZ_OPTIM_UNIT));
  LZ_TRY(lz_optim_check_arg(op, "beta2", a->beta2, LZ_OPTIM_UNIT));
  LZ_TRY(lz_optim_check_arg(op, "eps", a->eps, LZ_OPTIM_NONNEG));
  LZ_TRY(lz_optim_check_arg(op, "weight_decay", a->weight_decay, LZ_OPTIM_NONNEG));
  return lz_optim_check_arg(op, "grad_scale", a->grad_scale, LZ_OPTIM_FINITE);
}

int64_t lz_adamw8bit_blocks(int64_t n) {
  return n <= 0 ? 0 : (n + LZ_ADAMW8BIT_BLOCK - 1) / LZ_ADAMW8BIT_BLOCK;
}

const float *lz_adamw8bit_map(int is_signed) { return is_signed ? signed_map : unsigned_map; }

lz_status lz_adamw8bit_step(lz_tensor *param, const lz_tensor *grad, lz_tensor *m, lz_tensor *v,
                            lz_tensor *absmax_m, lz_tensor *absmax_v, lz_tensor *working,
                            const lz_adamw_args *args) {
  const char *op = "adamw8bit_step";
  const lz_optim_tensors t = {.param = param,
                              .grad = grad,
                              .states = {m, v},
                              .state_names = {"m", "v"},
                              .n_states = 2,
                              .working = working};
  const lz_op_args a = {.t = {param, (lz_tensor *)grad, m, v, absmax_m, absmax_v, working},
                        .adamw = args};
  LZ_TRY(lz_op_check_dtypes(op, LZ_OP_ADAMW8BIT_STEP, &a));
  LZ_TRY(lz_optim_check_tensors(op, &t));
  if (m->dtype == LZ_U8) {
    const int64_t blocks = lz_adamw8bit_blocks(lz_tensor_numel(param));
    const char *why = "one per 256 elements of param";
    LZ_TRY(lz_check_numel(op, "absmax_m", absmax_m, blocks, why));
    LZ_TRY(lz_check_numel(op, "absmax_v", absmax_v, blocks, why));
  }
  LZ_TRY(check_args(op, args));
  return lz_op_run(op, LZ_OP_ADAMW8BIT_STEP, &a);
}

/* ------------------------------------------------------------------- pass */

lz_status lz_cpu_adamw8bit_step(const lz_op_args *a) {
  const lz_adamw_args *args = a->adamw;
  const int64_t n = lz_tensor_numel(a->t[0]);
  const int eight = a->t[2]->dtype == LZ_U8;
  const double lr = args->lr, b1 = args->beta1, b2 = args->beta2, wd = args->weight_decay;
  const double c1 = 1.0 - pow(b1, (double)args->step);
  const double c2 = sqrt(1.0 - pow(b2, (double)args->step));
  const a8_consts k = {
      .beta1 = args->beta1,
      .beta2 = args->beta2,
      .one_minus_beta1 = (float)(1.0 - b1),
      .one_minus_beta2 = (float)(1.0 - b2),
      .decay = wd > 0.0 ? (float)(1.0 - lr * wd) : 1.0f,
      .neg_step = eight ? (float)(-lr / c1) : (float)(-lr * c2 / c1),
      .c2 = (float)c2,
      .eps = eight ? args->eps : (float)((double)args->eps * c2),
      .grad_scale = args->grad_scale,
  };
  static const block8_fn b8[] = {block8_base, block8_avx2, block8_avx512};
  static const block32_fn b32[] = {block32_base, block32_avx2, block32_avx512};
  const int isa = isa_level();
  float *p = a->t[0]->data;
  const float *g = a->t[1]->data;
  lz_tensor *w = a->t[6];
  const lz_optim_store_fn store = w ? lz_optim_working_store(w->dtype) : NULL;
  const size_t wsize = w ? lz_dtype_size(w->dtype) : 0;
  const int64_t B = LZ_ADAMW8BIT_BLOCK;
#pragma omp parallel for schedule(static) if (n > (1 << 14))
  for (int64_t i0 = 0; i0 < n; i0 += B) {
    const int64_t len = n - i0 < B ? n - i0 : B;
    if (eight)
      b8[isa](p + i0, g + i0, (uint8_t *)a->t[2]->data + i0, (uint8_t *)a->t[3]->data + i0,
              (float *)a->t[4]->data + i0 / B, (float *)a->t[5]->data + i0 / B, &k, len);
    else
      b32[isa](p + i0, g + i0, (float *)a->t[2]->data + i0, (float *)a->t[3]->data + i0, &k, len);
    if (store) store((char *)w->data + (size_t)i0 * wsize, p + i0, len);
  }
  return LZ_OK;
}
