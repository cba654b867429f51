/* swiglu.c — the gated activation of Llama's MLP, as Hugging Face's LlamaMLP
 * computes it: out = silu(gate) * up, silu(g) = g / (1 + exp(-g)). CPU only.
 *
 * libm's expf is a function call per element that no compiler vectorizes
 * without -ffast-math, which made this memory-bound op compute bound; e^x
 * here is Cephes' expf, plain arithmetic that vectorizes. */
#include "lz_internal.h"

#include <math.h> /* INFINITY */

/* Elements per thread task. */
#define BLOCK (1 << 14)

/* cond ? a : b as a bit select, which GCC vectorizes where it would keep a
 * branch for a ternary on floats (it honours floating-point traps). */
static inline float select_f32(int cond, float a, float b) {
  uint32_t mask = -(uint32_t)cond; /* all ones or all zeros */
  return lz_bits_f32((lz_f32_bits(a) & mask) | (lz_f32_bits(b) & ~mask));
}

/* Cephes' expf: x = n ln2 + r, |r| <= ln2/2, e^r a degree-7 polynomial, 2^n
 * written into the exponent bits; within 2 ulps of e^x. n is rounded with
 * the 1.5 * 2^23 trick, which leaves it in the low bits of the sum (no float
 * to int conversion, so a NaN stays a NaN without undefined behaviour). The
 * input is clamped where e^x leaves the normal floats: below, the result is
 * the smallest normal (1 + it is 1); above 88.03 it is Inf, where expf
 * rounds to a finite float up to 88.72 (1 / (1 + e^x) is 0 or 3e-39). */
static inline float exp_approx(float x) {
  const float hi = 88.3762626647949f, lo = -87.3365447504019f;
  const float xc = select_f32(x > hi, hi, select_f32(x < lo, lo, x));
  const float magic = 12582912.0f; /* 1.5 * 2^23 */
  const float t = xc * 1.44269504088896341f + magic;
  const float n = t - magic;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const uint32_t scale = (lz_f32_bits(t) - lz_f32_bits(magic) + 127u) << 23;
  return select_f32(x > hi, INFINITY, p * lz_bits_f32(scale));
}

/* out may be gate or up: each element is read before it is written. */
LZ_DISPATCH static void swiglu_forward_block(float *out, const float *gate, const float *up,
                                             int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    const float g = gate[i];
    out[i] = g / (1.0f + exp_approx(-g)) * up[i];
  }
}

/* With s = sigmoid(g): d silu / dg = s (1 + g (1 - s)), as torch's silu
 * backward. dgate and dup may each be dout, gate or up. */
LZ_DISPATCH static void swiglu_backward_block(float *dgate, float *dup, const float *dout,
                                              const float *gate, const float *up, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    const float g = gate[i], u = up[i], d = dout[i];
    const float s = 1.0f / (1.0f + exp_approx(-g));
    dgate[i] = d * u * (s * (1.0f + g * (1.0f - s)));
    dup[i] = d * (g * s);
  }
}

/* Checks that each tensor is f32, shaped as gate and on the cpu. */
static lz_status check_like_gate(const char *op, int n, const char *const *names,
                                 const lz_tensor *const *ts) {
  LZ_TRY(lz_check_dtype(op, "gate", ts[0], LZ_F32));
  for (int i = 1; i < n; i++) LZ_TRY(lz_check_f32_like(op, names[i], ts[i], "gate", ts[0]));
  return lz_check_cpu_all(op, n, names, ts);
}

lz_status lz_swiglu_forward(lz_tensor *out, const lz_tensor *gate, const lz_tensor *up) {
  const char *op = "swiglu_forward";
  const char *names[] = {"gate", "up", "out"};
  const lz_tensor *ts[] = {gate, up, out};
  LZ_TRY(check_like_gate(op, 3, names, ts));
  const int64_t n = lz_tensor_numel(gate);
  float *o = out->data;
  const float *gp = gate->data, *up_ = up->data;
#pragma omp parallel for schedule(static) if (n > BLOCK)
  for (int64_t i0 = 0; i0 < n; i0 += BLOCK)
    swiglu_forward_block(o + i0, gp + i0, up_ + i0, n - i0 < BLOCK ? n - i0 : BLOCK);
  return LZ_OK;
}

lz_status lz_swiglu_backward(lz_tensor *dgate, lz_tensor *dup, const lz_tensor *dout,
                             const lz_tensor *gate, const lz_tensor *up) {
  const char *op = "swiglu_backward";
  const char *names[] = {"gate", "up", "dout", "dgate", "dup"};
  const lz_tensor *ts[] = {gate, up, dout, dgate, dup};
  LZ_TRY(check_like_gate(op, 5, names, ts));
  if (dgate->data == dup->data)
    return lz_fail(LZ_ERR_INVALID,
                   "%s: dgate and dup are the same memory; give each gradient its own buffer", op);
  const int64_t n = lz_tensor_numel(gate);
  float *dg = dgate->data, *du = dup->data;
  const float *dop = dout->data, *gp = gate->data, *up_ = up->data;
#pragma omp parallel for schedule(static) if (n > BLOCK)
  for (int64_t i0 = 0; i0 < n; i0 += BLOCK)
    swiglu_backward_block(dg + i0, du + i0, dop + i0, gp + i0, up_ + i0,
                          n - i0 < BLOCK ? n - i0 : BLOCK);
  return LZ_OK;
}
