/* swiglu.c — the gated activation of Llama's MLP, as Hugging Face's LlamaMLP
 * computes it: out = silu(gate) * up, silu(g) = g / (1 + exp(-g)). A cpu kernel
 * (sim runs it too).
 *
 * libm's expf is a function call per element that no compiler vectorizes
 * without -ffast-math, which made this memory-bound op compute bound; e^x
 * here is lz_exp, plain arithmetic that vectorizes. */
#include "lz_backend.h"
#include "lz_internal.h"
#include "lz_vecmath.h" /* lz_exp */

/* Elements per thread task. */
#define BLOCK (1 << 14)

/* out may be gate or up: each element is read before it is written. */
LZ_DISPATCH static void swiglu_forward_block(float *out, const float *gate, const float *up,
                                             int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    const float g = gate[i];
    out[i] = g / (1.0f + lz_exp(-g)) * up[i];
  }
}

/* With s = sigmoid(g): d silu / dg = s (1 + g (1 - s)), as torch's silu
 * backward. dgate and dup may each be dout, gate or up. */
LZ_DISPATCH static void swiglu_backward_block(float *dgate, float *dup, const float *dout,
                                              const float *gate, const float *up, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    const float g = gate[i], u = up[i], d = dout[i];
    const float s = 1.0f / (1.0f + lz_exp(-g));
    dgate[i] = d * u * (s * (1.0f + g * (1.0f - s)));
    dup[i] = d * (g * s);
  }
}

/* Checks that gate and each argument of the list are f32 and shaped as gate. */
static lz_status check_like_gate(const char *op, const lz_tensor *gate, const lz_arg *args) {
  LZ_TRY(lz_check_dtype(op, "gate", gate, LZ_F32));
  for (const lz_arg *a = args; a->name; a++)
    LZ_TRY(lz_check_f32_like(op, a->name, a->t, "gate", gate));
  return LZ_OK;
}

lz_status lz_swiglu_forward(lz_tensor *out, const lz_tensor *gate, const lz_tensor *up) {
  const char *op = "swiglu_forward";
  LZ_TRY(check_like_gate(op, gate, (lz_arg[]){{"up", up}, {"out", out}, {0}}));
  LZ_DEVICE_DISPATCH(op, LZ_OP_SWIGLU_FORWARD, .t = {out, (lz_tensor *)gate, (lz_tensor *)up});
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
  LZ_TRY(check_like_gate(
      op, gate, (lz_arg[]){{"up", up}, {"dout", dout}, {"dgate", dgate}, {"dup", dup}, {0}}));
  if (dgate->data == dup->data)
    return lz_fail(LZ_ERR_INVALID,
                   "%s: dgate and dup are the same memory; give each gradient its own buffer", op);
  LZ_DEVICE_DISPATCH(op, LZ_OP_SWIGLU_BACKWARD,
                     .t = {dgate, dup, (lz_tensor *)dout, (lz_tensor *)gate, (lz_tensor *)up});
  const int64_t n = lz_tensor_numel(gate);
  float *dg = dgate->data, *du = dup->data;
  const float *dop = dout->data, *gp = gate->data, *up_ = up->data;
#pragma omp parallel for schedule(static) if (n > BLOCK)
  for (int64_t i0 = 0; i0 < n; i0 += BLOCK)
    swiglu_backward_block(dg + i0, du + i0, dop + i0, gp + i0, up_ + i0,
                          n - i0 < BLOCK ? n - i0 : BLOCK);
  return LZ_OK;
}
