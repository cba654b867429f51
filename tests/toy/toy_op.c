/* toy_op.c — the toy op's public function (checks, then the op table) and
 * its cpu kernel: all an op needs besides its line in the declaration (the
 * sim device runs the cpu kernel; this build has no cuda). */
#include "mem/lz_backend.h"
#include "mem/lz_internal.h"

lz_status lz_toy_axpby(lz_tensor *y, const lz_tensor *x, float alpha, float beta) {
  const char *op = "toy_axpby";
  LZ_TRY(lz_check_same_shape(op, "x", x, "y", y)); /* dtypes: the declaration's */
  LZ_OP_RUN(op, LZ_OP_TOY_AXPBY, .t = {y, (lz_tensor *)x}, .f = {alpha, beta});
}

lz_status lz_cpu_toy_axpby(const lz_op_args *a) {
  float *y = a->t[0]->data;
  const float *x = a->t[1]->data;
  for (int64_t i = 0; i < lz_tensor_numel(a->t[0]); i++) y[i] = a->f[0] * x[i] + a->f[1] * y[i];
  return LZ_OK;
}
