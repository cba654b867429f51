/* lz_test.h — the C test runner: LZ_TEST(name) { ... } registers a test; the
 * checks record a failure with file:line and let the test go on.
 * build/bin/lz_tests [substring] runs them and ends with "N passed, N failed". */
#ifndef LZ_TEST_H
#define LZ_TEST_H

#include "luazero.h"

#include <math.h>  /* fabs */
#include <stdio.h>  /* printf for failure reports */
#include <string.h> /* strstr in CHECK_ERR */

typedef void (*lz_test_fn)(void);
void lz_test_register(const char *name, lz_test_fn fn);
void lz_test_fail(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define LZ_TEST(name)                                                                       \
  static void name(void);                                                                   \
  __attribute__((constructor)) static void name##_register(void) {                          \
    lz_test_register(#name, name);                                                          \
  }                                                                                         \
  static void name(void)

#define CHECK(cond)                                                                         \
  do {                                                                                      \
    if (!(cond)) lz_test_fail(__FILE__, __LINE__, "CHECK(%s)", #cond);                     \
  } while (0)

/* Expects LZ_OK; prints lz_last_error() otherwise. */
#define CHECK_OK(expr)                                                                      \
  do {                                                                                      \
    lz_status st_ = (expr);                                                                 \
    if (st_ != LZ_OK)                                                                       \
      lz_test_fail(__FILE__, __LINE__, "%s -> %s: %s", #expr, lz_status_name(st_),          \
                   lz_last_error());                                                        \
  } while (0)

/* Expects a given failing status and an error message containing `needle`. */
#define CHECK_ERR(expr, status, needle)                                                     \
  do {                                                                                      \
    lz_status st_ = (expr);                                                                 \
    if (st_ != (status))                                                                    \
      lz_test_fail(__FILE__, __LINE__, "%s -> %s, expected %s", #expr, lz_status_name(st_), \
                   lz_status_name(status));                                                 \
    else if (!strstr(lz_last_error(), (needle)))                                            \
      lz_test_fail(__FILE__, __LINE__, "%s: error \"%s\" does not mention \"%s\"", #expr,   \
                   lz_last_error(), (needle));                                              \
  } while (0)

#define CHECK_EQ_INT(a, b)                                                                  \
  do {                                                                                      \
    long long a_ = (long long)(a), b_ = (long long)(b);                                     \
    if (a_ != b_) lz_test_fail(__FILE__, __LINE__, "%s == %s: %lld != %lld", #a, #b, a_, b_); \
  } while (0)

/* |a-b| <= tol * max(1, |b|)  (relative above 1, absolute below). */
#define CHECK_NEAR(a, b, tol)                                                               \
  do {                                                                                      \
    double a_ = (double)(a), b_ = (double)(b);                                              \
    double s_ = fabs(b_) > 1.0 ? fabs(b_) : 1.0;                                            \
    if (!(fabs(a_ - b_) <= (tol) * s_))                                                     \
      lz_test_fail(__FILE__, __LINE__, "%s ~ %s: %.9g vs %.9g (tol %g)", #a, #b, a_, b_,    \
                   (double)(tol));                                                          \
  } while (0)

/* Shared by the kernel tests (lz_test_util.c). */
uint64_t lz_test_xorshift(uint64_t *state); /* next xorshift64 value */
float lz_test_uniform(uint64_t *state);     /* uniform in [-1, 1) */
/* A borrowed tensor over data (a failed wrap is a test failure). */
lz_tensor *lz_test_wrap(void *data, lz_dtype dt, int ndim, const int64_t *shape);
/* Worst |a - b| / max(|b|, 1% of max|b|): relative error, floored so the
 * near-zero entries of a gradient are judged against its scale. */
double lz_test_rel_err(const float *a, const double *b, int64_t n);
/* Operands for the argument checks of an op: `shape` (8 elements) as f32,
 * i32 and bf16, and f32[9], one element too many; over zeroed buffers the
 * failing calls stop before touching. */
typedef struct {
  lz_tensor *f32, *i32, *bf16, *f32_9;
} lz_test_operands;
lz_test_operands lz_test_operands_new(int ndim, const int64_t *shape);
void lz_test_operands_free(lz_test_operands *o);
/* 1 where bf16 GEMMs run oneDNN's bf16 kernels (lz_bf16_matmul_path);
 * else 0, having printed that the test's claim (one of those kernels') is
 * skipped on this machine, where they run widened to fp32 sgemm. */
int lz_test_bf16_native(void);

#endif /* LZ_TEST_H */
