/* cpu.c — the cpu backend: the table of host kernels (lz_cpu_<name>, in
 * core/kernels/ and core/optim/), one per op of the declaration
 * (mem/lz_ops.def), set into the backend slot when the library loads. An op
 * declared without its cpu kernel does not link. The sim device runs these
 * same kernels on its streams. */
#include "mem/lz_backend.h"

static const lz_op_fn cpu_ops[LZ_OP_COUNT] = {
#define LZ_OP(ID, name, ...) [LZ_OP_##ID] = lz_cpu_##name,
#include "mem/lz_ops.def"
};

static const lz_backend cpu_backend = {
    .abi = LZ_BACKEND_ABI,
    .name = "cpu",
    .kind = LZ_CPU,
    .ops = cpu_ops,
};

/* Before any call into the library: a public op may run at once. */
__attribute__((constructor)) static void cpu_backend_register(void) {
  lz_backend_cpu_set(&cpu_backend);
}
