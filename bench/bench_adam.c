/* bench_adam.c — the C side of bench/bench-adam: lz_adamw_step over N fp32
 * parameters (working copy none, f32, bf16, f16), the fused 8-bit step
 * (lz_adamw8bit_step, u8 m and v, working none and bf16), and a STREAM-like copy and
 * triad on the same kind of memory (2 MiB-aligned, huge pages), on the
 * threads OMP_NUM_THREADS gives. One line per figure, medians of --reps;
 * each 8-bit rep runs right after an fp32 step of the same working copy,
 * and its line gives both rates and the median of the pairs' ratios (the
 * machine's memory speed drifts between minutes; a pair shares it):
 *   R adam <working> <params per second>
 *   R adam8bit <working> <params per second> <fp32 AdamW's, same reps> <ratio>
 *   R stream <copy|triad> <bytes/s as STREAM counts> <bytes/s moved>
 * STREAM counts copy 8 B and triad 12 B per element; the memory moves one
 * more 4 B per element (the line written is read first: write-allocate), as
 * Adam's in-place writes do not. The best of --reps, as STREAM reports.
 *   --n N (default 50000000)  --reps R (default 7)
 *   --cpu-time: time the optimizer steps by the process's CPU time, not the
 *   wall clock: on a machine other jobs load, with one thread, the rates a
 *   quiet machine would give (the STREAM lines keep the wall clock). */
#include "luazero.h"

#include <omp.h>    /* omp_get_max_threads for the header line */
#include <stdio.h>  /* printf */
#include <stdlib.h> /* atoll, qsort */
#include <string.h> /* strcmp */
#include <time.h>   /* clock_gettime */

#include "bench_timing.h" /* now_s, median, best */

static int cpu_time;

static double step_clock(void) {
  if (!cpu_time) return now_s();
  struct timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void *alloc_or_die(size_t bytes) {
  void *p = NULL;
  if (lz_mem_alloc(&p, bytes, LZ_MEM_OPTIMIZER) != LZ_OK) {
    fprintf(stderr, "bench_adam: %s\n", lz_last_error());
    exit(1);
  }
  return p;
}

static void copy_kernel(float *restrict a, const float *restrict b, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) a[i] = b[i];
}

static void triad_kernel(float *restrict a, const float *restrict b, const float *restrict c,
                         float s, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) a[i] = b[i] + s * c[i];
}

int main(int argc, char **argv) {
  int64_t n = 50000000;
  int reps = 7;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--n") && i + 1 < argc) n = atoll(argv[++i]);
    else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--cpu-time")) cpu_time = 1;
    else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
      printf("usage: bench_adam [--n N] [--reps R] [--cpu-time]\n  --n N       parameters "
             "(default 50000000)\n  --reps R    timed steps, 1..100 (default 7)\n  --cpu-time  "
             "steps timed in process CPU time, not the wall clock\n");
      return 0;
    } else {
      fprintf(stderr, "bench_adam: unknown argument %s (--n N, --reps R, --cpu-time)\n", argv[i]);
      return 2;
    }
  }
  if (n < 1 || reps < 1 || reps > 100) {
    fprintf(stderr, "bench_adam: --n must be >= 1 and --reps 1..100\n");
    return 2;
  }
  const size_t fb = (size_t)n * sizeof(float), hb = (size_t)n * sizeof(uint16_t);
  float *p = alloc_or_die(fb), *g = alloc_or_die(fb), *m = alloc_or_die(fb);
  float *v = alloc_or_die(fb), *wf = alloc_or_die(fb);
  uint16_t *wh = alloc_or_die(hb);
  printf("# n %lld, threads %d, reps %d (medians%s)\n", (long long)n, omp_get_max_threads(), reps,
         cpu_time ? ", optimizer steps in CPU time" : "");

  /* STREAM-like, on p, g, m before they hold parameters (first touch here). */
  double t[100];
  for (int64_t i = 0; i < n; i++) p[i] = 0.0f, g[i] = 1.0f, m[i] = 2.0f;
  copy_kernel(p, g, n);
  for (int r = 0; r < reps; r++) {
    double t0 = now_s();
    copy_kernel(p, g, n);
    t[r] = now_s() - t0;
  }
  printf("R stream copy %.6e %.6e\n", 8.0 * (double)n / best(t, reps),
         12.0 * (double)n / best(t, reps));
  triad_kernel(p, g, m, 3.0f, n);
  for (int r = 0; r < reps; r++) {
    double t0 = now_s();
    triad_kernel(p, g, m, 3.0f, n);
    t[r] = now_s() - t0;
  }
  printf("R stream triad %.6e %.6e\n", 12.0 * (double)n / best(t, reps),
         16.0 * (double)n / best(t, reps));

  uint64_t s = 0x9E3779B97F4A7C15ull;
  for (int64_t i = 0; i < n; i++) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    p[i] = (float)((double)(s >> 40) * 0x1p-24 - 0.5);
    g[i] = (float)((double)(s & 0xffffff) * 0x1p-30);
    m[i] = v[i] = 0.0f;
  }
  const int64_t shape[1] = {n};
  lz_tensor *tp, *tg, *tm, *tv, *tw32, *twbf, *twh;
  if (lz_tensor_wrap(&tp, p, LZ_F32, 1, shape) || lz_tensor_wrap(&tg, g, LZ_F32, 1, shape) ||
      lz_tensor_wrap(&tm, m, LZ_F32, 1, shape) || lz_tensor_wrap(&tv, v, LZ_F32, 1, shape) ||
      lz_tensor_wrap(&tw32, wf, LZ_F32, 1, shape) ||
      lz_tensor_wrap(&twbf, wh, LZ_BF16, 1, shape) || lz_tensor_wrap(&twh, wh, LZ_F16, 1, shape)) {
    fprintf(stderr, "bench_adam: %s\n", lz_last_error());
    return 1;
  }
  struct {
    const char *name;
    lz_tensor *w;
  } variants[4] = {{"none", NULL}, {"f32", tw32}, {"bf16", twbf}, {"f16", twh}};
  lz_adamw_args args = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                        .weight_decay = 0.01f, .grad_scale = 1.0f, .step = 1};
  for (int k = 0; k < 4; k++) {
    if (lz_adamw_step(tp, tg, tm, tv, variants[k].w, &args) != LZ_OK) { /* warm-up */
      fprintf(stderr, "bench_adam: %s\n", lz_last_error());
      return 1;
    }
    args.step++;
    for (int r = 0; r < reps; r++) {
      double t0 = step_clock();
      lz_adamw_step(tp, tg, tm, tv, variants[k].w, &args);
      t[r] = step_clock() - t0;
      args.step++;
    }
    printf("R adam %s %.6e\n", variants[k].name, (double)n / median(t, reps));
  }
  /* The 8-bit step over the same parameters and gradients, its u8 states
   * and absmaxes in buffers of their own, each rep paired with an fp32 step
   * of the same working copy just before it: both see the machine of the
   * same moment, and the line's ratio is the median of the pairs'. */
  const int64_t blocks = lz_adamw8bit_blocks(n), bshape[1] = {blocks};
  uint8_t *m8 = alloc_or_die((size_t)n), *v8 = alloc_or_die((size_t)n);
  float *am = alloc_or_die((size_t)blocks * sizeof(float));
  float *av = alloc_or_die((size_t)blocks * sizeof(float));
  for (int64_t i = 0; i < n; i++) m8[i] = v8[i] = 0;
  for (int64_t i = 0; i < blocks; i++) am[i] = av[i] = 0.0f;
  lz_tensor *tm8, *tv8, *tam, *tav;
  if (lz_tensor_wrap(&tm8, m8, LZ_U8, 1, shape) || lz_tensor_wrap(&tv8, v8, LZ_U8, 1, shape) ||
      lz_tensor_wrap(&tam, am, LZ_F32, 1, bshape) || lz_tensor_wrap(&tav, av, LZ_F32, 1, bshape)) {
    fprintf(stderr, "bench_adam: %s\n", lz_last_error());
    return 1;
  }
  const int eight_variants[2] = {0, 2};
  lz_adamw_args args8 = args;
  args8.step = 1;
  for (int e = 0; e < 2; e++) {
    lz_tensor *w = variants[eight_variants[e]].w;
    if (lz_adamw8bit_step(tp, tg, tm8, tv8, tam, tav, w, &args8) != LZ_OK) { /* warm-up */
      fprintf(stderr, "bench_adam: %s\n", lz_last_error());
      return 1;
    }
    args8.step++;
    double t32[100], ratio[100];
    for (int r = 0; r < reps; r++) {
      double t0 = step_clock();
      lz_adamw_step(tp, tg, tm, tv, w, &args);
      t32[r] = step_clock() - t0;
      args.step++;
      t0 = step_clock();
      lz_adamw8bit_step(tp, tg, tm8, tv8, tam, tav, w, &args8);
      t[r] = step_clock() - t0;
      args8.step++;
      ratio[r] = t32[r] / t[r];
    }
    printf("R adam8bit %s %.6e %.6e %.4f\n", variants[eight_variants[e]].name,
           (double)n / median(t, reps), (double)n / median(t32, reps), median(ratio, reps));
  }
  lz_tensor_free(tm8), lz_tensor_free(tv8), lz_tensor_free(tam), lz_tensor_free(tav);
  lz_tensor_free(tp), lz_tensor_free(tg), lz_tensor_free(tm), lz_tensor_free(tv);
  lz_tensor_free(tw32), lz_tensor_free(twbf), lz_tensor_free(twh);
  lz_mem_free(p), lz_mem_free(g), lz_mem_free(m), lz_mem_free(v), lz_mem_free(wf);
  lz_mem_free(wh), lz_mem_free(m8), lz_mem_free(v8), lz_mem_free(am), lz_mem_free(av);
  return 0;
}
