/* test_ops.c — the ops' one declaration (core/mem/lz_ops.def): every op
 * declared has a name, argument names, a cpu and a sim kernel, and a place
 * in the list Lua binds; a public op runs its checks once and then the
 * kernel the table of its tensors' device holds — for the cpu and for sim,
 * which runs the cpu backend's kernel on its stream, not the public op. */
#include "mem/lz_backend.h"
#include "devices/lz_sim.h"
#include "lz_test.h"

#include <string.h> /* strcmp */

/* The public names the declaration lists, in its order: each op's, then
 * its aliases (what lz_op_entry_name must return). */
static const char *const declared[] = {
#define LZ_OP(ID, name, ...) #name,
#define LZ_OP_ALIAS(name, ID) #name,
#include "mem/lz_ops.def"
};
enum { N_DECLARED = sizeof declared / sizeof declared[0] };

/* Each alias names an op of the declaration: LZ_OP_<ID> must exist. */
static const lz_op alias_ops[] = {
#define LZ_OP_ALIAS(name, ID) LZ_OP_##ID,
#include "mem/lz_ops.def"
    LZ_OP_COUNT,
};

LZ_TEST(ops_every_declared_op_has_its_names_and_a_cpu_and_sim_kernel) {
  const lz_backend *cpu = lz_backend_cpu(), *sim = lz_sim_backend();
  CHECK(cpu != NULL && cpu->kind == LZ_CPU && sim != NULL);
  if (!cpu || !sim) return;
  for (int op = 0; op < LZ_OP_COUNT; op++) {
    CHECK(lz_op_infos[op].name != NULL);
    CHECK(lz_op_infos[op].args[0].name != NULL);
    CHECK(cpu->ops[op] != NULL);
    CHECK(sim->ops[op] != NULL);
  }
  for (size_t i = 0; alias_ops[i] != LZ_OP_COUNT; i++) CHECK(alias_ops[i] < LZ_OP_COUNT);
}

LZ_TEST(ops_entry_names_are_the_declaration_in_order) {
  int n = 0;
  for (const char *name; (name = lz_op_entry_name(n)) != NULL; n++) {
    CHECK(n < N_DECLARED);
    if (n >= N_DECLARED) return;
    CHECK(strcmp(name, declared[n]) == 0);
    for (int j = 0; j < n; j++) CHECK(strcmp(name, lz_op_entry_name(j)) != 0);
  }
  CHECK_EQ_INT(n, N_DECLARED);
  CHECK(lz_op_entry_name(-1) == NULL);
  /* Every op is its own public function, first among its names. */
  for (int op = 0; op < LZ_OP_COUNT; op++) {
    int found = 0;
    for (int i = 0; i < n; i++) found += strcmp(lz_op_entry_name(i), lz_op_infos[op].name) == 0;
    CHECK_EQ_INT(found, 1);
  }
}

/* A cpu backend whose gelu_forward kernel counts its calls and what they
 * were given, else the real kernels: the public op reaches the kernel only
 * through the table. */
static lz_op_fn counting_ops[LZ_OP_COUNT];
static const lz_backend *real_cpu;
static int gelu_calls;
static const lz_tensor *gelu_out_seen;

static lz_status counting_gelu(const lz_op_args *a) {
  __atomic_add_fetch(&gelu_calls, 1, __ATOMIC_SEQ_CST);
  gelu_out_seen = a->t[0];
  return real_cpu->ops[LZ_OP_GELU_FORWARD](a);
}

static lz_tensor *f32(lz_device dev, int64_t n, float v) {
  lz_tensor *t = NULL, *h = NULL;
  CHECK_OK(lz_tensor_new_on(&t, LZ_F32, 1, &n, LZ_MEM_WORKSPACE, dev));
  CHECK_OK(lz_tensor_new(&h, LZ_F32, 1, &n, LZ_MEM_WORKSPACE));
  if (!t || !h) return t;
  CHECK_OK(lz_fill(h, v));
  CHECK_OK(lz_tensor_copy(t, h));
  lz_tensor_free(h);
  return t;
}

LZ_TEST(ops_public_op_checks_once_then_runs_the_devices_kernel) {
  real_cpu = lz_backend_cpu();
  lz_backend counting = *real_cpu;
  for (int op = 0; op < LZ_OP_COUNT; op++) counting_ops[op] = real_cpu->ops[op];
  counting_ops[LZ_OP_GELU_FORWARD] = counting_gelu;
  counting.ops = counting_ops;
  lz_backend_cpu_set(&counting);

  lz_tensor *x = f32(LZ_CPU, 8, 1.0f), *y = f32(LZ_CPU, 8, 0.0f), *short_y = f32(LZ_CPU, 7, 0);
  gelu_calls = 0;
  CHECK_OK(lz_gelu_forward(y, x));
  CHECK_EQ_INT(gelu_calls, 1);
  CHECK(gelu_out_seen == y); /* on the cpu: the caller's tensors themselves */
  CHECK_NEAR(((float *)y->data)[3], 0.841192f, 1e-5);
  /* A call the checks refuse never reaches a kernel. */
  CHECK_ERR(lz_gelu_forward(short_y, x), LZ_ERR_INVALID, "gelu_forward: out is f32[7]");
  CHECK_EQ_INT(gelu_calls, 1);
  /* Nor does one whose dtypes the declaration refuses (gelu_forward checks
   * shapes only; lz_op_run reads x's dtypes from mem/lz_ops.def). */
  lz_tensor *xi = NULL;
  CHECK_OK(lz_tensor_new(&xi, LZ_I32, 1, (int64_t[]){8}, LZ_MEM_WORKSPACE));
  CHECK_ERR(lz_gelu_forward(y, xi), LZ_ERR_INVALID,
            "gelu_forward: x is i32[8], expected dtype f32");
  CHECK_EQ_INT(gelu_calls, 1);
  lz_tensor_free(xi);

  /* Sim queues the op and its worker runs the cpu backend's kernel, once,
   * on its own copy of the tensor headers (in the device memory's alias). */
  if (!lz_cuda_ready() && lz_sim_init() == LZ_OK) {
    lz_tensor *dx = f32(LZ_SIM, 8, 1.0f), *dy = f32(LZ_SIM, 8, 0.0f), *h = f32(LZ_CPU, 8, 0);
    gelu_calls = 0;
    CHECK_OK(lz_gelu_forward(dy, dx));
    CHECK_OK(lz_device_synchronize());
    CHECK_EQ_INT(gelu_calls, 1);
    CHECK(gelu_out_seen != dy);
    CHECK_OK(lz_tensor_copy(h, dy));
    CHECK_NEAR(((float *)h->data)[5], 0.841192f, 1e-5);
    lz_tensor_free(dx), lz_tensor_free(dy), lz_tensor_free(h);
  }
  lz_backend_cpu_set(real_cpu);
  lz_tensor_free(x), lz_tensor_free(y), lz_tensor_free(short_y);
}

/* Every tensor argument declares the dtypes it takes: a mask, or SAME(i)
 * naming another declared slot that has a mask of its own. */
LZ_TEST(ops_every_argument_declares_its_dtypes) {
  for (int op = 0; op < LZ_OP_COUNT; op++) {
    const lz_op_arg *args = lz_op_infos[op].args;
    int n = 0;
    while (n < LZ_OP_MAX_TENSORS && args[n].name) n++;
    for (int i = 0; i < n; i++) {
      const lz_op_dtypes d = args[i].dtypes;
      CHECK(d != 0);
      if (!(d & LZ_DT_SAME)) continue;
      const int r = d & 0xff;
      CHECK(r < n && r != i);
      if (r < n) CHECK(!(args[r].dtypes & LZ_DT_SAME) && args[r].dtypes != 0);
    }
  }
}

static lz_tensor *of(lz_dtype dt, int64_t n) {
  lz_tensor *t = NULL;
  CHECK_OK(lz_tensor_new(&t, dt, 1, &n, LZ_MEM_WORKSPACE));
  return t;
}

/* The one dtype check and its three refusals, worded from the declaration. */
LZ_TEST(ops_dtype_check_words_what_the_declaration_takes) {
  lz_tensor *f = of(LZ_F32, 4), *b = of(LZ_BF16, 4), *h = of(LZ_F16, 4), *i = of(LZ_I32, 4);
  lz_tensor *c = of(LZ_F32, 16);
  CHECK_OK(lz_op_check_dtypes("scale", LZ_OP_SCALE, &(lz_op_args){.t = {h}}));
  CHECK_ERR(lz_op_check_dtypes("scale", LZ_OP_SCALE, &(lz_op_args){.t = {i}}), LZ_ERR_INVALID,
            "scale: t is i32[4], expected dtype f32, bf16 or f16");
  /* matmul: c f32; a f32 or bf16; b as a. */
  CHECK_OK(lz_op_check_dtypes("matmul", LZ_OP_MATMUL, &(lz_op_args){.t = {c, b, b}}));
  CHECK_ERR(lz_op_check_dtypes("matmul", LZ_OP_MATMUL, &(lz_op_args){.t = {c, b, f}}),
            LZ_ERR_INVALID, "matmul: a is bf16[4] and b is f32[4]; both must be f32 or both bf16");
  CHECK_ERR(lz_op_check_dtypes("matmul", LZ_OP_MATMUL, &(lz_op_args){.t = {c, i, i}}),
            LZ_ERR_INVALID, "matmul: a is i32[4], expected dtype f32 or bf16");
  CHECK_ERR(lz_op_check_dtypes("matmul", LZ_OP_MATMUL, &(lz_op_args){.t = {b, f, f}}),
            LZ_ERR_INVALID, "matmul: c is bf16[4], expected dtype f32");
  /* A slot that follows another's dtype names that one's own refusal
   * first: rmsnorm_backward's dy (slot 2) follows x (slot 3). */
  CHECK_ERR(lz_op_check_dtypes("rmsnorm_backward", LZ_OP_RMSNORM_BACKWARD,
                               &(lz_op_args){.t = {f, f, i, h, f, f}}),
            LZ_ERR_INVALID, "rmsnorm_backward: x is f16[4], expected dtype f32 or bf16");
  /* NULL slots are the public op's to allow: nothing to check. */
  CHECK_OK(lz_op_check_dtypes("linear_forward", LZ_OP_LINEAR_FORWARD,
                              &(lz_op_args){.t = {c, f, f, NULL}}));
  lz_tensor *ts[] = {f, b, h, i, c};
  for (size_t k = 0; k < sizeof ts / sizeof ts[0]; k++) lz_tensor_free(ts[k]);
}
