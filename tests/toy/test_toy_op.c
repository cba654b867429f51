/* test_toy_op.c — an op added through the declaration alone
 * (lz_ops_extra.def) and its kernel (toy_op.c), in a build of the core that
 * reads it: it is in the enum, the names, the public op list and the cpu and
 * sim tables, and it runs on the cpu and on sim through the one table. */
#include "mem/lz_backend.h"
#include "devices/lz_sim.h"
#include "lz_test.h"

#include <string.h> /* strcmp */

static lz_tensor *filled(lz_device dev, float first) {
  const int64_t n = 5;
  lz_tensor *t = NULL, *h = NULL;
  CHECK_OK(lz_tensor_new_on(&t, LZ_F32, 1, &n, LZ_MEM_WORKSPACE, dev));
  CHECK_OK(lz_tensor_new(&h, LZ_F32, 1, &n, LZ_MEM_WORKSPACE));
  if (!t || !h) return t;
  for (int i = 0; i < n; i++) ((float *)h->data)[i] = first + (float)i;
  CHECK_OK(lz_tensor_copy(t, h));
  lz_tensor_free(h);
  return t;
}

/* y = 2 x + 3 y for x = 1..5, y = 10..14: 32, 37, 42, 47, 52. */
static void check_result(const lz_tensor *y) {
  const int64_t n = 5;
  lz_tensor *h = NULL;
  CHECK_OK(lz_tensor_new(&h, LZ_F32, 1, &n, LZ_MEM_WORKSPACE));
  if (!h) return;
  CHECK_OK(lz_tensor_copy(h, y));
  for (int i = 0; i < n; i++) CHECK_NEAR(((float *)h->data)[i], 32.0f + 5.0f * (float)i, 0);
  lz_tensor_free(h);
}

LZ_TEST(toy_op_is_declared_everywhere_by_one_line) {
  CHECK_EQ_INT(LZ_OP_TOY_AXPBY, LZ_OP_COUNT - 1);
  CHECK(strcmp(lz_op_infos[LZ_OP_TOY_AXPBY].name, "toy_axpby") == 0);
  CHECK(strcmp(lz_op_infos[LZ_OP_TOY_AXPBY].args[1].name, "x") == 0);
  CHECK(lz_backend_cpu()->ops[LZ_OP_TOY_AXPBY] == lz_cpu_toy_axpby);
  CHECK(lz_sim_backend()->ops[LZ_OP_TOY_AXPBY] != NULL);
  int last = 0;
  while (lz_op_entry_name(last + 1)) last++;
  CHECK(strcmp(lz_op_entry_name(last), "toy_axpby") == 0);
}

LZ_TEST(toy_op_runs_on_cpu_and_sim) {
  lz_tensor *x = filled(LZ_CPU, 1), *y = filled(LZ_CPU, 10);
  CHECK_OK(lz_toy_axpby(y, x, 2, 3));
  check_result(y);
  CHECK_OK(lz_sim_init());
  lz_tensor *dx = filled(LZ_SIM, 1), *dy = filled(LZ_SIM, 10);
  CHECK_OK(lz_toy_axpby(dy, dx, 2, 3));
  check_result(dy);
  /* The declared argument names reach the dispatch's messages. */
  CHECK_ERR(lz_toy_axpby(y, dx, 2, 3), LZ_ERR_INVALID,
            "toy_axpby: y lives on cpu but x lives on sim");
  /* And its declared dtypes: the op checks shapes only. */
  lz_tensor *xi = NULL;
  CHECK_OK(lz_tensor_new(&xi, LZ_I32, 1, (int64_t[]){5}, LZ_MEM_WORKSPACE));
  CHECK_ERR(lz_toy_axpby(y, xi, 2, 3), LZ_ERR_INVALID,
            "toy_axpby: x is i32[5], expected dtype f32");
  lz_tensor_free(xi);
  lz_tensor_free(x), lz_tensor_free(y), lz_tensor_free(dx), lz_tensor_free(dy);
}
