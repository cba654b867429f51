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
    CHECK(lz_op_infos[op].args[0] != NULL);
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
