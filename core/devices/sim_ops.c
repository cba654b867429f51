/* sim_ops.c — the sim device's table: every op of the declaration
 * (mem/lz_ops.def) is queued on the compute stream (lz_sim_compute), where
 * the worker runs the cpu backend's kernel on tensors that live in the
 * device memory's alias. The public op checked the arguments already; the
 * kernel checks only what it alone can read (ids, values). */
#include "devices/sim_internal.h"

#define LZ_OP(ID, name, ...) \
  static lz_status sim_##name(const lz_op_args *a) { return lz_sim_compute(LZ_OP_##ID, a); }
#include "mem/lz_ops.def"

const lz_op_fn lz_sim_ops[LZ_OP_COUNT] = {
#define LZ_OP(ID, name, ...) [LZ_OP_##ID] = sim_##name,
#include "mem/lz_ops.def"
};

const char *lz_sim_op_name(lz_op op) {
  return (unsigned)op < LZ_OP_COUNT ? lz_op_infos[op].name : "an op";
}

lz_status lz_sim_run_op(lz_op op, const lz_op_args *a) {
  return lz_backend_cpu()->ops[op](a);
}
