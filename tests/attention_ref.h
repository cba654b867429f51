/* attention_ref.h — the naive double-precision attention that the attention
 * kernels' tests (test_attention.c, test_attention_opts.c) compare against:
 * a full T x T softmax per (batch, head) with the causal mask, an optional
 * window, soft-cap, scale and document ids, and the gradient of
 * sum(out * w) by central differences through it. */
#ifndef ATTENTION_REF_H
#define ATTENTION_REF_H

#include "lz_test.h"

#include <stdlib.h> /* malloc */

/* A qkv row holds NH query heads, then NKV key and NKV value heads of HS.
 * window 0, cap 0, scale 0 (1/sqrt(HS)) and docs 0 (no seg) are off. */
typedef struct {
  int64_t B, T;
  int NH, NKV, HS;
  int window;
  float cap, scale;
  int docs; /* documents per row (seg), 0: no seg */
} attn_shape;

static inline int64_t attn_row(const attn_shape *s) { return (int64_t)(s->NH + 2 * s->NKV) * s->HS; }

static inline double *attn_to_double(const lz_tensor *t) {
  int64_t n = lz_tensor_numel(t);
  double *d = malloc(sizeof(double) * (size_t)n);
  for (int64_t i = 0; i < n; i++) d[i] = ((const float *)t->data)[i];
  return d;
}

/* One (b, h) in double: out[T][HS] (stride C = NH * HS), lse[T] (or NULL). */
static inline void attn_ref_head(double *out, double *lse, const double *x, const int32_t *seg,
                                 const attn_shape *s, int64_t b, int64_t h) {
  const int64_t T = s->T, HS = s->HS, row = attn_row(s), C = (int64_t)s->NH * HS;
  const int64_t g = h / (s->NH / s->NKV);
  const double scale = s->scale ? s->scale : 1.0 / sqrt((double)HS);
  const double *q = x + b * T * row + h * HS, *k = x + b * T * row + C + g * HS;
  const double *v = k + (int64_t)s->NKV * HS;
  const int32_t *sg = seg ? seg + b * T : NULL;
  double *sc = malloc(sizeof(double) * (size_t)T);
  for (int64_t i = 0; i < T; i++) {
    double mx = -INFINITY;
    for (int64_t j = 0; j < T; j++) {
      int seen = j <= i && (!s->window || i - j < s->window) && (!sg || sg[i] == sg[j]);
      if (!seen) {
        sc[j] = -INFINITY; /* the mask, as a full row */
        continue;
      }
      double dot = 0;
      for (int64_t c = 0; c < HS; c++) dot += q[i * row + c] * k[j * row + c];
      sc[j] = dot * scale;
      if (s->cap) sc[j] = s->cap * tanh(sc[j] / s->cap);
      if (sc[j] > mx) mx = sc[j];
    }
    double sum = 0;
    for (int64_t j = 0; j < T; j++) sum += sc[j] = exp(sc[j] - mx);
    if (lse) lse[i] = mx + log(sum);
    for (int64_t c = 0; c < HS; c++) out[i * C + c] = 0;
    for (int64_t j = 0; j <= i; j++)
      for (int64_t c = 0; c < HS; c++) out[i * C + c] += sc[j] / sum * v[j * row + c];
  }
  free(sc);
}

/* Every head: out [B, T, C] and lse [B, NH, T] of the qkv x. */
static inline void attn_ref_forward(double *out, double *lse, const double *x, const int32_t *seg,
                                    const attn_shape *s) {
  const int64_t C = (int64_t)s->NH * s->HS;
  for (int64_t b = 0; b < s->B; b++)
    for (int64_t h = 0; h < s->NH; h++)
      attn_ref_head(out + b * s->T * C + h * s->HS, lse + (b * s->NH + h) * s->T, x, seg, s, b, h);
}

/* The largest |got - want| / max(|want|, 1) over n values; NaN sticks. */
static inline double attn_max_error(const float *got, const double *want, int64_t n) {
  double err = 0;
  for (int64_t i = 0; i < n; i++) {
    double e = fabs(got[i] - want[i]) / (fabs(want[i]) > 1 ? fabs(want[i]) : 1);
    if (!(e <= err)) err = e;
  }
  return err;
}

/* Loss sum(out * w) over head h of batch b, through the reference. */
static inline double attn_ref_loss(const double *x, const int32_t *seg, const float *w,
                                   const attn_shape *s, int64_t b, int64_t h, double *scratch) {
  const int64_t C = (int64_t)s->NH * s->HS;
  attn_ref_head(scratch, NULL, x, seg, s, b, h);
  double L = 0;
  for (int64_t i = 0; i < s->T; i++)
    for (int64_t c = 0; c < s->HS; c++)
      L += scratch[i * C + c] * w[(b * s->T + i) * C + h * s->HS + c];
  return L;
}

/* The loss through every query head of batch b that column col of a qkv
 * row feeds: its own query head, or the group of a key/value head. */
static inline double attn_ref_loss_col(const double *x, const int32_t *seg, const float *w,
                                       const attn_shape *s, int64_t b, int64_t col,
                                       double *scratch) {
  const int64_t qw = (int64_t)s->NH * s->HS, kvw = (int64_t)s->NKV * s->HS;
  if (col < qw) return attn_ref_loss(x, seg, w, s, b, col / s->HS, scratch);
  const int64_t g = ((col - qw) % kvw) / s->HS, group = s->NH / s->NKV;
  double L = 0;
  for (int64_t h = g * group; h < (g + 1) * group; h++)
    L += attn_ref_loss(x, seg, w, s, b, h, scratch);
  return L;
}

/* The analytic dqkv (fp32) against central differences in double on up to
 * max_checks elements spread over qkv from element `first` of the stride:
 * the worst of |got - fd| / (|fd| + 1% of the largest |fd|), its element
 * in *at, the values there in *got_at and *fd_at. */
static inline double attn_grad_error(const lz_tensor *qkv, const lz_tensor *dqkv,
                                     const float *dout, const int32_t *seg, const attn_shape *s,
                                     int64_t max_checks, int64_t first, int64_t *at,
                                     double *got_at, double *fd_at) {
  const int64_t C = (int64_t)s->NH * s->HS, row = attn_row(s), n = s->B * s->T * row;
  double *x = attn_to_double(qkv);
  double *scratch = malloc(sizeof(double) * (size_t)(s->T * C));
  double *fd = malloc(sizeof(double) * (size_t)n);
  int64_t *idx = malloc(sizeof(int64_t) * (size_t)n);
  int64_t m = 0;
  const int64_t step = n <= max_checks ? 1 : n / max_checks + 1;
  for (int64_t i = (step > 1 ? first % step : 0); i < n; i += step) idx[m++] = i;
  const double eps = 1e-5;
  double gmax = 0;
  for (int64_t t = 0; t < m; t++) {
    int64_t i = idx[t], b = i / (s->T * row), col = i % row;
    double x0 = x[i];
    x[i] = x0 + eps;
    double lp = attn_ref_loss_col(x, seg, dout, s, b, col, scratch);
    x[i] = x0 - eps;
    double lm = attn_ref_loss_col(x, seg, dout, s, b, col, scratch);
    x[i] = x0;
    fd[t] = (lp - lm) / (2 * eps);
    if (fabs(fd[t]) > gmax) gmax = fabs(fd[t]);
  }
  double worst = 0;
  int64_t worst_t = 0;
  for (int64_t t = 0; t < m; t++) {
    double got = ((const float *)dqkv->data)[idx[t]];
    double e = fabs(got - fd[t]) / (fabs(fd[t]) + 1e-2 * gmax + 1e-12);
    if (!(e <= worst)) {
      worst = e;
      worst_t = t;
    }
  }
  *at = m ? idx[worst_t] : 0;
  *got_at = m ? ((const float *)dqkv->data)[idx[worst_t]] : 0;
  *fd_at = m ? fd[worst_t] : 0;
  free(x);
  free(scratch);
  free(fd);
  free(idx);
  return worst;
}

#endif
