/* swiglu.c — the gated activations of a gated MLP: Llama's, as Hugging
 * Face's LlamaMLP computes it: out = silu(gate) * up, silu(g) = g / (1 +
 * exp(-g)); and Gemma's GeGLU: out = gelu(gate) * up with the tanh GELU
 * (gelu_pytorch_tanh). cpu kernels (sim runs them too).
 *
 * libm's expf and tanhf are function calls per element that no compiler
 * vectorizes without -ffast-math, which made these memory-bound ops compute
 * bound; e^x and tanh here are lz_exp and lz_tanh, plain arithmetic that
 * vectorizes.
 *
 * gate and up (and dout) are f32 or all bf16; dgate and dup are f32. bf16
 * inputs are widened in chunks on the stack and go through the f32 code, so
 * the result is bitwise the f32 one on the widened inputs. out is f32, or
 * bf16 where it only feeds a bf16 GEMM (the down projection): computed in f32
 * chunks on the stack and rounded as tensor_copy rounds, so the result is
 * bitwise the f32 out converted, without a cast pass reading it back; dgate
 * and dup likewise (both bf16: each feeds its projection's backward GEMMs).
 *
 * lz_swiglu_packed_* read gate and up from one tensor, each row gate's H
 * values then up's (Phi-3's gate_up_proj, chunked in two as Phi3MLP does):
 * the same kernel with up NULL and i[0] = H. */
#include "mem/lz_backend.h"
#include "mem/lz_internal.h"
#include "kernels/lz_vecmath.h" /* lz_exp, lz_gelu, lz_gelu_grad */

/* Elements per thread task. */
#define BLOCK (1 << 14)

/* The gate's activation. */
typedef enum { SILU, GELU_TANH } gate_act;

/* out may be gate or up: each element is read before it is written. */
LZ_DISPATCH static void swiglu_forward_block(float *out, const float *gate, const float *up,
                                             int64_t n, gate_act act) {
  if (act == GELU_TANH) {
    for (int64_t i = 0; i < n; i++) out[i] = lz_gelu(gate[i]) * up[i];
    return;
  }
  for (int64_t i = 0; i < n; i++) {
    const float g = gate[i];
    out[i] = g / (1.0f + lz_exp(-g)) * up[i];
  }
}

/* With s = sigmoid(g): d silu / dg = s (1 + g (1 - s)), as torch's silu
 * backward; torch's gelu backward is d gelu / dg times the incoming d * up.
 * dgate and dup may each be dout, gate or up. */
LZ_DISPATCH static void swiglu_backward_block(float *dgate, float *dup, const float *dout,
                                              const float *gate, const float *up, int64_t n,
                                              gate_act act) {
  if (act == GELU_TANH) {
    for (int64_t i = 0; i < n; i++) {
      const float g = gate[i], u = up[i], d = dout[i];
      dgate[i] = d * u * lz_gelu_grad(g);
      dup[i] = d * lz_gelu(g);
    }
    return;
  }
  for (int64_t i = 0; i < n; i++) {
    const float g = gate[i], u = up[i], d = dout[i];
    const float s = 1.0f / (1.0f + lz_exp(-g));
    dgate[i] = d * u * (s * (1.0f + g * (1.0f - s)));
    dup[i] = d * (g * s);
  }
}

/* Elements widened at a time from bf16. */
#define CHUNK 1024

LZ_DISPATCH static void swiglu_forward_block_bf16(float *out, const uint16_t *gate,
                                                  const uint16_t *up, int64_t n, gate_act act) {
  float g[CHUNK], u[CHUNK];
  for (int64_t i0 = 0; i0 < n; i0 += CHUNK) {
    const int64_t m = n - i0 < CHUNK ? n - i0 : CHUNK;
    lz_row_to_f32(g, gate + i0, LZ_BF16, m);
    lz_row_to_f32(u, up + i0, LZ_BF16, m);
    swiglu_forward_block(out + i0, g, u, m, act);
  }
}

LZ_DISPATCH static void swiglu_backward_block_bf16(float *dgate, float *dup, const uint16_t *dout,
                                                   const uint16_t *gate, const uint16_t *up,
                                                   int64_t n, gate_act act) {
  float d[CHUNK], g[CHUNK], u[CHUNK];
  for (int64_t i0 = 0; i0 < n; i0 += CHUNK) {
    const int64_t m = n - i0 < CHUNK ? n - i0 : CHUNK;
    lz_row_to_f32(d, dout + i0, LZ_BF16, m);
    lz_row_to_f32(g, gate + i0, LZ_BF16, m);
    lz_row_to_f32(u, up + i0, LZ_BF16, m);
    swiglu_backward_block(dgate + i0, dup + i0, d, g, u, m, act);
  }
}

/* out[0:n] (of dtype odt) from gate[0:n] and up[0:n] (of dtype dt). */
LZ_DISPATCH static void gated_forward_span(void *out, lz_dtype odt, const void *gate,
                                           const void *up, lz_dtype dt, int64_t n, gate_act act) {
  if (odt == LZ_F32) {
    if (dt == LZ_BF16)
      swiglu_forward_block_bf16(out, gate, up, n, act);
    else
      swiglu_forward_block(out, gate, up, n, act);
    return;
  }
  float o[CHUNK];
  for (int64_t i0 = 0; i0 < n; i0 += CHUNK) {
    const int64_t m = n - i0 < CHUNK ? n - i0 : CHUNK;
    if (dt == LZ_BF16)
      swiglu_forward_block_bf16(o, (const uint16_t *)gate + i0, (const uint16_t *)up + i0, m, act);
    else
      swiglu_forward_block(o, (const float *)gate + i0, (const float *)up + i0, m, act);
    lz_row_to_bf16((uint16_t *)out + i0, o, m);
  }
}

/* dgate[0:n] and dup[0:n] (both of dtype odt) from dout, gate and up (of
 * dtype dt). */
LZ_DISPATCH static void gated_backward_span(void *dgate, void *dup, lz_dtype odt, const void *dout,
                                            const void *gate, const void *up, lz_dtype dt,
                                            int64_t n, gate_act act) {
  if (odt == LZ_F32) {
    if (dt == LZ_BF16)
      swiglu_backward_block_bf16(dgate, dup, dout, gate, up, n, act);
    else
      swiglu_backward_block(dgate, dup, dout, gate, up, n, act);
    return;
  }
  float dg[CHUNK], du[CHUNK];
  for (int64_t i0 = 0; i0 < n; i0 += CHUNK) {
    const int64_t m = n - i0 < CHUNK ? n - i0 : CHUNK;
    if (dt == LZ_BF16)
      swiglu_backward_block_bf16(dg, du, (const uint16_t *)dout + i0, (const uint16_t *)gate + i0,
                                 (const uint16_t *)up + i0, m, act);
    else
      swiglu_backward_block(dg, du, (const float *)dout + i0, (const float *)gate + i0,
                            (const float *)up + i0, m, act);
    lz_row_to_bf16((uint16_t *)dgate + i0, dg, m);
    lz_row_to_bf16((uint16_t *)dup + i0, du, m);
  }
}

/* Element i of a float buffer of dtype dt (f32, or 2-byte bf16). */
static void *element(void *p, lz_dtype dt, int64_t i) {
  return (char *)p + i * (dt == LZ_F32 ? 4 : 2);
}

/* The shapes of a call whose dtypes are checked: the inputs shaped as gate,
 * the (f32) outputs too, overwriting no bf16 input. */
static lz_status check_like_gate(const char *op, const lz_tensor *gate, const lz_arg *inputs,
                                 const lz_arg *outputs) {
  LZ_TRY(lz_check_present(op, "gate", gate));
  for (const lz_arg *a = inputs; a->name; a++)
    LZ_TRY(lz_check_same_shape(op, a->name, a->t, "gate", gate));
  for (const lz_arg *a = outputs; a->name; a++) {
    LZ_TRY(lz_check_same_shape(op, a->name, a->t, "gate", gate));
    LZ_TRY(lz_check_no_alias(op, a->name, a->t, "gate", gate));
    for (const lz_arg *in = inputs; in->name; in++)
      LZ_TRY(lz_check_no_alias(op, a->name, a->t, in->name, in->t));
  }
  return LZ_OK;
}

/* A bf16 out is narrower than an f32 input: threads would overwrite
 * elements others have yet to read. */
static lz_status check_bf16_out(const char *op, const lz_tensor *out, const lz_tensor *gate,
                                const lz_tensor *up) {
  if (out->dtype == LZ_F32) return LZ_OK;
  if (out->data == gate->data || (up && out->data == up->data))
    return lz_fail(LZ_ERR_INVALID,
                   "%s: a bf16 out shares memory with an input; give out its own buffer", op);
  return LZ_OK;
}

static lz_status gated_forward(const char *op, lz_op id, lz_tensor *out, const lz_tensor *gate,
                               const lz_tensor *up) {
  const lz_op_args args = {.t = {out, (lz_tensor *)gate, (lz_tensor *)up}};
  LZ_TRY(lz_op_check_dtypes(op, id, &args)); /* the alias check reads them */
  LZ_TRY(check_like_gate(op, gate, (lz_arg[]){{"up", up}, {0}}, (lz_arg[]){{"out", out}, {0}}));
  LZ_TRY(check_bf16_out(op, out, gate, up));
  return lz_op_run(op, id, &args);
}

/* The packed form: row r's gate at gate + 2H r, its up H further. */
static lz_status swiglu_packed_forward_cpu(lz_tensor *out, const lz_tensor *gate, int64_t H,
                                           gate_act act) {
  const int64_t rows = H ? lz_tensor_numel(gate) / (2 * H) : 0;
  const lz_dtype dt = gate->dtype, odt = out->dtype;
#pragma omp parallel for schedule(static) if (rows * H > BLOCK)
  for (int64_t r = 0; r < rows; r++)
    gated_forward_span(element(out->data, odt, r * H), odt, element(gate->data, dt, 2 * H * r),
                       element(gate->data, dt, 2 * H * r + H), dt, H, act);
  return LZ_OK;
}

static lz_status swiglu_packed_backward_cpu(lz_tensor *dgu, const lz_tensor *dout,
                                            const lz_tensor *gate, int64_t H, gate_act act) {
  const int64_t rows = H ? lz_tensor_numel(gate) / (2 * H) : 0;
  const lz_dtype dt = gate->dtype, odt = dgu->dtype;
  void *dg = dgu->data, *g = gate->data, *d = dout->data;
#pragma omp parallel for schedule(static) if (rows * H > BLOCK)
  for (int64_t r = 0; r < rows; r++)
    gated_backward_span(element(dg, odt, 2 * H * r), element(dg, odt, 2 * H * r + H), odt,
                        element(d, dt, H * r), element(g, dt, 2 * H * r),
                        element(g, dt, 2 * H * r + H), dt, H, act);
  return LZ_OK;
}

static lz_status cpu_gated_forward(const lz_op_args *a, gate_act act) {
  lz_tensor *out = a->t[0];
  const lz_tensor *gate = a->t[1], *up = a->t[2];
  if (!up) return swiglu_packed_forward_cpu(out, gate, a->i[0], act);
  const int64_t n = lz_tensor_numel(gate);
  const lz_dtype dt = gate->dtype, odt = out->dtype;
#pragma omp parallel for schedule(static) if (n > BLOCK)
  for (int64_t i0 = 0; i0 < n; i0 += BLOCK)
    gated_forward_span(element(out->data, odt, i0), odt, element(gate->data, dt, i0),
                       element(up->data, dt, i0), dt, n - i0 < BLOCK ? n - i0 : BLOCK, act);
  return LZ_OK;
}

static lz_status gated_backward(const char *op, lz_op id, lz_tensor *dgate, lz_tensor *dup,
                                const lz_tensor *dout, const lz_tensor *gate, const lz_tensor *up) {
  const lz_op_args args = {
      .t = {dgate, dup, (lz_tensor *)dout, (lz_tensor *)gate, (lz_tensor *)up}};
  LZ_TRY(lz_op_check_dtypes(op, id, &args));
  LZ_TRY(check_like_gate(op, gate, (lz_arg[]){{"up", up}, {"dout", dout}, {0}},
                         (lz_arg[]){{"dgate", dgate}, {"dup", dup}, {0}}));
  if (dgate->data == dup->data)
    return lz_fail(LZ_ERR_INVALID,
                   "%s: dgate and dup are the same memory; give each gradient its own buffer", op);
  LZ_TRY(check_bf16_out(op, dgate, dout, gate));
  LZ_TRY(check_bf16_out(op, dup, dout, gate));
  LZ_TRY(check_bf16_out(op, dgate, up, NULL));
  LZ_TRY(check_bf16_out(op, dup, up, NULL));
  return lz_op_run(op, id, &args);
}

static lz_status cpu_gated_backward(const lz_op_args *a, gate_act act) {
  lz_tensor *dgate = a->t[0], *dup = a->t[1];
  const lz_tensor *dout = a->t[2], *gate = a->t[3], *up = a->t[4];
  if (!up) return swiglu_packed_backward_cpu(dgate, dout, gate, a->i[0], act);
  const int64_t n = lz_tensor_numel(gate);
  const lz_dtype dt = gate->dtype, odt = dgate->dtype;
#pragma omp parallel for schedule(static) if (n > BLOCK)
  for (int64_t i0 = 0; i0 < n; i0 += BLOCK)
    gated_backward_span(element(dgate->data, odt, i0), element(dup->data, odt, i0), odt,
                        element(dout->data, dt, i0), element(gate->data, dt, i0),
                        element(up->data, dt, i0), dt, n - i0 < BLOCK ? n - i0 : BLOCK, act);
  return LZ_OK;
}

lz_status lz_swiglu_forward(lz_tensor *out, const lz_tensor *gate, const lz_tensor *up) {
  return gated_forward("swiglu_forward", LZ_OP_SWIGLU_FORWARD, out, gate, up);
}

lz_status lz_cpu_swiglu_forward(const lz_op_args *a) { return cpu_gated_forward(a, SILU); }

lz_status lz_swiglu_backward(lz_tensor *dgate, lz_tensor *dup, const lz_tensor *dout,
                             const lz_tensor *gate, const lz_tensor *up) {
  return gated_backward("swiglu_backward", LZ_OP_SWIGLU_BACKWARD, dgate, dup, dout, gate, up);
}

lz_status lz_cpu_swiglu_backward(const lz_op_args *a) { return cpu_gated_backward(a, SILU); }

lz_status lz_geglu_forward(lz_tensor *out, const lz_tensor *gate, const lz_tensor *up) {
  return gated_forward("geglu_forward", LZ_OP_GEGLU_FORWARD, out, gate, up);
}

lz_status lz_cpu_geglu_forward(const lz_op_args *a) { return cpu_gated_forward(a, GELU_TANH); }

lz_status lz_geglu_backward(lz_tensor *dgate, lz_tensor *dup, const lz_tensor *dout,
                            const lz_tensor *gate, const lz_tensor *up) {
  return gated_backward("geglu_backward", LZ_OP_GEGLU_BACKWARD, dgate, dup, dout, gate, up);
}

lz_status lz_cpu_geglu_backward(const lz_op_args *a) { return cpu_gated_backward(a, GELU_TANH); }

/* gate [..., 2H]; out, dout [..., H] with the same leading dimensions. */
static lz_status check_packed(const char *op, const char *half_name, const lz_tensor *half,
                              const lz_tensor *gate) {
  LZ_TRY(lz_check_present(op, "gate", gate));
  LZ_TRY(lz_check_present(op, half_name, half));
  const int nd = gate->ndim;
  int ok = half->ndim == nd && nd >= 1 && gate->shape[nd - 1] % 2 == 0 &&
           half->shape[nd - 1] * 2 == gate->shape[nd - 1];
  for (int d = 0; ok && d < nd - 1; d++) ok = half->shape[d] == gate->shape[d];
  if (!ok) {
    char a[96], b[96];
    return lz_fail(LZ_ERR_INVALID,
                   "%s: %s is %s but gate is %s; gate's last dimension must be twice %s's "
                   "(gate then up), the others the same",
                   op, half_name, lz_tensor_describe(half, a, sizeof a),
                   lz_tensor_describe(gate, b, sizeof b), half_name);
  }
  return LZ_OK;
}

lz_status lz_swiglu_packed_forward(lz_tensor *out, const lz_tensor *gate) {
  const char *op = "swiglu_forward";
  LZ_TRY(check_packed(op, "out", out, gate));
  const lz_op_args args = {.t = {out, (lz_tensor *)gate, NULL},
                           .i = {out->ndim ? out->shape[out->ndim - 1] : 0}};
  LZ_TRY(lz_op_check_dtypes(op, LZ_OP_SWIGLU_FORWARD, &args));
  if (out->data == gate->data)
    return lz_fail(LZ_ERR_INVALID,
                   "%s: out and gate are the same memory; rows of different widths cannot "
                   "share it, give out its own buffer",
                   op);
  return lz_op_run(op, LZ_OP_SWIGLU_FORWARD, &args);
}

lz_status lz_swiglu_packed_backward(lz_tensor *dgate, const lz_tensor *dout,
                                    const lz_tensor *gate) {
  const char *op = "swiglu_backward";
  LZ_TRY(check_packed(op, "dout", dout, gate));
  LZ_TRY(lz_check_present(op, "dgate", dgate));
  LZ_TRY(lz_check_same_shape(op, "dgate", dgate, "gate", gate));
  const lz_op_args args = {.t = {dgate, NULL, (lz_tensor *)dout, (lz_tensor *)gate, NULL},
                           .i = {dout->shape[dout->ndim - 1]}};
  LZ_TRY(lz_op_check_dtypes(op, LZ_OP_SWIGLU_BACKWARD, &args));
  if (dgate->data == dout->data)
    return lz_fail(LZ_ERR_INVALID,
                   "%s: dgate and dout are the same memory; rows of different widths cannot "
                   "share it, give dgate its own buffer",
                   op);
  LZ_TRY(lz_check_no_alias(op, "dgate", dgate, "gate", gate));
  LZ_TRY(check_bf16_out(op, dgate, gate, NULL));
  return lz_op_run(op, LZ_OP_SWIGLU_BACKWARD, &args);
}
