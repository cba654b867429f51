/* test_moe.c — the mixture-of-experts kernels (core/kernels/moe.c,
 * moe_gemm.c) against naive double references: route (softmax, top-k with
 * ties to the lower expert, k = E, renormalised or not) and its backward
 * against central differences; sort with experts that get no token; permute,
 * combine and the grouped GEMM (f32, bf16, counts of 0) forward and
 * backward, and on one part of experts that hold several; a whole MoE layer against a per-token loop; the same bits at 1
 * and 2 threads; argument and value errors. */
#include "lz_test.h"

#include <math.h>   /* exp, fabs */
#include <stdlib.h> /* malloc, calloc, free */
#include <string.h> /* memcmp, memcpy */

static float *rand_f32(int64_t n, uint64_t *rng, float scale) {
  float *p = malloc(sizeof(float) * (size_t)n);
  for (int64_t i = 0; i < n; i++) p[i] = scale * lz_test_uniform(rng);
  return p;
}

static uint16_t *to_bf16(const float *p, int64_t n) {
  uint16_t *h = malloc(sizeof(uint16_t) * (size_t)n);
  for (int64_t i = 0; i < n; i++) h[i] = lz_f32_to_bf16(p[i]);
  return h;
}

/* p rounded through bf16, in place: the values a bf16 operand holds. */
static void round_bf16(float *p, int64_t n) {
  for (int64_t i = 0; i < n; i++) p[i] = lz_bf16_to_f32(lz_f32_to_bf16(p[i]));
}

/* Borrowed tensors over test buffers, freed together by unwrap_all. */
static lz_tensor *wraps[512];
static int n_wraps;

static lz_tensor *wrap(void *data, lz_dtype dt, int nd, const int64_t *shape) {
  lz_tensor *t = lz_test_wrap(data, dt, nd, shape);
  if (n_wraps < 512) wraps[n_wraps++] = t;
  else CHECK(!"test_moe: more than 512 wrapped tensors in one case");
  return t;
}

static void unwrap_all(void) {
  while (n_wraps > 0) lz_tensor_free(wraps[--n_wraps]);
}

#define T(data, dt, ...) \
  wrap((data), (dt), sizeof((int64_t[]){__VA_ARGS__}) / 8, (int64_t[]){__VA_ARGS__})

/* ------------------------------------------------------------------ route */

/* The naive router in double: probabilities, then K picks of the largest
 * (the first of equal ones), then the optional renormalisation. */
static void route_ref(double *w, int32_t *id, double *p, const double *l, int64_t E, int64_t K,
                      int norm, const int32_t *fixed) {
  double m = l[0], s = 0.0;
  for (int64_t e = 1; e < E; e++) m = l[e] > m ? l[e] : m;
  for (int64_t e = 0; e < E; e++) s += (p[e] = exp(l[e] - m));
  for (int64_t e = 0; e < E; e++) p[e] /= s;
  for (int64_t j = 0; j < K; j++) {
    int64_t best = -1;
    for (int64_t e = 0; e < E && !fixed; e++) {
      int taken = 0;
      for (int64_t q = 0; q < j; q++) taken |= id[q] == e;
      if (!taken && (best < 0 || p[e] > p[best])) best = e;
    }
    id[j] = fixed ? fixed[j] : (int32_t)best;
    w[j] = p[id[j]];
  }
  double sum = 0.0;
  for (int64_t j = 0; j < K; j++) sum += w[j];
  for (int64_t j = 0; j < K && norm; j++) w[j] /= sum;
}

static void route_case(int64_t N, int64_t E, int64_t K, int norm, lz_dtype dt) {
  uint64_t rng = 0x40e + (uint64_t)(N * 131 + E * 7 + K + norm);
  float *l = rand_f32(N * E, &rng, 3.0f);
  if (dt == LZ_BF16) round_bf16(l, N * E);
  uint16_t *lb = to_bf16(l, N * E);
  float *w = calloc((size_t)(N * K), sizeof(float)), *p = calloc((size_t)(N * E), sizeof(float));
  int32_t *id = calloc((size_t)(N * K), sizeof(int32_t));
  CHECK_OK(lz_moe_route_forward(T(w, LZ_F32, N, K), T(id, LZ_I32, N, K), T(p, LZ_F32, N, E),
                                T(dt == LZ_BF16 ? (void *)lb : l, dt, N, E), norm));
  double ld[64], pd[64], wd[64];
  int32_t idr[64];
  for (int64_t t = 0; t < N; t++) {
    for (int64_t e = 0; e < E; e++) ld[e] = l[t * E + e];
    route_ref(wd, idr, pd, ld, E, K, norm, NULL);
    for (int64_t e = 0; e < E; e++) CHECK_NEAR(p[t * E + e], pd[e], 1e-6);
    for (int64_t j = 0; j < K; j++) {
      CHECK_EQ_INT(id[t * K + j], idr[j]);
      CHECK_NEAR(w[t * K + j], wd[j], 1e-6);
    }
  }
  free(l), free(lb), free(w), free(p), free(id);
  unwrap_all();
}

LZ_TEST(moe_route_forward_matches_naive) {
  route_case(37, 8, 2, 0, LZ_F32);
  route_case(37, 8, 2, 1, LZ_F32);
  route_case(19, 64, 8, 1, LZ_F32); /* OLMoE's 64 experts, top-8 */
  route_case(11, 4, 4, 0, LZ_F32);  /* k = E */
  route_case(11, 4, 4, 1, LZ_F32);
  route_case(23, 8, 2, 1, LZ_BF16);
}

/* A NaN logit, or +inf (whose exp(inf - inf) is NaN), makes the row's
 * probabilities NaN: the row takes experts 0 .. K - 1 with NaN weights (the
 * loss turns NaN, which the loss scaler skips), never an index outside
 * the experts (cuda/moe.cu picks the same). */
LZ_TEST(moe_route_nan_rows_take_the_first_experts) {
  float l[8] = {0.5f, NAN, 1, 2, 1, 2, INFINITY, 0};
  float w[4], p[8];
  int32_t id[4];
  CHECK_OK(lz_moe_route_forward(T(w, LZ_F32, 2, 2), T(id, LZ_I32, 2, 2), T(p, LZ_F32, 2, 4),
                                T(l, LZ_F32, 2, 4), 1));
  const int32_t want[4] = {0, 1, 0, 1};
  for (int i = 0; i < 4; i++) CHECK_EQ_INT(id[i], want[i]);
  CHECK(isnan(w[0]) && isnan(w[3]));
  unwrap_all();
}

LZ_TEST(moe_route_ties_go_to_the_lower_expert) {
  /* Row 0: all equal; row 1: experts 1 and 3 tie for the top, 0 and 2 for
   * the next; row 2: k = E of a tie. */
  float l[12] = {0.5f, 0.5f, 0.5f, 0.5f, 1, 2, 1, 2, -1, -1, -1, -1};
  float w[12], p[12];
  int32_t id[12];
  CHECK_OK(lz_moe_route_forward(T(w, LZ_F32, 3, 2), T(id, LZ_I32, 3, 2), T(p, LZ_F32, 3, 4),
                                T(l, LZ_F32, 3, 4), 1));
  const int32_t want[6] = {0, 1, 1, 3, 0, 1};
  for (int i = 0; i < 6; i++) CHECK_EQ_INT(id[i], want[i]);
  CHECK(w[0] == 0.5f && w[1] == 0.5f);
  CHECK_OK(lz_moe_route_forward(T(w, LZ_F32, 3, 4), T(id, LZ_I32, 3, 4), T(p, LZ_F32, 3, 4),
                                T(l, LZ_F32, 3, 4), 0));
  const int32_t all[12] = {0, 1, 2, 3, 1, 3, 0, 2, 0, 1, 2, 3};
  for (int i = 0; i < 12; i++) CHECK_EQ_INT(id[i], all[i]);
  CHECK(w[0] == 0.25f && w[3] == 0.25f);
  unwrap_all();
}

/* L = dw . weights + dp . probs with the experts fixed (top-k picks are
 * piecewise constant): the backward against central differences. */
static double route_loss(const double *l, const double *dw, const double *dp, const int32_t *id,
                         int64_t N, int64_t E, int64_t K, int norm) {
  double loss = 0.0, w[64], p[64];
  int32_t got[64];
  for (int64_t t = 0; t < N; t++) {
    route_ref(w, got, p, l + t * E, E, K, norm, id + t * K);
    for (int64_t j = 0; j < K; j++) loss += dw[t * K + j] * w[j];
    for (int64_t e = 0; e < E && dp; e++) loss += dp[t * E + e] * p[e];
  }
  return loss;
}

static void route_backward_case(int64_t N, int64_t E, int64_t K, int norm, int with_dp) {
  uint64_t rng = 0xbac + (uint64_t)(N + E * 3 + K * 5 + norm * 7 + with_dp);
  float *l = rand_f32(N * E, &rng, 2.0f), *dwf = rand_f32(N * K, &rng, 1.0f);
  float *dpf = rand_f32(N * E, &rng, 1.0f);
  float *w = calloc((size_t)(N * K), 4), *p = calloc((size_t)(N * E), 4);
  float *dl = calloc((size_t)(N * E), 4);
  int32_t *id = calloc((size_t)(N * K), 4);
  CHECK_OK(lz_moe_route_forward(T(w, LZ_F32, N, K), T(id, LZ_I32, N, K), T(p, LZ_F32, N, E),
                                T(l, LZ_F32, N, E), norm));
  CHECK_OK(lz_moe_route_backward(T(dl, LZ_F32, N, E), T(dwf, LZ_F32, N, K),
                                 with_dp ? T(dpf, LZ_F32, N, E) : NULL, T(p, LZ_F32, N, E),
                                 T(id, LZ_I32, N, K), norm));
  double *ld = malloc(sizeof(double) * (size_t)(N * E)), *dw = malloc(sizeof(double) * (size_t)(N * K));
  double *dp = malloc(sizeof(double) * (size_t)(N * E)), *g = malloc(sizeof(double) * (size_t)(N * E));
  for (int64_t i = 0; i < N * E; i++) ld[i] = l[i], dp[i] = dpf[i];
  for (int64_t i = 0; i < N * K; i++) dw[i] = dwf[i];
  for (int64_t i = 0; i < N * E; i++) {
    const double h = 1e-6, keep = ld[i];
    ld[i] = keep + h;
    const double up = route_loss(ld, dw, with_dp ? dp : NULL, id, N, E, K, norm);
    ld[i] = keep - h;
    const double down = route_loss(ld, dw, with_dp ? dp : NULL, id, N, E, K, norm);
    ld[i] = keep;
    g[i] = (up - down) / (2 * h);
  }
  CHECK(lz_test_rel_err(dl, g, N * E) < 1e-4);
  /* bf16 dlogits: the f32 ones rounded */
  uint16_t *dlb = calloc((size_t)(N * E), 2);
  CHECK_OK(lz_moe_route_backward(T(dlb, LZ_BF16, N, E), T(dwf, LZ_F32, N, K),
                                 with_dp ? T(dpf, LZ_F32, N, E) : NULL, T(p, LZ_F32, N, E),
                                 T(id, LZ_I32, N, K), norm));
  for (int64_t i = 0; i < N * E; i++) CHECK(dlb[i] == lz_f32_to_bf16(dl[i]));
  free(l), free(dwf), free(dpf), free(w), free(p), free(dl), free(id), free(dlb);
  free(ld), free(dw), free(dp), free(g);
  unwrap_all();
}

LZ_TEST(moe_route_backward_matches_differences) {
  route_backward_case(9, 8, 2, 0, 0);
  route_backward_case(9, 8, 2, 1, 0);
  route_backward_case(9, 8, 2, 1, 1);
  route_backward_case(5, 6, 6, 1, 1); /* k = E: the renormalised weights are the probs */
  route_backward_case(7, 16, 4, 0, 1);
}

/* ------------------------------------------------------------------- sort */

LZ_TEST(moe_sort_orders_by_expert_token_slot) {
  /* 5 tokens, K = 2, E = 5: expert 2 gets no token, expert 4 the most. */
  const int32_t idx[10] = {4, 0, 1, 4, 4, 3, 0, 4, 1, 3};
  int32_t ros[10], sor[10], off[6];
  CHECK_OK(lz_moe_sort(T(ros, LZ_I32, 5, 2), T(sor, LZ_I32, 10), T(off, LZ_I32, 6),
                       T((void *)idx, LZ_I32, 5, 2)));
  const int32_t want_off[6] = {0, 2, 4, 4, 6, 10};
  const int32_t want_sor[10] = {1, 6, 2, 8, 5, 9, 0, 3, 4, 7};
  for (int i = 0; i < 6; i++) CHECK_EQ_INT(off[i], want_off[i]);
  for (int i = 0; i < 10; i++) CHECK_EQ_INT(sor[i], want_sor[i]);
  for (int s = 0; s < 10; s++) CHECK_EQ_INT(sor[ros[s]], s);
  unwrap_all();
}

/* -------------------------------------------------------- permute, combine */

/* Random routing of N tokens to E experts, K distinct each, then sorted. */
typedef struct {
  int64_t N, E, K;
  int32_t *idx, *ros, *sor, *off;
} routing;

static routing routing_new(int64_t N, int64_t E, int64_t K, uint64_t seed, int skip_last) {
  routing r = {N, E, K, malloc(4 * (size_t)(N * K)), malloc(4 * (size_t)(N * K)),
               malloc(4 * (size_t)(N * K)), malloc(4 * (size_t)(E + 1))};
  uint64_t rng = seed;
  const int64_t pool = skip_last ? E - 1 : E; /* the last expert gets no token */
  for (int64_t t = 0; t < N; t++)
    for (int64_t j = 0; j < K; j++) {
      int32_t e, dup;
      do {
        e = (int32_t)(lz_test_xorshift(&rng) % (uint64_t)pool);
        dup = 0;
        for (int64_t q = 0; q < j; q++) dup |= r.idx[t * K + q] == e;
      } while (dup);
      r.idx[t * K + j] = e;
    }
  CHECK_OK(lz_moe_sort(T(r.ros, LZ_I32, N, K), T(r.sor, LZ_I32, N * K), T(r.off, LZ_I32, E + 1),
                       T(r.idx, LZ_I32, N, K)));
  return r;
}

static void routing_free(routing *r) { free(r->idx), free(r->ros), free(r->sor), free(r->off); }

LZ_TEST(moe_permute_and_combine_match_naive) {
  const int64_t N = 13, E = 6, K = 3, H = 40, R = N * K;
  routing rt = routing_new(N, E, K, 77, 1);
  CHECK_EQ_INT(rt.off[E] - rt.off[E - 1], 0);
  uint64_t rng = 5;
  float *x = rand_f32(N * H, &rng, 1.0f), *y = rand_f32(R * H, &rng, 1.0f);
  float *wt = rand_f32(N * K, &rng, 1.0f), *dout = rand_f32(N * H, &rng, 1.0f);
  float *xp = calloc((size_t)(R * H), 4), *dx = calloc((size_t)(N * H), 4);
  float *out = calloc((size_t)(N * H), 4), *dy = calloc((size_t)(R * H), 4);
  float *dw = calloc((size_t)(N * K), 4);
  uint16_t *xpb = calloc((size_t)(R * H), 2), *dyb = calloc((size_t)(R * H), 2);
  CHECK_OK(lz_moe_permute_forward(T(xp, LZ_F32, R, H), T(x, LZ_F32, N, H), T(rt.sor, LZ_I32, R)));
  CHECK_OK(lz_moe_permute_forward(T(xpb, LZ_BF16, R, H), T(x, LZ_F32, N, H),
                                  T(rt.sor, LZ_I32, R)));
  for (int64_t s = 0; s < R; s++)
    for (int64_t c = 0; c < H; c++) {
      CHECK(xp[rt.ros[s] * H + c] == x[s / K * H + c]);
      CHECK(xpb[rt.ros[s] * H + c] == lz_f32_to_bf16(x[s / K * H + c]));
    }
  CHECK_OK(lz_moe_permute_backward(T(dx, LZ_F32, N, H), T(y, LZ_F32, R, H),
                                   T(rt.ros, LZ_I32, N, K)));
  CHECK_OK(lz_moe_combine_forward(T(out, LZ_F32, N, H), T(y, LZ_F32, R, H), T(wt, LZ_F32, N, K),
                                  T(rt.ros, LZ_I32, N, K)));
  CHECK_OK(lz_moe_combine_backward(T(dy, LZ_F32, R, H), T(dw, LZ_F32, N, K),
                                   T(dout, LZ_F32, N, H), T(y, LZ_F32, R, H),
                                   T(wt, LZ_F32, N, K), T(rt.ros, LZ_I32, N, K)));
  CHECK_OK(lz_moe_combine_backward(T(dyb, LZ_BF16, R, H), NULL, T(dout, LZ_F32, N, H),
                                   T(y, LZ_F32, R, H), T(wt, LZ_F32, N, K),
                                   T(rt.ros, LZ_I32, N, K)));
  for (int64_t t = 0; t < N; t++) {
    for (int64_t c = 0; c < H; c++) {
      double sx = 0, so = 0;
      for (int64_t j = 0; j < K; j++) {
        const int64_t r = rt.ros[t * K + j];
        sx += y[r * H + c];
        so += (double)wt[t * K + j] * y[r * H + c];
        CHECK(dy[r * H + c] == wt[t * K + j] * dout[t * H + c]);
        CHECK(dyb[r * H + c] == lz_f32_to_bf16(dy[r * H + c]));
      }
      CHECK_NEAR(dx[t * H + c], sx, 1e-6);
      CHECK_NEAR(out[t * H + c], so, 1e-6);
    }
    for (int64_t j = 0; j < K; j++) {
      double d = 0;
      for (int64_t c = 0; c < H; c++) d += (double)dout[t * H + c] * y[rt.ros[t * K + j] * H + c];
      CHECK_NEAR(dw[t * K + j], d, 1e-5);
    }
  }
  /* The sum runs in expert order whatever the slot order: token 0's two
   * rows swapped between slots give the same bits. */
  float before = out[0];
  int32_t keep = rt.ros[0];
  float wk = wt[0];
  rt.ros[0] = rt.ros[1], rt.ros[1] = keep, wt[0] = wt[1], wt[1] = wk;
  CHECK_OK(lz_moe_combine_forward(T(out, LZ_F32, N, H), T(y, LZ_F32, R, H), T(wt, LZ_F32, N, K),
                                  T(rt.ros, LZ_I32, N, K)));
  CHECK(memcmp(&before, &out[0], 4) == 0);
  free(x), free(y), free(wt), free(dout), free(xp), free(dx), free(out), free(dy), free(dw);
  free(xpb), free(dyb);
  routing_free(&rt);
  unwrap_all();
}

/* ------------------------------------------------------------ grouped GEMM */

static void gemm_case(int64_t N, int64_t E, int64_t K, int64_t C, int64_t D, lz_dtype dt,
                      double tol) {
  const int64_t R = N * K;
  routing rt = routing_new(N, E, K, 1000 + (uint64_t)(N + E + C + dt), 1);
  uint64_t rng = 9 + (uint64_t)dt;
  float *x = rand_f32(R * C, &rng, 1.0f), *w = rand_f32(E * D * C, &rng, 0.5f);
  float *dy = rand_f32(R * D, &rng, 1.0f), *dw0 = rand_f32(E * D * C, &rng, 1.0f);
  if (dt == LZ_BF16) round_bf16(x, R * C), round_bf16(w, E * D * C), round_bf16(dy, R * D);
  uint16_t *xb = to_bf16(x, R * C), *wb = to_bf16(w, E * D * C), *dyb = to_bf16(dy, R * D);
  float *y = calloc((size_t)(R * D), 4), *dx = calloc((size_t)(R * C), 4);
  float *dw = malloc(4 * (size_t)(E * D * C));
  memcpy(dw, dw0, 4 * (size_t)(E * D * C));
  const int bf = dt == LZ_BF16;
  lz_tensor *tx = T(bf ? (void *)xb : x, dt, R, C), *tw = T(bf ? (void *)wb : w, dt, E, D, C);
  lz_tensor *tdy = T(bf ? (void *)dyb : dy, dt, R, D), *toff = T(rt.off, LZ_I32, E + 1);
  CHECK_OK(lz_moe_gemm_forward(T(y, LZ_F32, R, D), tx, tw, toff));
  CHECK_OK(lz_moe_gemm_backward(T(dx, LZ_F32, R, C), T(dw, LZ_F32, E, D, C), tdy, tx, tw, toff));
  double *ref = calloc((size_t)(E * D * C), sizeof(double));
  float *dwd = malloc(4 * (size_t)(E * D * C));
  for (int64_t e = 0; e < E; e++)
    for (int64_t r = rt.off[e]; r < rt.off[e + 1]; r++) {
      for (int64_t d = 0; d < D; d++) {
        double s = 0;
        for (int64_t c = 0; c < C; c++) s += (double)x[r * C + c] * w[(e * D + d) * C + c];
        CHECK_NEAR(y[r * D + d], s, tol);
      }
      for (int64_t c = 0; c < C; c++) {
        double s = 0;
        for (int64_t d = 0; d < D; d++) s += (double)dy[r * D + d] * w[(e * D + d) * C + c];
        CHECK_NEAR(dx[r * C + c], s, tol);
        for (int64_t d = 0; d < D; d++)
          ref[(e * D + d) * C + c] += (double)dy[r * D + d] * x[r * C + c];
      }
    }
  for (int64_t i = 0; i < E * D * C; i++) dwd[i] = dw[i] - dw0[i];
  /* sums over up to 200 rows, then less the starting dw */
  CHECK(lz_test_rel_err(dwd, ref, E * D * C) < 5 * tol);
  /* The expert with no rows keeps its dw. */
  CHECK(memcmp(dw + (E - 1) * D * C, dw0 + (E - 1) * D * C, 4 * (size_t)(D * C)) == 0);
  free(x), free(w), free(dy), free(dw0), free(xb), free(wb), free(dyb), free(y), free(dx);
  free(dw), free(ref), free(dwd);
  routing_free(&rt);
  unwrap_all();
}

LZ_TEST(moe_gemm_matches_naive) {
  gemm_case(21, 5, 2, 24, 40, LZ_F32, 1e-5);
  gemm_case(64, 8, 2, 64, 48, LZ_F32, 1e-5);
  gemm_case(200, 3, 2, 24, 300, LZ_F32, 1e-5); /* blocks of 128 rows, of 128 dw rows */
  gemm_case(21, 5, 2, 24, 40, LZ_BF16, 1e-5);   /* bf16 inputs, fp32 sums */
  gemm_case(200, 3, 2, 24, 300, LZ_BF16, 1e-5);
}

/* w [E, P, D, C] with a part: the same bits as that part stacked [E, D, C]
 * on its own, and dw's other parts untouched. */
static void part_case(int64_t N, int64_t E, int64_t P, int64_t part, int64_t C, int64_t D,
                      lz_dtype dt) {
  const int64_t K = 2, R = N * K, M = D * C, W = E * P * M;
  routing rt = routing_new(N, E, K, 77 + (uint64_t)(part + dt), 1);
  uint64_t rng = 5 + (uint64_t)part;
  float *x = rand_f32(R * C, &rng, 1.0f), *w = rand_f32(W, &rng, 0.5f);
  float *dy = rand_f32(R * D, &rng, 1.0f), *dw4 = rand_f32(W, &rng, 1.0f);
  float *dw0 = malloc(4 * (size_t)W), *dws = malloc(4 * (size_t)(E * M));
  float *ws = malloc(4 * (size_t)(E * M));
  memcpy(dw0, dw4, 4 * (size_t)W);
  for (int64_t e = 0; e < E; e++) {
    memcpy(ws + e * M, w + (e * P + part) * M, 4 * (size_t)M);
    memcpy(dws + e * M, dw4 + (e * P + part) * M, 4 * (size_t)M);
  }
  const int bf = dt == LZ_BF16;
  uint16_t *xb = to_bf16(x, R * C), *wb = to_bf16(w, W), *wsb = to_bf16(ws, E * M);
  uint16_t *dyb = to_bf16(dy, R * D);
  float *y4 = calloc((size_t)(R * D), 4), *ys = calloc((size_t)(R * D), 4);
  float *dx4 = calloc((size_t)(R * C), 4), *dxs = calloc((size_t)(R * C), 4);
  lz_tensor *tx = T(bf ? (void *)xb : x, dt, R, C), *tdy = T(bf ? (void *)dyb : dy, dt, R, D);
  lz_tensor *tw4 = T(bf ? (void *)wb : w, dt, E, P, D, C);
  lz_tensor *tws = T(bf ? (void *)wsb : ws, dt, E, D, C), *toff = T(rt.off, LZ_I32, E + 1);
  CHECK_OK(lz_moe_gemm_part_forward(T(y4, LZ_F32, R, D), tx, tw4, toff, part));
  CHECK_OK(lz_moe_gemm_forward(T(ys, LZ_F32, R, D), tx, tws, toff));
  CHECK(memcmp(y4, ys, 4 * (size_t)(R * D)) == 0);
  CHECK_OK(lz_moe_gemm_part_backward(T(dx4, LZ_F32, R, C), T(dw4, LZ_F32, E, P, D, C), tdy, tx,
                                     tw4, toff, part));
  CHECK_OK(lz_moe_gemm_backward(T(dxs, LZ_F32, R, C), T(dws, LZ_F32, E, D, C), tdy, tx, tws,
                                toff));
  CHECK(memcmp(dx4, dxs, 4 * (size_t)(R * C)) == 0);
  for (int64_t e = 0; e < E; e++)
    for (int64_t q = 0; q < P; q++)
      CHECK(memcmp(dw4 + (e * P + q) * M, q == part ? dws + e * M : dw0 + (e * P + q) * M,
                   4 * (size_t)M) == 0);
  free(x), free(w), free(dy), free(dw4), free(dw0), free(dws), free(ws), free(xb), free(wb);
  free(wsb), free(dyb), free(y4), free(ys), free(dx4), free(dxs);
  routing_free(&rt);
  unwrap_all();
}

LZ_TEST(moe_gemm_part_matches_stacked) {
  part_case(21, 5, 3, 0, 24, 40, LZ_F32);
  part_case(200, 3, 3, 2, 24, 300, LZ_F32); /* blocks of 128 rows, of 128 dw rows */
  part_case(21, 5, 3, 1, 24, 40, LZ_BF16);
  part_case(200, 3, 3, 2, 24, 300, LZ_BF16);
}

/* moe_gemm_part_backward_write over garbage gives the bits of
 * moe_gemm_part_backward added into zeros, its part of every expert
 * written (zeros for the expert no row reached), the other parts untouched;
 * a later add into the written dw as into the added one. At small shapes
 * and at moe-100m's (64 rows an expert), f32 and bf16. */
static void write_case(int64_t N, int64_t E, int64_t P, int64_t part, int64_t C, int64_t D,
                       lz_dtype dt) {
  const int64_t K = 2, R = N * K, M = D * C, W = E * P * M;
  routing rt = routing_new(N, E, K, 91 + (uint64_t)part, 1);
  uint64_t rng = 17 + (uint64_t)part;
  float *x = rand_f32(R * C, &rng, 1.0f), *w = rand_f32(W, &rng, 0.5f);
  float *dy = rand_f32(R * D, &rng, 1.0f), *dwa = rand_f32(W, &rng, 1.0f);
  float *dww = rand_f32(W, &rng, 1.0f), *other = malloc(4 * (size_t)W);
  float *dxa = calloc((size_t)(R * C), 4), *dxw = calloc((size_t)(R * C), 4);
  memcpy(other, dww, 4 * (size_t)W);
  for (int64_t e = 0; e < E; e++) memset(dwa + (e * P + part) * M, 0, 4 * (size_t)M);
  const int bf = dt == LZ_BF16;
  uint16_t *xb = to_bf16(x, R * C), *wb = to_bf16(w, W), *dyb = to_bf16(dy, R * D);
  lz_tensor *tx = T(bf ? (void *)xb : x, dt, R, C), *tdy = T(bf ? (void *)dyb : dy, dt, R, D);
  lz_tensor *tw = T(bf ? (void *)wb : w, dt, E, P, D, C), *toff = T(rt.off, LZ_I32, E + 1);
  lz_tensor *ta = T(dwa, LZ_F32, E, P, D, C), *tw_ = T(dww, LZ_F32, E, P, D, C);
  CHECK_OK(lz_moe_gemm_part_backward(T(dxa, LZ_F32, R, C), ta, tdy, tx, tw, toff, part));
  CHECK_OK(lz_moe_gemm_part_backward_write(T(dxw, LZ_F32, R, C), tw_, tdy, tx, tw, toff, part));
  CHECK(memcmp(dxa, dxw, 4 * (size_t)(R * C)) == 0);
  for (int64_t e = 0; e < E; e++)
    for (int64_t q = 0; q < P; q++)
      CHECK(memcmp(dww + (e * P + q) * M, (q == part ? dwa : other) + (e * P + q) * M,
                   4 * (size_t)M) == 0);
  int zeros = 1; /* the last expert got no row */
  for (int64_t i = 0; i < M; i++) zeros &= dww[((E - 1) * P + part) * M + i] == 0.0f;
  CHECK(zeros);
  CHECK_OK(lz_moe_gemm_part_backward(NULL, ta, tdy, tx, tw, toff, part));
  CHECK_OK(lz_moe_gemm_part_backward(NULL, tw_, tdy, tx, tw, toff, part));
  for (int64_t e = 0; e < E; e++)
    CHECK(memcmp(dww + (e * P + part) * M, dwa + (e * P + part) * M, 4 * (size_t)M) == 0);
  free(x), free(w), free(dy), free(dwa), free(dww), free(other), free(dxa), free(dxw);
  free(xb), free(wb), free(dyb);
  routing_free(&rt);
  unwrap_all();
}

LZ_TEST(moe_gemm_part_backward_write_is_add_into_zeros) {
  const lz_dtype dts[2] = {LZ_F32, LZ_BF16};
  for (int d = 0; d < 2; d++) {
    write_case(21, 5, 3, 1, 24, 40, dts[d]);
    write_case(200, 3, 3, 2, 24, 300, dts[d]); /* blocks of 128 rows, of 128 dw rows */
    write_case(128, 5, 2, 1, 768, 2048, dts[d]); /* 64 rows an expert, the last none */
  }
}

/* moe_gemm_part_backward_norm: dw's bits those of moe_gemm_part_backward
 * (added into, or _write), every entry it gives (not NaN) the bits of
 * sq_norm over that block of the slice, the count given as the tasks'
 * whole blocks say where dw lies on the blocks, and sq_norm_blocks over
 * the slice the bits of sq_norm, every entry NaN again after it. dw_at
 * off the blocks (blocks that straddle dw's edges or two tasks are not
 * given), the slice's last block short, f32 and bf16, moe-100m's shape.
 * expect: the count of entries to be given, -1 for some, -2 for any;
 * last: the slice's last block must be among them. */
static void norm_case(int64_t N, int64_t E, int64_t part, int64_t C, int64_t D, lz_dtype dt,
                      int64_t dw_at, int64_t after, int write, int64_t expect, int last) {
  const int64_t K = 2, P = 3, R = N * K, M = D * C, W = E * P * M, n = dw_at + W + after;
  const int64_t nb = (n + 4095) / 4096;
  routing rt = routing_new(N, E, K, 31 + (uint64_t)part, 1);
  uint64_t rng = 5 + (uint64_t)(dw_at + part);
  float *x = rand_f32(R * C, &rng, 1.0f), *w = rand_f32(W, &rng, 0.5f);
  float *dy = rand_f32(R * D, &rng, 1.0f), *fused = rand_f32(n, &rng, 1.0f);
  float *plain = malloc(4 * (size_t)n);
  memcpy(plain, fused, 4 * (size_t)n);
  double *blocks = malloc(sizeof(double) * (size_t)nb);
  for (int64_t k = 0; k < nb; k++) blocks[k] = NAN;
  const int bf = dt == LZ_BF16;
  uint16_t *xb = to_bf16(x, R * C), *wb = to_bf16(w, W), *dyb = to_bf16(dy, R * D);
  lz_tensor *tx = T(bf ? (void *)xb : x, dt, R, C), *tdy = T(bf ? (void *)dyb : dy, dt, R, D);
  lz_tensor *tw = T(bf ? (void *)wb : w, dt, E, P, D, C), *toff = T(rt.off, LZ_I32, E + 1);
  lz_tensor *tp = T(plain + dw_at, LZ_F32, E, P, D, C), *tf = T(fused + dw_at, LZ_F32, E, P, D, C);
  CHECK_OK(write ? lz_moe_gemm_part_backward_write(NULL, tp, tdy, tx, tw, toff, part)
                 : lz_moe_gemm_part_backward(NULL, tp, tdy, tx, tw, toff, part));
  CHECK_OK(lz_moe_gemm_part_backward_norm(NULL, tf, tdy, tx, tw, toff, part, write, blocks, n,
                                          dw_at));
  CHECK(memcmp(plain, fused, 4 * (size_t)n) == 0);
  int64_t given = 0, wrong = 0;
  for (int64_t k = 0; k < nb; k++) {
    if (blocks[k] != blocks[k]) continue;
    const int64_t len = n - 4096 * k < 4096 ? n - 4096 * k : 4096;
    double want = -1.0;
    lz_tensor *blk = lz_test_wrap(fused + 4096 * k, LZ_F32, 1, &len);
    CHECK_OK(lz_sq_norm(blk, &want));
    lz_tensor_free(blk);
    given++;
    wrong += memcmp(&want, &blocks[k], sizeof want) != 0;
  }
  CHECK(wrong == 0);
  if (expect >= 0 && given != expect)
    lz_test_fail(__FILE__, __LINE__, "norm partials: %lld given, %lld expected (D %lld C %lld "
                 "at %lld)", (long long)given, (long long)expect, (long long)D, (long long)C,
                 (long long)dw_at);
  if (expect == -1) CHECK(given > 0);
  if (last) CHECK(blocks[nb - 1] == blocks[nb - 1]); /* the short last block taken */
  double a = -1.0, b = -2.0;
  lz_tensor *slice = T(fused, LZ_F32, n);
  CHECK_OK(lz_sq_norm(slice, &a));
  CHECK_OK(lz_sq_norm_blocks(slice, blocks, &b));
  CHECK(memcmp(&a, &b, sizeof a) == 0);
  int64_t left = 0;
  for (int64_t k = 0; k < nb; k++) left += blocks[k] == blocks[k];
  CHECK(left == 0);
  free(x), free(w), free(dy), free(fused), free(plain), free(blocks), free(xb), free(wb), free(dyb);
  routing_free(&rt);
  unwrap_all();
}

LZ_TEST(moe_gemm_backward_norm_partials_are_sq_norms_bits) {
  for (int write = 0; write < 2; write++) {
    /* moe-100m's gate/up and down on the blocks: every block of the part's
     * experts (5 of them, the last with no row: given only where written) */
    norm_case(160, 5, 1, 768, 2048, LZ_BF16, 0, 0, write, (write ? 5 : 4) * 384, 0);
    norm_case(160, 5, 2, 2048, 768, LZ_F32, 4096, 100, write, (write ? 5 : 4) * 384, 0);
    /* off the blocks: tasks of 3,072 elements (no block inside one), of
     * 8,192 (some) */
    norm_case(200, 3, 2, 24, 300, LZ_F32, 100, 0, write, -2, 0);
    norm_case(200, 3, 0, 64, 300, LZ_BF16, 4000, 7, write, -1, 0);
  }
  /* the slice's last block short, inside the last expert (no row: zeros) */
  norm_case(160, 5, 2, 100, 333, LZ_F32, 5, 0, 1, -1, 1);
}

LZ_TEST(sq_norm_blocks_takes_what_it_is_given) {
  float z[9000] = {0};
  double blocks[3] = {1.0, NAN, 0.25}, out = 0.0;
  lz_tensor *t = T(z, LZ_F32, 9000);
  CHECK_OK(lz_sq_norm_blocks(t, blocks, &out));
  CHECK(out == 1.25);
  CHECK(blocks[0] != blocks[0] && blocks[1] != blocks[1] && blocks[2] != blocks[2]);
  CHECK_ERR(lz_sq_norm_blocks(t, NULL, &out), LZ_ERR_INVALID, "blocks is NULL");
  /* one expert of 2 rows, all ones: dw (2 x 4) all 2, its block's sum 32 */
  double few[1] = {NAN};
  float g[8] = {0}, ones[8] = {1, 1, 1, 1, 1, 1, 1, 1};
  int32_t off[2] = {0, 2};
  lz_tensor *w = T(ones, LZ_F32, 1, 1, 2, 4), *x = T(ones, LZ_F32, 2, 4);
  lz_tensor *d = T(ones, LZ_F32, 2, 2), *dw = T(g, LZ_F32, 1, 1, 2, 4), *o = T(off, LZ_I32, 2);
  CHECK_ERR(lz_moe_gemm_part_backward_norm(NULL, dw, d, x, w, o, 0, 1, few, 8, 1),
            LZ_ERR_INVALID, "does not lie in a slice of 8");
  CHECK_ERR(lz_moe_gemm_part_backward_norm(NULL, dw, d, x, w, o, 0, 1, NULL, 8, 0),
            LZ_ERR_INVALID, "blocks is NULL");
  CHECK_OK(lz_moe_gemm_part_backward_norm(NULL, dw, d, x, w, o, 0, 1, few, 8, 0));
  CHECK(g[0] == 2.0f && g[7] == 2.0f);
  CHECK(few[0] == 32.0); /* the slice's one short block, inside the one task */
  unwrap_all();
}

/* A bf16 expert's dw runs in blocks of 128 of its D output rows while it
 * has at most 384 rows, whole above (moe_gemm.c): every expert's dw, added
 * into and written, must be the bits of its own linear layer's (one GEMM
 * over all of D), and so must its rows of the forward. Row counts around
 * the block and the limit, D off the blocks (300: a last block of 44) and
 * moe-100m's gate/up and down shapes. */
static void dw_blocks_case(int64_t D, int64_t C, const int64_t *rows, int64_t E) {
  int64_t R = 0;
  for (int64_t e = 0; e < E; e++) R += rows[e];
  uint64_t rng = 5 + (uint64_t)D;
  float *x = rand_f32(R * C, &rng, 1.0f), *dy = rand_f32(R * D, &rng, 1.0f);
  float *w = rand_f32(E * D * C, &rng, 0.5f), *dw0 = rand_f32(E * D * C, &rng, 1.0f);
  float *grouped = malloc(4 * (size_t)(E * D * C)), *alone = malloc(4 * (size_t)(E * D * C));
  uint16_t *xb = to_bf16(x, R * C), *dyb = to_bf16(dy, R * D), *wb = to_bf16(w, E * D * C);
  int32_t *off = calloc((size_t)E + 1, 4);
  for (int64_t e = 0; e < E; e++) off[e + 1] = off[e] + (int32_t)rows[e];
  lz_tensor *tx = T(xb, LZ_BF16, R, C), *tdy = T(dyb, LZ_BF16, R, D);
  lz_tensor *tw = T(wb, LZ_BF16, E, D, C), *toff = T(off, LZ_I32, E + 1);
  /* the forward: each expert's rows the bits of its own linear layer's */
  float *yg = calloc((size_t)(R * D), 4), *ya = calloc((size_t)(R * D), 4);
  CHECK_OK(lz_moe_gemm_forward(T(yg, LZ_F32, R, D), tx, tw, toff));
  for (int64_t e = 0; e < E; e++) {
    if (!rows[e]) continue;
    CHECK_OK(lz_linear_forward(T(ya + off[e] * D, LZ_F32, rows[e], D),
                               T(xb + off[e] * C, LZ_BF16, rows[e], C),
                               T(wb + e * D * C, LZ_BF16, D, C), NULL));
    int64_t differ = 0;
    for (int64_t i = off[e] * D; i < off[e + 1] * D; i++) differ += memcmp(&yg[i], &ya[i], 4) != 0;
    if (differ)
      lz_test_fail(__FILE__, __LINE__, "bf16 forward, D %lld C %lld, expert of %lld rows: %lld "
                   "of %lld differ from its linear layer's", (long long)D, (long long)C,
                   (long long)rows[e], (long long)differ, (long long)(rows[e] * D));
  }
  free(yg), free(ya);
  for (int write = 0; write < 2; write++) {
    memcpy(grouped, dw0, 4 * (size_t)(E * D * C));
    memcpy(alone, dw0, 4 * (size_t)(E * D * C));
    lz_tensor *tg = T(grouped, LZ_F32, E, D, C);
    CHECK_OK(write ? lz_moe_gemm_part_backward_write(NULL, tg, tdy, tx, tw, toff, 0)
                   : lz_moe_gemm_backward(NULL, tg, tdy, tx, tw, toff));
    for (int64_t e = 0; e < E; e++) {
      if (!rows[e]) continue;
      lz_tensor *xe = T(xb + off[e] * C, LZ_BF16, rows[e], C);
      lz_tensor *dye = T(dyb + off[e] * D, LZ_BF16, rows[e], D);
      lz_tensor *we = T(wb + e * D * C, LZ_BF16, D, C), *dwe = T(alone + e * D * C, LZ_F32, D, C);
      CHECK_OK(write ? lz_linear_backward_write(NULL, dwe, NULL, dye, xe, we)
                     : lz_linear_backward(NULL, dwe, NULL, dye, xe, we));
    }
    for (int64_t e = 0; e < E; e++) {
      int64_t differ = 0;
      for (int64_t i = e * D * C; i < (e + 1) * D * C; i++)
        differ += rows[e] && memcmp(&grouped[i], &alone[i], 4) != 0;
      if (differ)
        lz_test_fail(__FILE__, __LINE__, "bf16 dw, D %lld C %lld, expert of %lld rows (%s): "
                     "%lld of %lld differ from its linear layer's", (long long)D, (long long)C,
                     (long long)rows[e], write ? "written" : "added into", (long long)differ,
                     (long long)(D * C));
    }
  }
  free(x), free(dy), free(w), free(dw0), free(grouped), free(alone), free(xb), free(dyb);
  free(wb), free(off);
  unwrap_all();
}

LZ_TEST(moe_gemm_bf16_is_each_experts_own_linear_bits) {
  if (!lz_test_bf16_native()) return;
  const int64_t small[] = {1, 2, 17, 64, 127, 128, 129, 255, 256, 0, 300, 383, 384, 385, 512};
  dw_blocks_case(300, 200, small, (int64_t)(sizeof small / sizeof *small));
  const int64_t wide[] = {64, 129, 384, 385};
  dw_blocks_case(2048, 768, wide, 4);
  dw_blocks_case(768, 2048, wide, 4); /* moe-100m's down shape */
}

/* ------------------------------------------------------------ whole layer */

/* route, sort, permute, grouped GEMM, combine: out[t] = sum over the K
 * chosen experts of weight * (x[t] @ w[e]^T), and back to dx and dlogits. */
typedef struct {
  float *out, *dx, *dl, *dw;
} layer_out;

static layer_out layer_run(const float *x, const float *logits, const float *w,
                           const float *dout, int64_t N, int64_t E, int64_t K, int64_t C) {
  const int64_t R = N * K;
  float *wt = calloc((size_t)(N * K), 4), *p = calloc((size_t)(N * E), 4);
  int32_t *id = calloc((size_t)R, 4), *ros = calloc((size_t)R, 4), *sor = calloc((size_t)R, 4);
  int32_t *off = calloc((size_t)E + 1, 4);
  float *xp = calloc((size_t)(R * C), 4), *y = calloc((size_t)(R * C), 4);
  float *dy = calloc((size_t)(R * C), 4), *dxp = calloc((size_t)(R * C), 4);
  float *dwt = calloc((size_t)(N * K), 4);
  layer_out o = {calloc((size_t)(N * C), 4), calloc((size_t)(N * C), 4),
                 calloc((size_t)(N * E), 4), calloc((size_t)(E * C * C), 4)};
  CHECK_OK(lz_moe_route_forward(T(wt, LZ_F32, N, K), T(id, LZ_I32, N, K), T(p, LZ_F32, N, E),
                                T((void *)logits, LZ_F32, N, E), 1));
  CHECK_OK(lz_moe_sort(T(ros, LZ_I32, N, K), T(sor, LZ_I32, R), T(off, LZ_I32, E + 1),
                       T(id, LZ_I32, N, K)));
  CHECK_OK(lz_moe_permute_forward(T(xp, LZ_F32, R, C), T((void *)x, LZ_F32, N, C),
                                  T(sor, LZ_I32, R)));
  CHECK_OK(lz_moe_gemm_forward(T(y, LZ_F32, R, C), T(xp, LZ_F32, R, C),
                               T((void *)w, LZ_F32, E, C, C), T(off, LZ_I32, E + 1)));
  CHECK_OK(lz_moe_combine_forward(T(o.out, LZ_F32, N, C), T(y, LZ_F32, R, C),
                                  T(wt, LZ_F32, N, K), T(ros, LZ_I32, N, K)));
  CHECK_OK(lz_moe_combine_backward(T(dy, LZ_F32, R, C), T(dwt, LZ_F32, N, K),
                                   T((void *)dout, LZ_F32, N, C), T(y, LZ_F32, R, C),
                                   T(wt, LZ_F32, N, K), T(ros, LZ_I32, N, K)));
  CHECK_OK(lz_moe_gemm_backward(T(dxp, LZ_F32, R, C), T(o.dw, LZ_F32, E, C, C),
                                T(dy, LZ_F32, R, C), T(xp, LZ_F32, R, C),
                                T((void *)w, LZ_F32, E, C, C), T(off, LZ_I32, E + 1)));
  CHECK_OK(lz_moe_permute_backward(T(o.dx, LZ_F32, N, C), T(dxp, LZ_F32, R, C),
                                   T(ros, LZ_I32, N, K)));
  CHECK_OK(lz_moe_route_backward(T(o.dl, LZ_F32, N, E), T(dwt, LZ_F32, N, K), NULL,
                                 T(p, LZ_F32, N, E), T(id, LZ_I32, N, K), 1));
  free(wt), free(p), free(id), free(ros), free(sor), free(off), free(xp), free(y), free(dy);
  free(dxp), free(dwt);
  unwrap_all();
  return o;
}

static void layer_free(layer_out *o) { free(o->out), free(o->dx), free(o->dl), free(o->dw); }

LZ_TEST(moe_layer_matches_per_token_loop_and_threads) {
  const int64_t N = 300, E = 8, K = 2, C = 32;
  uint64_t rng = 31;
  float *x = rand_f32(N * C, &rng, 1.0f), *l = rand_f32(N * E, &rng, 2.0f);
  float *w = rand_f32(E * C * C, &rng, 0.3f), *dout = rand_f32(N * C, &rng, 1.0f);
  const int saved = lz_threads_get();
  CHECK_OK(lz_threads_set(1));
  layer_out one = layer_run(x, l, w, dout, N, E, K, C);
  CHECK_OK(lz_threads_set(2));
  layer_out two = layer_run(x, l, w, dout, N, E, K, C);
  lz_threads_set(saved);
  CHECK(memcmp(one.out, two.out, 4 * (size_t)(N * C)) == 0);
  CHECK(memcmp(one.dx, two.dx, 4 * (size_t)(N * C)) == 0);
  CHECK(memcmp(one.dl, two.dl, 4 * (size_t)(N * E)) == 0);
  CHECK(memcmp(one.dw, two.dw, 4 * (size_t)(E * C * C)) == 0);
  /* the layer as a loop over tokens and their experts */
  for (int64_t t = 0; t < N; t++) {
    double ld[8], pd[8], wd[8];
    int32_t id[8];
    for (int64_t e = 0; e < E; e++) ld[e] = l[t * E + e];
    route_ref(wd, id, pd, ld, E, K, 1, NULL);
    for (int64_t d = 0; d < C; d++) {
      double s = 0;
      for (int64_t j = 0; j < K; j++) {
        double yv = 0;
        for (int64_t c = 0; c < C; c++) yv += (double)x[t * C + c] * w[(id[j] * C + d) * C + c];
        s += wd[j] * yv;
      }
      CHECK_NEAR(one.out[t * C + d], s, 1e-5);
    }
  }
  layer_free(&one), layer_free(&two);
  free(x), free(l), free(w), free(dout);
}

/* ----------------------------------------------------------------- errors */

LZ_TEST(moe_errors_name_the_argument) {
  int32_t idx[4] = {0, 5, 1, 2}, ros[4], sor[4], off[5];
  CHECK_ERR(lz_moe_sort(T(ros, LZ_I32, 2, 2), T(sor, LZ_I32, 4), T(off, LZ_I32, 5),
                        T(idx, LZ_I32, 2, 2)),
            LZ_ERR_INVALID, "moe_sort: idx[1] is 5, outside [0, 4)");
  CHECK_ERR(lz_moe_sort(T(ros, LZ_I32, 2, 2), T(sor, LZ_I32, 3), T(off, LZ_I32, 5),
                        T(idx, LZ_I32, 2, 2)),
            LZ_ERR_INVALID, "slot_of_row");
  float x[64] = {0}, w[64] = {0}, y[64];
  int32_t bad[3] = {0, 3, 2};
  CHECK_ERR(lz_moe_gemm_forward(T(y, LZ_F32, 4, 4), T(x, LZ_F32, 4, 4), T(w, LZ_F32, 2, 4, 4),
                                T(bad, LZ_I32, 3)),
            LZ_ERR_INVALID, "moe_gemm_forward: offsets[2] is 2; offsets must rise");
  CHECK_ERR(lz_moe_gemm_forward(T(y, LZ_F32, 4, 4), T(x, LZ_F32, 4, 3), T(w, LZ_F32, 2, 4, 4),
                                T(bad, LZ_I32, 3)),
            LZ_ERR_INVALID, "x's last dimension must be 4");
  int32_t good[3] = {0, 2, 4};
  CHECK_ERR(lz_moe_gemm_part_forward(T(y, LZ_F32, 4, 4), T(x, LZ_F32, 4, 2),
                                     T(w, LZ_F32, 2, 2, 4, 2), T(good, LZ_I32, 3), 2),
            LZ_ERR_INVALID, "moe_gemm_part_forward: part is 2");
  float w2[64] = {0};
  CHECK_ERR(lz_moe_gemm_part_forward(T(y, LZ_F32, 4, 4), T(x, LZ_F32, 4, 2),
                                     T(w2, LZ_F32, 2, 2, 4, 2), T(bad, LZ_I32, 3), 1),
            LZ_ERR_INVALID, "moe_gemm_part_forward: offsets[2] is 2; offsets must rise");
  float dxb[16], dw2[64], dyb[16] = {0};
  CHECK_ERR(lz_moe_gemm_part_backward_write(T(dxb, LZ_F32, 4, 2), T(dw2, LZ_F32, 2, 2, 4, 2),
                                            T(dyb, LZ_F32, 4, 4), T(x, LZ_F32, 4, 2),
                                            T(w2, LZ_F32, 2, 2, 4, 2), T(bad, LZ_I32, 3), 0),
            LZ_ERR_INVALID, "moe_gemm_part_backward_write: offsets[2] is 2; offsets must rise");
  float wt[4], p[8];
  CHECK_ERR(lz_moe_route_forward(T(wt, LZ_F32, 1, 4), T(idx, LZ_I32, 1, 4), T(p, LZ_F32, 1, 2),
                                 T(x, LZ_F32, 1, 2), 1),
            LZ_ERR_INVALID, "1 <= K <= E");
  CHECK_ERR(lz_moe_permute_forward(T(y, LZ_F32, 5, 4), T(x, LZ_F32, 2, 4), T(sor, LZ_I32, 5)),
            LZ_ERR_INVALID, "a whole number K of slots");
  /* row_of_slot with a row twice (token 1's second slot repeats token 0's
   * row 2): refused by every op that takes it as moe_sort's permutation,
   * where it would sum the row once (combine forward, permute backward) or
   * have two threads write it (combine backward), naming both slots */
  int32_t twice[4] = {2, 0, 1, 2};
  float wts[4] = {0.5f, 0.5f, 0.25f, 0.75f}, o[8], yy[8] = {1, 2, 3, 4, 5, 6, 7, 8}, dy[8], dws[4];
  const char *want = "row_of_slot[3] is 2, as row_of_slot[0] is";
  CHECK_ERR(lz_moe_combine_forward(T(o, LZ_F32, 2, 2), T(yy, LZ_F32, 4, 2), T(wts, LZ_F32, 2, 2),
                                   T(twice, LZ_I32, 2, 2)),
            LZ_ERR_INVALID, want);
  CHECK_ERR(lz_moe_combine_backward(T(dy, LZ_F32, 4, 2), T(dws, LZ_F32, 2, 2),
                                    T(o, LZ_F32, 2, 2), T(yy, LZ_F32, 4, 2),
                                    T(wts, LZ_F32, 2, 2), T(twice, LZ_I32, 2, 2)),
            LZ_ERR_INVALID, want);
  CHECK_ERR(lz_moe_permute_backward(T(o, LZ_F32, 2, 2), T(yy, LZ_F32, 4, 2),
                                    T(twice, LZ_I32, 2, 2)),
            LZ_ERR_INVALID, "moe_permute_backward: row_of_slot[3] is 2");
  /* the same ops over moe_sort's own permutation run */
  int32_t perm[4] = {2, 0, 1, 3};
  CHECK(lz_moe_combine_forward(T(o, LZ_F32, 2, 2), T(yy, LZ_F32, 4, 2), T(wts, LZ_F32, 2, 2),
                               T(perm, LZ_I32, 2, 2)) == LZ_OK);
  CHECK(o[0] == 0.5f * 5 + 0.5f * 1 && o[3] == 0.25f * 4 + 0.75f * 8);
  /* more slots than an i32 row index holds: refused before anything is
   * read (the tensors only describe 2^31 slots over a small buffer) */
  CHECK_ERR(lz_moe_sort(T(ros, LZ_I32, 1073741824, 2), T(sor, LZ_I32, 2147483648LL),
                        T(off, LZ_I32, 5), T(idx, LZ_I32, 1073741824, 2)),
            LZ_ERR_INVALID, "moe_sort: idx has 2147483648 slots");
  unwrap_all();
}
