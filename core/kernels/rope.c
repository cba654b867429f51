/* rope.c — rotary position embeddings as Hugging Face's Llama applies them
 * (apply_rotary_pos_emb with rotate_half): in each head of head_dim values,
 * element i pairs with element i + head_dim/2 and the pair turns by the angle
 * pos * inv_freq[i], inv_freq[i] = theta^(-2i/head_dim). A cpu kernel (sim runs it too).
 *
 * The numbers follow LlamaRotaryEmbedding: inv_freq in fp32 (worked out here
 * in double, then rounded; Hugging Face's fp32 arithmetic lands within a few
 * ulps of it), the angle pos * inv_freq a product in fp32, its cos and sin in
 * fp32. A row of x is one position: its cos and sin are
 * worked out once and serve every head.
 *
 * lz_rope_freqs_* take the inverse frequencies as a tensor instead (Llama 3's
 * rope_scaling rescales them). x may be bf16: each head is widened to f32
 * first, so the result is bitwise the f32 one on the widened input. out is
 * f32, or bf16 (from f32 x) where it only feeds a bf16 GEMM (the gradient of
 * the q|k|v projection's output): each row is turned in f32 on the stack and
 * rounded as tensor_copy rounds, bitwise the f32 out converted.
 *
 * lz_rope_pos_* take each row's position from a tensor: in a packed batch
 * positions restart at 0 at each document, as Hugging Face's position_ids. */
#include "mem/lz_backend.h"
#include "mem/lz_internal.h"

#include <math.h>   /* pow, cosf, sinf, isinf, isfinite */
#include <string.h> /* memcpy */

/* Widest head the kernel takes: its cos and sin tables live on the stack. */
#define ROPE_MAX_HEAD_DIM 4096
/* Widest row a bf16 out takes: the f32 row lives on the stack. */
#define ROPE_MAX_BF16_COLS 65536

/* Turns every head of one row by `sign` times its angles: sign 1 is forward,
 * -1 the backward (the rotation's transpose). In each head of `stride`
 * values the first 2 * half turn, the rest pass. cos and sin are multiplied
 * by `scale` (LongRoPE's attention factor) in fp32, as transformers does,
 * unless scale is 0 (none: Llama's numbers untouched). out may be x: each
 * pair is read before it is written. */
LZ_DISPATCH static void rope_row(float *out, const float *x, const float *inv_freq, float pos,
                                 float sign, int64_t n_head, int64_t half, int64_t stride,
                                 float scale) {
  float cos_t[half], sin_t[half];
  for (int64_t i = 0; i < half; i++) {
    const float angle = pos * inv_freq[i];
    float c = cosf(angle), s = sinf(angle);
    if (scale != 0.0f) c *= scale, s *= scale;
    cos_t[i] = c;
    sin_t[i] = sign * s;
  }
  for (int64_t h = 0; h < n_head; h++) {
    const float *xh = x + stride * h;
    float *oh = out + stride * h;
    for (int64_t i = 0; i < half; i++) {
      const float x1 = xh[i], x2 = xh[i + half];
      oh[i] = x1 * cos_t[i] - x2 * sin_t[i];
      oh[i + half] = x2 * cos_t[i] + x1 * sin_t[i];
    }
    if (oh != xh)
      for (int64_t i = 2 * half; i < stride; i++) oh[i] = xh[i];
  }
}

/* rope_row into a bf16 row of C values (turned: the leading ones in heads,
 * the rest copied): the f32 row on the stack, then rounded. */
LZ_DISPATCH static void rope_row_to_bf16(uint16_t *out, const float *x, const float *inv_freq,
                                         float pos, float sign, int64_t n_head, int64_t half,
                                         int64_t stride, float scale, int64_t C, int64_t turned) {
  float row[C];
  rope_row(row, x, inv_freq, pos, sign, n_head, half, stride, scale);
  memcpy(row + turned, x + turned, (size_t)(C - turned) * sizeof(float));
  lz_row_to_bf16(out, row, C);
}

/* rope_row for a bf16 row: each head widened, then turned. */
LZ_DISPATCH static void rope_row_bf16(float *out, const uint16_t *x, const float *inv_freq,
                                      float pos, float sign, int64_t n_head, int64_t half,
                                      int64_t stride, float scale) {
  for (int64_t h = 0; h < n_head; h++)
    lz_row_to_f32(out + stride * h, x + stride * h, LZ_BF16, stride);
  rope_row(out, out, inv_freq, pos, sign, n_head, half, stride, scale);
}

/* pos: i32 [B, T] for x [B, T, C]; its values are the kernel's to check. */
static lz_status check_pos(const char *op, const lz_tensor *pos, const lz_tensor *x) {
  if (pos->ndim != 2 || pos->shape[0] != x->shape[0] || pos->shape[1] != x->shape[1]) {
    char a[96], b[96];
    return lz_fail(LZ_ERR_INVALID, "%s: pos is %s, expected i32[%lld,%lld] (one per row of %s)", op,
                   lz_tensor_describe(pos, a, sizeof a), (long long)x->shape[0],
                   (long long)x->shape[1], lz_tensor_describe(x, b, sizeof b));
  }
  return LZ_OK;
}

lz_status lz_rope_check_values(lz_op op, const lz_op_args *a, const float *inv_freq,
                               const int32_t *pos) {
  const char *name = lz_op_infos[op].name;
  const int64_t rotary = a->i[3] ? a->i[3] : a->i[1];
  for (int64_t i = 0; inv_freq && i < rotary / 2; i++)
    if (!isfinite(inv_freq[i]))
      return lz_fail(LZ_ERR_INVALID, "%s: inv_freq[%lld] is %g; it must be finite", name,
                     (long long)i, (double)inv_freq[i]);
  if (!pos) return LZ_OK;
  const int64_t T = a->t[3]->shape[1];
  int32_t p;
  const int64_t i = lz_ids_first_outside(pos, lz_tensor_numel(a->t[3]), 0, INT64_MAX, &p);
  if (i < 0) return LZ_OK;
  return lz_fail(LZ_ERR_INVALID, "%s: pos[%lld, %lld] is %d; positions must be >= 0", name,
                 (long long)(i / T), (long long)(i % T), (int)p);
}

/* The checks forward and backward share, then the op.
 * pos: each row's position, or NULL for pos_offset + t.
 * inv_freq: rotary_dim/2 floats, or NULL to work them out from theta. With
 * freqs given, a row may hold more than the n_head heads (Llama's packed
 * q|k|v rows: q and k turn, v does not): the rest is copied to out (left
 * alone when out is x).
 * rotary_dim: the leading values of each head that turn (0: all head_dim);
 * scale: what cos and sin are multiplied by (0: nothing). */
static lz_status rope_apply_ext(const char *op, lz_op opcode, const char *out_name, lz_tensor *out,
                                const char *x_name, const lz_tensor *x, int n_head, int head_dim,
                                int64_t pos_offset, float theta, const lz_tensor *inv_freq_t,
                                const lz_tensor *pos_t, int rotary_dim, float scale) {
  const lz_op_args args = {.t = {out, (lz_tensor *)x, (lz_tensor *)inv_freq_t, (lz_tensor *)pos_t},
                           .i = {n_head, head_dim, pos_offset, rotary_dim},
                           .f = {theta, scale}};
  LZ_TRY(lz_op_check_dtypes(op, opcode, &args)); /* the alias check reads them */
  LZ_TRY(lz_check_ndim(op, x_name, x, 3, 3));
  LZ_TRY(lz_check_same_shape(op, out_name, out, x_name, x));
  LZ_TRY(lz_check_no_alias(op, out_name, out, x_name, x));
  if (out->dtype == LZ_BF16 &&
      (x->dtype != LZ_F32 || out->data == x->data || x->shape[2] > ROPE_MAX_BF16_COLS))
    return lz_fail(LZ_ERR_INVALID,
                   "%s: a bf16 %s takes an f32 %s in memory of its own, rows of at most %d values; "
                   "pass an f32 %s",
                   op, out_name, x_name, ROPE_MAX_BF16_COLS, out_name);
  const int freqs = inv_freq_t != NULL;
  if (n_head < 1) return lz_fail(LZ_ERR_INVALID, "%s: n_head is %d; it must be >= 1", op, n_head);
  if (head_dim < 2 || head_dim % 2 || head_dim > ROPE_MAX_HEAD_DIM)
    return lz_fail(LZ_ERR_INVALID,
                   "%s: head_dim is %d; it must be even (rotate_half pairs element i with "
                   "i + head_dim/2), from 2 to %d",
                   op, head_dim, ROPE_MAX_HEAD_DIM);
  const int64_t C = x->shape[2];
  const int64_t turned = (int64_t)n_head * head_dim; /* leading columns of a row */
  if (freqs ? turned > C : turned != C) {
    char buf[96];
    return lz_fail(LZ_ERR_INVALID,
                   "%s: %s is %s, but n_head * head_dim = %d * %d = %lld; the last dimension "
                   "must hold the heads%s",
                   op, x_name, lz_tensor_describe(x, buf, sizeof buf), n_head, head_dim,
                   (long long)turned, freqs ? " (it may hold more)" : "");
  }
  if (pos_offset < 0)
    return lz_fail(LZ_ERR_INVALID, "%s: pos_offset is %lld; it must be >= 0", op,
                   (long long)pos_offset);
  if (!freqs && (!(theta > 0.0f) || isinf(theta)))
    return lz_fail(LZ_ERR_INVALID, "%s: theta is %g; it must be finite and > 0 (Llama: 10000)", op,
                   (double)theta);
  if (rotary_dim && (rotary_dim < 2 || rotary_dim % 2 || rotary_dim > head_dim))
    return lz_fail(LZ_ERR_INVALID,
                   "%s: rotary_dim is %d; it must be even, from 2 to head_dim %d (2 * numel of "
                   "inv_freq)",
                   op, rotary_dim, head_dim);
  if (!isfinite(scale) || scale < 0.0f)
    return lz_fail(LZ_ERR_INVALID, "%s: scale is %g; it must be finite and > 0 (0: none)", op,
                   (double)scale);
  if (pos_t && pos_offset)
    return lz_fail(LZ_ERR_INVALID,
                   "%s: pos_offset is %lld with pos given; pass 0 (pos holds the positions)", op,
                   (long long)pos_offset);
  if (pos_t) LZ_TRY(check_pos(op, pos_t, x));
  return lz_op_run(op, opcode, &args);
}

/* rope_apply_ext with every value of each head turned and no scale. */
static lz_status rope_apply(const char *op, lz_op opcode, const char *out_name, lz_tensor *out,
                            const char *x_name, const lz_tensor *x, int n_head, int head_dim,
                            int64_t pos_offset, float theta, const lz_tensor *inv_freq_t,
                            const lz_tensor *pos_t) {
  return rope_apply_ext(op, opcode, out_name, out, x_name, x, n_head, head_dim, pos_offset, theta,
                        inv_freq_t, pos_t, 0, 0.0f);
}

/* The kernel forward and backward share; `sign` as rope_row's. */
static lz_status rope_cpu(lz_op opcode, const lz_op_args *a, float sign) {
  lz_tensor *out = a->t[0];
  const lz_tensor *x = a->t[1], *inv_freq_t = a->t[2], *pos_t = a->t[3];
  const int n_head = (int)a->i[0], head_dim = (int)a->i[1];
  const int64_t pos_offset = a->i[2];
  const float theta = a->f[0];
  const int freqs = inv_freq_t != NULL;
  LZ_TRY(
      lz_rope_check_values(opcode, a, freqs ? inv_freq_t->data : NULL, pos_t ? pos_t->data : NULL));
  const int64_t C = x->shape[2];
  const int64_t turned = (int64_t)n_head * head_dim; /* leading columns of a row */
  const int64_t rotary = a->i[3] ? a->i[3] : head_dim;
  const float scale = a->f[1];
  const int64_t half = rotary / 2, T = x->shape[1], rows = x->shape[0] * T;
  float inv_freq[half];
  const float *given = freqs ? inv_freq_t->data : NULL;
  for (int64_t i = 0; i < half; i++)
    inv_freq[i] = freqs ? given[i] : (float)pow((double)theta, -2.0 * (double)i / (double)head_dim);
  float *o = out->data;
  const int32_t *pp = pos_t ? pos_t->data : NULL;
#define ROW_POS(r) (pp ? (float)pp[r] : (float)(pos_offset + (r) % T))
  if (out->dtype == LZ_BF16) {
    const float *xp = x->data;
    uint16_t *ob = out->data;
#pragma omp parallel for schedule(static) if (rows * C > (1 << 15))
    for (int64_t r = 0; r < rows; r++)
      rope_row_to_bf16(ob + r * C, xp + r * C, inv_freq, ROW_POS(r), sign, n_head, half, head_dim,
                       scale, C, turned);
    return LZ_OK;
  }
  if (x->dtype == LZ_BF16) {
    const uint16_t *xp = x->data;
#pragma omp parallel for schedule(static) if (rows * C > (1 << 15))
    for (int64_t r = 0; r < rows; r++) {
      rope_row_bf16(o + r * C, xp + r * C, inv_freq, ROW_POS(r), sign, n_head, half, head_dim,
                    scale);
      lz_row_to_f32(o + r * C + turned, xp + r * C + turned, LZ_BF16, C - turned);
    }
    return LZ_OK;
  }
  const float *xp = x->data;
#pragma omp parallel for schedule(static) if (rows * C > (1 << 15))
  for (int64_t r = 0; r < rows; r++) {
    rope_row(o + r * C, xp + r * C, inv_freq, ROW_POS(r), sign, n_head, half, head_dim, scale);
    if (o != xp && C > turned)
      memcpy(o + r * C + turned, xp + r * C + turned, (size_t)(C - turned) * sizeof(float));
  }
#undef ROW_POS
  return LZ_OK;
}

/* The inverse frequencies of the _freqs variants: head_dim/2 values
 * (the kernel checks they are finite where it runs; cuda does not check
 * them: it would have to wait for the device). */
static lz_status check_freqs(const char *op, const lz_tensor *inv_freq, int head_dim) {
  LZ_TRY(lz_check_present(op, "inv_freq", inv_freq));
  return lz_check_numel(op, "inv_freq", inv_freq, head_dim / 2, "head_dim / 2");
}

lz_status lz_cpu_rope_forward(const lz_op_args *a) { return rope_cpu(LZ_OP_ROPE_FORWARD, a, 1.0f); }

lz_status lz_cpu_rope_backward(const lz_op_args *a) {
  return rope_cpu(LZ_OP_ROPE_BACKWARD, a, -1.0f);
}

lz_status lz_rope_forward(lz_tensor *out, const lz_tensor *x, int n_head, int head_dim,
                          int64_t pos_offset, float theta) {
  return rope_apply("rope_forward", LZ_OP_ROPE_FORWARD, "out", out, "x", x, n_head, head_dim,
                    pos_offset, theta, NULL, NULL);
}

lz_status lz_rope_backward(lz_tensor *dx, const lz_tensor *dy, int n_head, int head_dim,
                           int64_t pos_offset, float theta) {
  return rope_apply("rope_backward", LZ_OP_ROPE_BACKWARD, "dx", dx, "dy", dy, n_head, head_dim,
                    pos_offset, theta, NULL, NULL);
}

/* head_dim is 2 * numel(inv_freq). */
static int freqs_head_dim(const lz_tensor *inv_freq) {
  return inv_freq ? (int)(2 * lz_tensor_numel(inv_freq)) : 0;
}

lz_status lz_rope_freqs_forward(lz_tensor *out, const lz_tensor *x, const lz_tensor *inv_freq,
                                int n_head, int64_t pos_offset) {
  const char *op = "rope_forward";
  const int head_dim = freqs_head_dim(inv_freq);
  LZ_TRY(check_freqs(op, inv_freq, head_dim));
  return rope_apply(op, LZ_OP_ROPE_FORWARD, "out", out, "x", x, n_head, head_dim, pos_offset, 1.0f,
                    inv_freq, NULL);
}

lz_status lz_rope_freqs_backward(lz_tensor *dx, const lz_tensor *dy, const lz_tensor *inv_freq,
                                 int n_head, int64_t pos_offset) {
  const char *op = "rope_backward";
  const int head_dim = freqs_head_dim(inv_freq);
  LZ_TRY(check_freqs(op, inv_freq, head_dim));
  return rope_apply(op, LZ_OP_ROPE_BACKWARD, "dx", dx, "dy", dy, n_head, head_dim, pos_offset, 1.0f,
                    inv_freq, NULL);
}

lz_status lz_rope_pos_forward(lz_tensor *out, const lz_tensor *x, const lz_tensor *inv_freq,
                              const lz_tensor *pos, int n_head) {
  const char *op = "rope_forward";
  const int head_dim = freqs_head_dim(inv_freq);
  LZ_TRY(check_freqs(op, inv_freq, head_dim));
  return rope_apply(op, LZ_OP_ROPE_FORWARD, "out", out, "x", x, n_head, head_dim, 0, 1.0f, inv_freq,
                    pos);
}

lz_status lz_rope_pos_backward(lz_tensor *dx, const lz_tensor *dy, const lz_tensor *inv_freq,
                               const lz_tensor *pos, int n_head) {
  const char *op = "rope_backward";
  const int head_dim = freqs_head_dim(inv_freq);
  LZ_TRY(check_freqs(op, inv_freq, head_dim));
  return rope_apply(op, LZ_OP_ROPE_BACKWARD, "dx", dx, "dy", dy, n_head, head_dim, 0, 1.0f,
                    inv_freq, pos);
}

/* rotary_dim is 2 * numel(inv_freq), at most head_dim. */
lz_status lz_rope_ext_forward(lz_tensor *out, const lz_tensor *x, const lz_tensor *inv_freq,
                              const lz_tensor *pos, int n_head, int head_dim, int64_t pos_offset,
                              float scale) {
  const char *op = "rope_forward";
  const int rotary_dim = freqs_head_dim(inv_freq);
  LZ_TRY(check_freqs(op, inv_freq, rotary_dim));
  return rope_apply_ext(op, LZ_OP_ROPE_FORWARD, "out", out, "x", x, n_head, head_dim, pos_offset,
                        1.0f, inv_freq, pos, rotary_dim, scale);
}

lz_status lz_rope_ext_backward(lz_tensor *dx, const lz_tensor *dy, const lz_tensor *inv_freq,
                               const lz_tensor *pos, int n_head, int head_dim, int64_t pos_offset,
                               float scale) {
  const char *op = "rope_backward";
  const int rotary_dim = freqs_head_dim(inv_freq);
  LZ_TRY(check_freqs(op, inv_freq, rotary_dim));
  return rope_apply_ext(op, LZ_OP_ROPE_BACKWARD, "dx", dx, "dy", dy, n_head, head_dim, pos_offset,
                        1.0f, inv_freq, pos, rotary_dim, scale);
}
