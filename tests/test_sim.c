/* test_sim.c — the sim device (core/devices/): its allocator and capacity, every
 * op bitwise the cpu result, asynchronous streams and events (with jitter),
 * host accesses that fault, and sticky errors. Sim is initialized once in
 * this process and stays; with cuda initialized first (a GPU machine), the
 * tests are skipped. */
#include "mem/lz_backend.h" /* LZ_OP_COUNT: every op is covered */
#include "devices/lz_sim.h"
#include "lz_test.h"

#include <signal.h>   /* SIGSEGV */
#include <stdlib.h>   /* malloc */
#include <sys/wait.h> /* waitpid */
#include <unistd.h>   /* fork */

static int sim_up(void) {
  if (lz_cuda_ready()) {
    printf("    skipped: cuda is initialized in this process\n");
    return 0;
  }
  CHECK_OK(lz_sim_init());
  return lz_sim_ready();
}

/* ------------------------------------------------------------- helpers */

static lz_tensor *new_on(lz_device dev, lz_dtype dt, int nd, const int64_t *shape) {
  lz_tensor *t = NULL;
  CHECK_OK(lz_tensor_new_on(&t, dt, nd, shape, LZ_MEM_WORKSPACE, dev));
  return t;
}

/* A host copy of any tensor (a device one through a d2h copy). */
static lz_tensor *host_copy(const lz_tensor *t) {
  lz_tensor *h = new_on(LZ_CPU, t->dtype, t->ndim, t->shape);
  if (h) CHECK_OK(lz_tensor_copy(h, t));
  return h;
}

static int same_bits(const lz_tensor *a, const lz_tensor *b) {
  lz_tensor *ha = host_copy(a), *hb = host_copy(b);
  int same = ha && hb && lz_tensor_bytes(ha) == lz_tensor_bytes(hb) &&
             memcmp(ha->data, hb->data, lz_tensor_bytes(ha)) == 0;
  lz_tensor_free(ha), lz_tensor_free(hb);
  return same;
}

/* A tensor's contents: uniform in [-1, 1), |.| for POS, ids in [0, RANGE),
 * or (PERM) a random permutation of 0 .. numel - 1. */
typedef struct {
  lz_dtype dt;
  int nd;
  int64_t shape[4];
  int ids; /* > 0: i32 ids in [0, ids); -1: a permutation */
  int pos; /* positive values */
} spec;

static void fill_random(lz_tensor *t, const spec *s, uint64_t *rng) {
  int64_t n = lz_tensor_numel(t);
  if (s->ids < 0) {
    int32_t *p = t->data;
    for (int64_t i = 0; i < n; i++) p[i] = (int32_t)i;
    for (int64_t i = n - 1; i > 0; i--) {
      const int64_t j = (int64_t)(lz_test_xorshift(rng) % (uint64_t)(i + 1));
      const int32_t v = p[i];
      p[i] = p[j], p[j] = v;
    }
    return;
  }
  for (int64_t i = 0; i < n; i++) {
    if (s->ids) {
      ((int32_t *)t->data)[i] = (int32_t)(lz_test_xorshift(rng) % (uint64_t)s->ids);
      continue;
    }
    if (t->dtype == LZ_U8) {
      ((uint8_t *)t->data)[i] = (uint8_t)lz_test_xorshift(rng);
      continue;
    }
    float v = lz_test_uniform(rng);
    if (s->pos) v = fabsf(v) + 0.1f;
    if (t->dtype == LZ_F32)
      ((float *)t->data)[i] = v;
    else if (t->dtype == LZ_BF16)
      ((uint16_t *)t->data)[i] = lz_f32_to_bf16(v);
    else if (t->dtype == LZ_F16)
      ((uint16_t *)t->data)[i] = lz_f32_to_f16(v);
  }
}

typedef lz_status (*op_fn)(lz_tensor **t);

/* Runs fn on host tensors and on sim copies of them, and checks every
 * tensor (inputs included) holds bitwise the same bytes afterwards. */
static void check_op(const char *name, op_fn fn, int n, const spec *specs) {
  lz_tensor *h[8] = {0}, *d[8] = {0};
  uint64_t rng = 0x5eed0000u + (uint64_t)n * 7919u + strlen(name);
  for (int i = 0; i < n; i++) {
    h[i] = new_on(LZ_CPU, specs[i].dt, specs[i].nd, specs[i].shape);
    if (!h[i]) return;
    fill_random(h[i], &specs[i], &rng);
    d[i] = new_on(LZ_SIM, specs[i].dt, specs[i].nd, specs[i].shape);
    if (!d[i]) return;
    CHECK_OK(lz_tensor_copy(d[i], h[i]));
  }
  lz_status hs = fn(h), ds = fn(d);
  if (hs != LZ_OK || ds != LZ_OK)
    lz_test_fail(__FILE__, __LINE__, "%s: cpu %s, sim %s: %s", name, lz_status_name(hs),
                 lz_status_name(ds), lz_last_error());
  CHECK_OK(lz_device_synchronize());
  for (int i = 0; i < n; i++)
    if (!same_bits(h[i], d[i]))
      lz_test_fail(__FILE__, __LINE__, "%s: tensor %d differs between cpu and sim", name, i);
  for (int i = 0; i < n; i++) lz_tensor_free(h[i]), lz_tensor_free(d[i]);
}

#define F32(...) \
  { LZ_F32, sizeof((int64_t[]){__VA_ARGS__}) / 8, {__VA_ARGS__}, 0, 0 }
#define F32P(...) \
  { LZ_F32, sizeof((int64_t[]){__VA_ARGS__}) / 8, {__VA_ARGS__}, 0, 1 }
#define BF16(...) \
  { LZ_BF16, sizeof((int64_t[]){__VA_ARGS__}) / 8, {__VA_ARGS__}, 0, 0 }
#define F16(...) \
  { LZ_F16, sizeof((int64_t[]){__VA_ARGS__}) / 8, {__VA_ARGS__}, 0, 0 }
#define U8(...) \
  { LZ_U8, sizeof((int64_t[]){__VA_ARGS__}) / 8, {__VA_ARGS__}, 0, 0 }
#define IDS(range, ...) \
  { LZ_I32, sizeof((int64_t[]){__VA_ARGS__}) / 8, {__VA_ARGS__}, range, 0 }
#define PERM(...) \
  { LZ_I32, sizeof((int64_t[]){__VA_ARGS__}) / 8, {__VA_ARGS__}, -1, 0 }
#define CHECK_OP(name, ...) \
  check_op(#name, name, sizeof((spec[]){__VA_ARGS__}) / sizeof(spec), (spec[]){__VA_ARGS__})

/* ------------------------------------------------------- init, memory */

LZ_TEST(sim_init_one_accelerator_per_process) {
  if (!sim_up()) return;
  CHECK_OK(lz_sim_init()); /* again: no-op */
  CHECK_ERR(lz_cuda_init(0), LZ_ERR_INVALID,
            "cuda_init: this process already uses sim; one accelerator per process (asked for "
            "cuda)");
  CHECK(!lz_cuda_ready());
  CHECK_EQ_INT(lz_cuda_device(), -1);
  lz_tensor *t = NULL;
  CHECK_ERR(lz_tensor_new_on(&t, LZ_F32, 1, (int64_t[]){4}, LZ_MEM_PARAMS, LZ_CUDA),
            LZ_ERR_UNSUPPORTED, "cuda is not initialized: this process uses sim");
  CHECK(t == NULL);
  CHECK_ERR(lz_cuda_synchronize(), LZ_ERR_UNSUPPORTED, "cuda is not initialized");
}

LZ_TEST(sim_memory_setting_parses) {
  size_t v = 0;
  CHECK_OK(lz_sim_parse_memory("8GiB", &v));
  CHECK(v == (size_t)8 << 30);
  CHECK_OK(lz_sim_parse_memory("3MiB", &v));
  CHECK(v == (size_t)3 << 20);
  CHECK_OK(lz_sim_parse_memory("4096", &v));
  CHECK(v == 4096);
  CHECK_ERR(lz_sim_parse_memory("12GB", &v), LZ_ERR_INVALID,
            "LZ_SIM_MEMORY=\"12GB\" is not a size");
  CHECK_ERR(lz_sim_parse_memory("-1", &v), LZ_ERR_INVALID, "LZ_SIM_MEMORY=\"-1\"");
  CHECK_ERR(lz_sim_parse_memory("0", &v), LZ_ERR_INVALID, "LZ_SIM_MEMORY=\"0\"");
}

LZ_TEST(sim_alloc_aligns_reuses_and_coalesces) {
  if (!sim_up()) return;
  int64_t before = lz_mem_device_current(LZ_MEM_PARAMS);
  void *a = NULL, *b = NULL, *c = NULL, *e = NULL;
  CHECK_OK(lz_mem_alloc_device(&a, 1000, LZ_MEM_PARAMS));
  CHECK_OK(lz_mem_alloc_device(&b, 1000, LZ_MEM_PARAMS));
  CHECK_OK(lz_mem_alloc_device(&c, 1000, LZ_MEM_PARAMS));
  CHECK((uintptr_t)a % 256 == 0 && (uintptr_t)b % 256 == 0 && (uintptr_t)c % 256 == 0);
  CHECK((char *)b == (char *)a + 1024); /* first fit, 256-byte granules */
  CHECK((char *)c == (char *)b + 1024);
  CHECK_EQ_INT(lz_pointer_device(a), LZ_SIM);
  CHECK_EQ_INT(lz_pointer_device(&before), LZ_CPU);
  CHECK_EQ_INT(lz_mem_device_current(LZ_MEM_PARAMS), before + 3000);
  CHECK(lz_mem_device_peak(LZ_MEM_PARAMS) >= before + 3000);
  CHECK_OK(lz_mem_free(b));
  CHECK_OK(lz_mem_alloc_device(&e, 1024, LZ_MEM_PARAMS)); /* fits b's hole exactly */
  CHECK(e == b);
  CHECK_OK(lz_mem_free(e));
  CHECK_OK(lz_mem_free(a));
  CHECK_OK(lz_mem_free(c));
  /* a, b and c merged again: one block of 3 KiB where a was. */
  CHECK_OK(lz_mem_alloc_device(&e, 3072, LZ_MEM_PARAMS));
  CHECK(e == a);
  CHECK_OK(lz_mem_free(e));
  CHECK_EQ_INT(lz_mem_device_current(LZ_MEM_PARAMS), before);
  /* Big blocks too (their pages go back to the system when freed). */
  CHECK_OK(lz_mem_alloc_device(&e, (size_t)64 << 20, LZ_MEM_PARAMS));
  CHECK(e == a);
  CHECK_OK(lz_mem_free(e));
}

LZ_TEST(sim_out_of_memory_names_the_bytes_and_setting) {
  if (!sim_up()) return;
  void *p = NULL;
  int64_t before = lz_mem_device_total_current();
  CHECK_ERR(lz_mem_alloc_device(&p, (size_t)1 << 45, LZ_MEM_PARAMS), LZ_ERR_NOMEM,
            "sim: out of device memory: 35184372088832 bytes (32.00 TiB) asked with ");
  CHECK(strstr(lz_last_error(), " in use (LZ_SIM_MEMORY=") != NULL);
  CHECK(p == NULL);
  CHECK_EQ_INT(lz_mem_device_total_current(), before);
  lz_tensor *t = NULL;
  CHECK_ERR(lz_tensor_new_on(&t, LZ_F32, 1, (int64_t[]){(int64_t)1 << 43}, LZ_MEM_PARAMS, LZ_SIM),
            LZ_ERR_NOMEM, "sim: out of device memory");
}

LZ_TEST(sim_pinned_is_host_memory_on_the_ledger) {
  if (!sim_up()) return;
  int64_t before = lz_mem_current(LZ_MEM_OFFLOAD);
  void *small = NULL, *big = NULL;
  CHECK_OK(lz_mem_alloc_pinned(&small, 100));
  CHECK_OK(lz_mem_alloc_pinned(&big, (size_t)3 << 20));
  CHECK((uintptr_t)small % 4096 == 0);
  CHECK((uintptr_t)big % ((uintptr_t)2 << 20) == 0);
  memset(small, 1, 100), memset(big, 2, (size_t)3 << 20); /* host memory: writable */
  CHECK_EQ_INT(lz_pointer_device(big), LZ_CPU);
  CHECK_EQ_INT(lz_mem_current(LZ_MEM_OFFLOAD), before + 100 + (3 << 20));
  CHECK_OK(lz_mem_free(small));
  CHECK_OK(lz_mem_free(big));
  CHECK_EQ_INT(lz_mem_current(LZ_MEM_OFFLOAD), before);
}

LZ_TEST(sim_arenas_and_copy_counters) {
  if (!sim_up()) return;
  lz_arena *a = NULL;
  int64_t before = lz_mem_device_current(LZ_MEM_ACTIVATIONS);
  CHECK_OK(lz_arena_new_on(&a, 4096, LZ_MEM_ACTIVATIONS, LZ_SIM));
  if (!a) return;
  CHECK_EQ_INT(lz_mem_device_current(LZ_MEM_ACTIVATIONS), before + 4096);
  lz_tensor *t = NULL, *h = new_on(LZ_CPU, LZ_F32, 1, (int64_t[]){16});
  CHECK_OK(lz_arena_tensor(a, &t, LZ_F32, 1, (int64_t[]){16}));
  CHECK_EQ_INT(t->device, LZ_SIM);
  CHECK_EQ_INT(lz_pointer_device(t->data), LZ_SIM);
  for (int i = 0; i < 16; i++) ((float *)h->data)[i] = (float)i;
  lz_device_copy_bytes_reset();
  CHECK_OK(lz_tensor_copy(t, h));
  CHECK_EQ_INT(lz_device_copy_bytes(0), 64);
  CHECK_EQ_INT(lz_device_copy_bytes(1), 0);
  /* An arena over device memory makes device tensors. */
  lz_arena *w = NULL;
  CHECK_OK(lz_arena_wrap(&w, t->data, 64));
  lz_tensor *v = NULL;
  CHECK_OK(lz_arena_tensor(w, &v, LZ_F32, 1, (int64_t[]){16}));
  CHECK_EQ_INT(v->device, LZ_SIM);
  CHECK_OK(lz_scale(v, 2.0f));
  lz_tensor *back = host_copy(t);
  CHECK_EQ_INT(lz_device_copy_bytes(1), 64);
  CHECK(back && ((float *)back->data)[5] == 10.0f);
  lz_device_copy_bytes_reset();
  CHECK_EQ_INT(lz_device_copy_bytes(0) + lz_device_copy_bytes(1), 0);
  lz_tensor_free(back), lz_tensor_free(h);
  CHECK_OK(lz_arena_free(w));
  CHECK_OK(lz_arena_free(a));
  CHECK_EQ_INT(lz_mem_device_current(LZ_MEM_ACTIVATIONS), before);
}

/* ------------------------------------------------- every op, bitwise */

static lz_status matmul_nt(lz_tensor **t) { return lz_matmul(t[0], t[1], t[2], 0, 1, 1.5f, 0.5f); }
static lz_status matmul_tn(lz_tensor **t) { return lz_matmul(t[0], t[1], t[2], 1, 0, 1.0f, 0.0f); }
static lz_status linear_fwd(lz_tensor **t) { return lz_linear_forward(t[0], t[1], t[2], t[3]); }
static lz_status linear_bwd(lz_tensor **t) {
  return lz_linear_backward(t[0], t[1], t[2], t[3], t[4], t[5]);
}
static lz_status layernorm_fwd(lz_tensor **t) {
  return lz_layernorm_forward(t[0], t[1], t[2], t[3], t[4], t[5], 1e-5f);
}
static lz_status layernorm_bwd(lz_tensor **t) {
  return lz_layernorm_backward(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7]);
}
static lz_status gelu_fwd(lz_tensor **t) { return lz_gelu_forward(t[0], t[1]); }
static lz_status gelu_bwd(lz_tensor **t) { return lz_gelu_backward(t[0], t[1], t[2]); }
static lz_status attention_fwd(lz_tensor **t) { return lz_attention_forward(t[0], t[1], t[2], 2); }
static lz_status attention_bwd(lz_tensor **t) {
  return lz_attention_backward(t[0], t[1], t[2], t[3], t[4], 2);
}
static lz_status embedding_fwd(lz_tensor **t) {
  return lz_embedding_forward(t[0], t[1], t[2], t[3]);
}
static lz_status embedding_bwd(lz_tensor **t) {
  return lz_embedding_backward(t[0], t[1], t[2], t[3]);
}
static lz_status cross_entropy_fwd(lz_tensor **t) {
  return lz_cross_entropy_forward(t[0], t[1], t[2], 6);
}
static lz_status cross_entropy_bwd(lz_tensor **t) {
  return lz_cross_entropy_backward(t[0], t[1], t[2], 6, 0.25f);
}
static lz_status add(lz_tensor **t) { return lz_add(t[0], t[1], t[2]); }
static lz_status axpy(lz_tensor **t) { return lz_axpy(t[0], -0.75f, t[1]); }
static lz_status add_sq_norm(lz_tensor **t) {
  double sq = 0.0;
  return lz_add_sq_norm(t[0], t[1], 0, &sq);
}
static lz_status scale(lz_tensor **t) { return lz_scale(t[0], 1.3f); }
static lz_status fill(lz_tensor **t) { return lz_fill(t[0], 0.3f); }
static lz_status convert(lz_tensor **t) { return lz_tensor_copy(t[0], t[1]); }
static lz_status adamw(lz_tensor **t) {
  const lz_adamw_args a = {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, 3};
  return lz_adamw_step(t[0], t[1], t[2], t[3], t[4], &a);
}
static lz_status lion(lz_tensor **t) {
  const lz_lion_args a = {1e-3f, 0.9f, 0.99f, 0.1f, 0.5f};
  return lz_lion_step(t[0], t[1], t[2], t[3], &a);
}
static lz_status adamw8bit(lz_tensor **t) {
  const lz_adamw_args a = {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, 3};
  return lz_adamw8bit_step(t[0], t[1], t[2], t[3], t[4], t[5], t[6], &a);
}
static lz_status adamw8bit_f32(lz_tensor **t) {
  const lz_adamw_args a = {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, 3};
  return lz_adamw8bit_step(t[0], t[1], t[2], t[3], NULL, NULL, t[4], &a);
}
static lz_status bf16_round_stochastic(lz_tensor **t) {
  return lz_bf16_round_stochastic(t[0], t[1], 7, 3, 1000);
}
static lz_status rmsnorm_fwd(lz_tensor **t) {
  return lz_rmsnorm_forward(t[0], t[1], t[2], t[3], 1e-6f);
}
static lz_status rmsnorm_bwd(lz_tensor **t) {
  return lz_rmsnorm_backward(t[0], t[1], t[2], t[3], t[4], t[5]);
}
static lz_status rope_fwd(lz_tensor **t) { return lz_rope_forward(t[0], t[1], 2, 4, 3, 1e4f); }
static lz_status rope_bwd(lz_tensor **t) { return lz_rope_backward(t[0], t[1], 2, 4, 3, 1e4f); }
static lz_status swiglu_fwd(lz_tensor **t) { return lz_swiglu_forward(t[0], t[1], t[2]); }
static lz_status swiglu_bwd(lz_tensor **t) {
  return lz_swiglu_backward(t[0], t[1], t[2], t[3], t[4]);
}

static lz_status geglu_fwd(lz_tensor **t) { return lz_geglu_forward(t[0], t[1], t[2]); }
static lz_status geglu_bwd(lz_tensor **t) {
  return lz_geglu_backward(t[0], t[1], t[2], t[3], t[4]);
}
static lz_status softcap_fwd(lz_tensor **t) { return lz_softcap_forward(t[0], t[1], 2.5f); }
static lz_status cross_entropy_softcap_bwd(lz_tensor **t) {
  return lz_cross_entropy_softcap_backward(t[0], t[1], t[2], 7, 0.25f, 3.0f);
}

static lz_status attention_decode(lz_tensor **t) {
  return lz_attention_decode(t[0], t[1], t[2], t[3], t[4], 2, 1);
}

/* q|k|v rows of 2 q heads, 1 k head, 1 v head of 4; Gemma 3's offset and
 * a clip (OLMoE's clip_qkv). */
static lz_status qk_norm_fwd(lz_tensor **t) {
  return lz_qk_norm_forward(t[0], t[1], t[2], t[3], t[4], 2, 1, 1e-6f, 1.0f, 0.5f);
}
static lz_status qk_norm_bwd(lz_tensor **t) {
  return lz_qk_norm_backward(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], 2, 1, 1.0f, 0.5f);
}

/* MoE: 6 tokens, K = 2, E = 4 experts (R = 12 rows). */
static lz_status moe_route_fwd(lz_tensor **t) {
  return lz_moe_route_forward(t[0], t[1], t[2], t[3], 1);
}
static lz_status moe_route_bwd(lz_tensor **t) {
  return lz_moe_route_backward(t[0], t[1], t[2], t[3], t[4], 1);
}
static lz_status moe_sort(lz_tensor **t) { return lz_moe_sort(t[0], t[1], t[2], t[3]); }
static lz_status moe_permute_fwd(lz_tensor **t) {
  return lz_moe_permute_forward(t[0], t[1], t[2]);
}
static lz_status moe_permute_bwd(lz_tensor **t) {
  return lz_moe_permute_backward(t[0], t[1], t[2]);
}
static lz_status moe_combine_fwd(lz_tensor **t) {
  return lz_moe_combine_forward(t[0], t[1], t[2], t[3]);
}
static lz_status moe_combine_bwd(lz_tensor **t) {
  return lz_moe_combine_backward(t[0], t[1], t[2], t[3], t[4], t[5]);
}
/* The offsets come from sorting random experts first (t[0..3]). */
static lz_status moe_gemm_fwd(lz_tensor **t) {
  lz_status st = lz_moe_sort(t[0], t[1], t[2], t[3]);
  return st != LZ_OK ? st : lz_moe_gemm_forward(t[4], t[5], t[6], t[2]);
}
static lz_status moe_gemm_bwd_dx(lz_tensor **t) {
  lz_status st = lz_moe_sort(t[0], t[1], t[2], t[3]);
  return st != LZ_OK ? st : lz_moe_gemm_backward(t[4], NULL, t[5], t[6], t[7], t[2]);
}
static lz_status moe_gemm_bwd_dw(lz_tensor **t) {
  lz_status st = lz_moe_sort(t[0], t[1], t[2], t[3]);
  return st != LZ_OK ? st : lz_moe_gemm_backward(NULL, t[4], t[5], t[6], t[7], t[2]);
}

/* The host-returning ops: the value itself is compared. */
static void check_reductions(lz_dtype dt) {
  const int64_t n = 5000;
  lz_tensor *h = new_on(LZ_CPU, dt, 1, &n), *d = new_on(LZ_SIM, dt, 1, &n);
  if (!h || !d) return;
  uint64_t rng = 99;
  spec s = {dt, 1, {n}, 0, 0};
  fill_random(h, &s, &rng);
  CHECK_OK(lz_tensor_copy(d, h));
  double nh = -1, nd = -2;
  CHECK_OK(lz_sq_norm(h, &nh));
  CHECK_OK(lz_sq_norm(d, &nd));
  CHECK(memcmp(&nh, &nd, sizeof nh) == 0);
  if (dt == LZ_F32) { /* sq_norm_blocks: the second block's sum given, the first read */
    double bh[2] = {NAN, 7.0}, bd[2] = {NAN, 7.0};
    CHECK_OK(lz_sq_norm_blocks(h, bh, &nh));
    CHECK_OK(lz_sq_norm_blocks(d, bd, &nd));
    CHECK(memcmp(&nh, &nd, sizeof nh) == 0 && bh[1] != bh[1] && bd[1] != bd[1]);
  }
  int ih = -1, id = -2;
  CHECK_OK(lz_has_inf_nan(d, &id));
  CHECK_OK(lz_has_inf_nan(h, &ih));
  CHECK(ih == 0 && id == 0);
  lz_fill(h, INFINITY);
  CHECK_OK(lz_tensor_copy(d, h));
  CHECK_OK(lz_has_inf_nan(d, &id));
  CHECK_EQ_INT(id, 1);
  lz_tensor_free(h), lz_tensor_free(d);
}

LZ_TEST(sim_every_op_matches_cpu_bitwise) {
  if (!sim_up()) return;
  /* Adding an op to the enum without a case here fails this line. */
  CHECK_EQ_INT(LZ_OP_COUNT, 48);
  CHECK_OP(matmul_nt, F32(4, 6), F32(4, 5), F32(6, 5));
  CHECK_OP(matmul_nt, F32(4, 6), BF16(4, 5), BF16(6, 5));
  CHECK_OP(matmul_tn, F32(2, 4, 6), F32(2, 5, 4), F32(5, 6));
  CHECK_OP(linear_fwd, F32(2, 3, 6), F32(2, 3, 5), F32(6, 5), F32(6));
  CHECK_OP(linear_fwd, F32(2, 3, 6), BF16(2, 3, 5), BF16(6, 5), F32(6));
  CHECK_OP(linear_bwd, F32(2, 3, 5), F32(6, 5), F32(6), F32(2, 3, 6), F32(2, 3, 5), F32(6, 5));
  CHECK_OP(linear_bwd, F32(2, 3, 5), F32(6, 5), F32(6), BF16(2, 3, 6), BF16(2, 3, 5), BF16(6, 5));
  CHECK_OP(layernorm_fwd, F32(2, 3, 8), F32(6), F32(6), F32(2, 3, 8), F32(8), F32(8));
  CHECK_OP(layernorm_bwd, F32(2, 3, 8), F32(8), F32(8), F32(2, 3, 8), F32(2, 3, 8), F32(8), F32(6),
           F32P(6));
  CHECK_OP(gelu_fwd, F32(257), F32(257));
  CHECK_OP(gelu_bwd, F32(257), F32(257), F32(257));
  CHECK_OP(attention_fwd, F32(2, 4, 8), F32(2, 2, 4), F32(2, 4, 24));
  CHECK_OP(attention_bwd, F32(2, 4, 24), F32(2, 4, 8), F32(2, 4, 24), F32(2, 4, 8), F32P(2, 2, 4));
  CHECK_OP(embedding_fwd, F32(2, 3, 4), IDS(5, 2, 3), F32(5, 4), F32(3, 4));
  CHECK_OP(embedding_bwd, F32(5, 4), F32(3, 4), F32(2, 3, 4), IDS(5, 2, 3));
  CHECK_OP(cross_entropy_fwd, F32(2, 3), F32(2, 3, 8), IDS(6, 2, 3));
  CHECK_OP(cross_entropy_bwd, F32(2, 3, 8), F32(2, 3, 8), IDS(6, 2, 3));
  CHECK_OP(add, F32(1000), F32(1000), F32(1000));
  CHECK_OP(axpy, F32(1000), F32(1000));
  CHECK_OP(add_sq_norm, F32(9000), F32(9000));
  CHECK_OP(scale, F32(1000));
  CHECK_OP(scale, BF16(1000));
  CHECK_OP(scale, F16(1000));
  CHECK_OP(fill, F32(1000));
  CHECK_OP(fill, BF16(1000));
  CHECK_OP(fill, F16(1000));
  CHECK_OP(convert, BF16(300), F32(300));
  CHECK_OP(convert, F32(300), F16(300));
  CHECK_OP(adamw, F32(300), F32(300), F32(300), F32P(300), BF16(300));
  CHECK_OP(adamw, F32(300), F32(300), F32(300), F32P(300), F32(300));
  CHECK_OP(lion, F32(300), F32(300), F32(300), BF16(300));
  CHECK_OP(rmsnorm_fwd, F32(2, 3, 8), F32(6), F32(2, 3, 8), F32(8));
  CHECK_OP(rmsnorm_bwd, F32(2, 3, 8), F32(8), F32(2, 3, 8), F32(2, 3, 8), F32(8), F32P(6));
  CHECK_OP(rope_fwd, F32(2, 4, 8), F32(2, 4, 8));
  CHECK_OP(rope_bwd, F32(2, 4, 8), F32(2, 4, 8));
  CHECK_OP(swiglu_fwd, F32(100), F32(100), F32(100));
  CHECK_OP(swiglu_bwd, F32(100), F32(100), F32(100), F32(100), F32(100));
  CHECK_OP(geglu_fwd, F32(100), F32(100), F32(100));
  CHECK_OP(geglu_fwd, F32(100), BF16(100), BF16(100));
  CHECK_OP(geglu_bwd, F32(100), F32(100), F32(100), F32(100), F32(100));
  CHECK_OP(softcap_fwd, F32(257), F32(257));
  CHECK_OP(cross_entropy_softcap_bwd, F32(2, 3, 8), F32(2, 3, 8), IDS(6, 2, 3));
  CHECK_OP(cross_entropy_softcap_bwd, BF16(2, 3, 8), F32(2, 3, 8), IDS(6, 2, 3));
  /* two new positions after 0 to 4 cached ones, in caches of 6 */
  CHECK_OP(attention_decode, F32(2, 2, 8), F32(2, 2, 16), F32(2, 6, 4), F32(2, 6, 4), IDS(5, 2));
  CHECK_OP(attention_decode, F32(2, 2, 8), F32(2, 2, 16), BF16(2, 6, 4), BF16(2, 6, 4), IDS(5, 2));
  CHECK_OP(qk_norm_fwd, F32(2, 3, 16), F32(18), F32(2, 3, 16), F32(4), F32(4));
  CHECK_OP(qk_norm_bwd, F32(2, 3, 16), F32(4), F32(4), F32(2, 3, 16), F32(2, 3, 16), F32(4),
           F32(4), F32P(18));
  /* three blocks of 256, the last partial */
  CHECK_OP(adamw8bit, F32(600), F32(600), U8(600), U8(600), F32P(3), F32P(3), BF16(600));
  CHECK_OP(adamw8bit_f32, F32(300), F32(300), F32(300), F32P(300), F32(300));
  CHECK_OP(moe_route_fwd, F32(6, 2), IDS(1, 6, 2), F32(6, 4), F32(6, 4));
  CHECK_OP(moe_route_fwd, F32(6, 2), IDS(1, 6, 2), F32(6, 4), BF16(6, 4));
  CHECK_OP(moe_route_bwd, F32(6, 4), F32(6, 2), F32(6, 4), F32P(6, 4), IDS(4, 6, 2));
  CHECK_OP(moe_route_bwd, BF16(6, 4), F32(6, 2), F32(6, 4), F32P(6, 4), IDS(4, 6, 2));
  CHECK_OP(moe_sort, IDS(1, 6, 2), IDS(1, 12), IDS(1, 5), IDS(4, 6, 2));
  CHECK_OP(moe_permute_fwd, BF16(12, 8), F32(6, 8), IDS(12, 12));
  CHECK_OP(moe_permute_bwd, F32(6, 8), BF16(12, 8), PERM(6, 2));
  CHECK_OP(moe_combine_fwd, F32(6, 8), BF16(12, 8), F32(6, 2), PERM(6, 2));
  CHECK_OP(moe_combine_bwd, F32(12, 8), F32(6, 2), F32(6, 8), F32(12, 8), F32(6, 2),
           PERM(6, 2));
  CHECK_OP(moe_gemm_fwd, IDS(1, 6, 2), IDS(1, 12), IDS(1, 5), IDS(4, 6, 2), F32(12, 5),
           BF16(12, 8), BF16(4, 5, 8));
  CHECK_OP(moe_gemm_bwd_dx, IDS(1, 6, 2), IDS(1, 12), IDS(1, 5), IDS(4, 6, 2), F32(12, 8),
           F32(12, 5), F32(12, 8), F32(4, 5, 8));
  CHECK_OP(moe_gemm_bwd_dw, IDS(1, 6, 2), IDS(1, 12), IDS(1, 5), IDS(4, 6, 2), F32(4, 5, 8),
           BF16(12, 5), BF16(12, 8), BF16(4, 5, 8));
  CHECK_OP(bf16_round_stochastic, BF16(300), F32(300));
  check_reductions(LZ_F32);
  check_reductions(LZ_BF16);
  check_reductions(LZ_F16);
}

/* Tensors on two devices, or an op reading device memory on the host: errors. */
LZ_TEST(sim_mixed_devices_are_refused) {
  if (!sim_up()) return;
  lz_tensor *h = new_on(LZ_CPU, LZ_F32, 1, (int64_t[]){8}),
            *d = new_on(LZ_SIM, LZ_F32, 1, (int64_t[]){8});
  if (!h || !d) return;
  CHECK_ERR(lz_add(h, h, d), LZ_ERR_INVALID, "out lives on cpu but b lives on sim");
  lz_tensor *b = new_on(LZ_CPU, LZ_BF16, 1, (int64_t[]){8});
  CHECK_ERR(lz_tensor_copy(b, d), LZ_ERR_INVALID, "copy across devices in one dtype");
  lz_tensor_free(h), lz_tensor_free(d), lz_tensor_free(b);
}

/* ------------------------------------------------ streams, events, jitter */

/* y = ((x * 1.01 + 0.5 y) ...), 200 dependent ops, then one d2h copy. */
static void chain(lz_tensor *x, lz_tensor *y) {
  for (int i = 0; i < 100; i++) {
    lz_scale(x, 1.01f);
    lz_axpy(y, 0.5f, x);
  }
}

LZ_TEST(sim_long_chain_under_jitter_is_exact) {
  if (!sim_up()) return;
  const int64_t n = 4096;
  lz_tensor *hx = new_on(LZ_CPU, LZ_F32, 1, &n), *hy = new_on(LZ_CPU, LZ_F32, 1, &n);
  uint64_t rng = 5;
  spec s = F32(4096);
  fill_random(hx, &s, &rng), fill_random(hy, &s, &rng);
  lz_tensor *dx = new_on(LZ_SIM, LZ_F32, 1, &n), *dy = new_on(LZ_SIM, LZ_F32, 1, &n);
  lz_tensor *out = NULL;
  CHECK_OK(lz_tensor_new_pinned(&out, LZ_F32, 1, &n));
  if (!dx || !dy || !out) return;
  CHECK_OK(lz_tensor_copy(dx, hx));
  CHECK_OK(lz_tensor_copy(dy, hy));
  lz_sim_set_jitter(7, 30);
  chain(dx, dy);
  CHECK_OK(lz_tensor_copy_async(out, dy, LZ_STREAM_COMPUTE));
  CHECK_OK(lz_stream_synchronize(LZ_STREAM_COMPUTE));
  lz_sim_set_jitter(0, 0);
  chain(hx, hy);
  CHECK(memcmp(out->data, hy->data, (size_t)n * 4) == 0);
  lz_tensor_free(hx), lz_tensor_free(hy), lz_tensor_free(dx), lz_tensor_free(dy);
  lz_tensor_free(out);
}

LZ_TEST(sim_event_orders_copy_stream_before_compute) {
  if (!sim_up()) return;
  const int64_t n = 1 << 16;
  lz_tensor *src = NULL, *out = NULL;
  CHECK_OK(lz_tensor_new_pinned(&src, LZ_F32, 1, &n));
  CHECK_OK(lz_tensor_new_pinned(&out, LZ_F32, 1, &n));
  lz_tensor *d = new_on(LZ_SIM, LZ_F32, 1, &n);
  lz_event *e = NULL;
  CHECK_OK(lz_event_new(&e));
  if (!src || !out || !d || !e) return;
  lz_sim_set_jitter(11, 300);
  for (int round = 0; round < 5; round++) {
    for (int64_t i = 0; i < n; i++) ((float *)src->data)[i] = (float)(i + round);
    CHECK_OK(lz_fill(d, -1.0f));
    CHECK_OK(lz_device_synchronize());
    CHECK_OK(lz_tensor_copy_async(d, src, LZ_STREAM_COPY));
    CHECK_OK(lz_event_record(e, LZ_STREAM_COPY));
    CHECK_OK(lz_stream_wait_event(LZ_STREAM_COMPUTE, e));
    CHECK_OK(lz_scale(d, 2.0f));
    CHECK_OK(lz_tensor_copy_async(out, d, LZ_STREAM_COMPUTE));
    CHECK_OK(lz_event_synchronize(e));
    int done = 0;
    CHECK_OK(lz_event_query(e, &done));
    CHECK(done);
    CHECK_OK(lz_stream_synchronize(LZ_STREAM_COMPUTE));
    int bad = 0;
    for (int64_t i = 0; i < n; i++) bad += ((float *)out->data)[i] != 2.0f * (float)(i + round);
    CHECK_EQ_INT(bad, 0);
  }
  lz_sim_set_jitter(0, 0);
  CHECK_OK(lz_event_free(e));
  lz_tensor_free(src), lz_tensor_free(out), lz_tensor_free(d);
}

/* The jitter makes a missing wait visible: the destination of a copy just
 * queued, read (through the host view) before any sync, still holds the old
 * bytes in at least one of the tries. */
LZ_TEST(sim_jitter_shows_a_missing_wait) {
  if (!sim_up()) return;
  const int64_t n = 1024;
  lz_tensor *src = NULL, *d = new_on(LZ_SIM, LZ_F32, 1, &n);
  CHECK_OK(lz_tensor_new_pinned(&src, LZ_F32, 1, &n));
  if (!src || !d) return;
  for (int64_t i = 0; i < n; i++) ((float *)src->data)[i] = 1.0f;
  const float *view = lz_sim_host_view(d->data);
  CHECK(view != NULL);
  CHECK(lz_sim_host_view(src->data) == NULL);
  lz_sim_set_jitter(3, 200);
  int stale = 0, tries = 20;
  for (int i = 0; i < tries && view; i++) {
    CHECK_OK(lz_fill(d, 0.0f));
    CHECK_OK(lz_device_synchronize());
    CHECK_OK(lz_tensor_copy_async(d, src, LZ_STREAM_COPY));
    stale += __atomic_load_n((const uint32_t *)view, __ATOMIC_RELAXED) == 0;
    CHECK_OK(lz_stream_synchronize(LZ_STREAM_COPY));
    CHECK(view[n - 1] == 1.0f); /* after the sync: always there */
  }
  lz_sim_set_jitter(0, 0);
  printf("    %d of %d reads before the sync saw stale data\n", stale, tries);
  CHECK(stale >= 1);
  lz_tensor_free(src), lz_tensor_free(d);
}

/* ---------------------------------------------------- host access faults */

/* A child that touches device memory from the host must die of SIGSEGV. */
static int child_faults(const void *p, int how) {
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    signal(SIGSEGV, SIG_DFL); /* a sanitizer's handler would exit instead */
    char buf[64];
    if (how == 0) {
      volatile float v = *(const volatile float *)p;
      (void)v;
    } else {
      memcpy(buf, p, sizeof buf);
      __asm__ volatile("" : : "r"(buf) : "memory");
    }
    _exit(0);
  }
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid) return 0;
  return WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV;
}

LZ_TEST(sim_host_access_to_device_memory_faults) {
  if (!sim_up()) return;
  lz_tensor *d = new_on(LZ_SIM, LZ_F32, 1, (int64_t[]){64});
  if (!d) return;
  CHECK_OK(lz_fill(d, 1.0f));
  CHECK_OK(lz_device_synchronize());
  CHECK(child_faults(d->data, 0)); /* a load */
  CHECK(child_faults(d->data, 1)); /* memcpy */
  float host[64] = {0};
  CHECK(!child_faults(host, 0)); /* the check itself can say no */
  lz_tensor_free(d);
}

/* ----------------------------------------------------------- sticky error */

LZ_TEST(sim_failed_item_leaves_a_sticky_error) {
  if (!sim_up()) return;
  lz_tensor *d = new_on(LZ_SIM, LZ_F32, 1, (int64_t[]){64});
  if (!d) return;
  CHECK_OK(lz_fill(d, 1.0f));
  lz_sim_inject_failure("the kernel ran out of registers");
  CHECK_OK(lz_scale(d, 2.0f)); /* queued: the failure comes later */
  CHECK_ERR(lz_device_synchronize(), LZ_ERR_INTERNAL,
            "sim: scale on the compute stream failed: the kernel ran out of registers");
  CHECK_ERR(lz_scale(d, 2.0f), LZ_ERR_INTERNAL, "sim: scale on the compute stream failed");
  void *p = NULL;
  CHECK_ERR(lz_mem_alloc_device(&p, 64, LZ_MEM_WORKSPACE), LZ_ERR_INTERNAL, "sim: scale");
  CHECK_ERR(lz_event_new(&(lz_event *){NULL}), LZ_ERR_INTERNAL, "sim: scale");
  lz_tensor *h = new_on(LZ_CPU, LZ_F32, 1, (int64_t[]){64});
  CHECK_ERR(lz_tensor_copy(h, d), LZ_ERR_INTERNAL, "sim: scale");
  lz_sim_clear_error(); /* the tests go on in this process */
  CHECK_OK(lz_tensor_copy(h, d));
  CHECK(h && ((float *)h->data)[0] == 1.0f); /* neither scale ran */
  lz_tensor_free(h), lz_tensor_free(d);
}
