/* ops.c — what the op declaration (mem/lz_ops.def) says, as tables: each
 * op's name, argument names and whether it hands a value back, and the list
 * of public ops Lua binds. */
#include "mem/lz_backend.h"

const lz_op_info lz_op_infos[LZ_OP_COUNT] = {
#define LZ_OP(ID, name, waits_, ...) [LZ_OP_##ID] = {#name, {__VA_ARGS__}, waits_},
#include "mem/lz_ops.def"
};

/* sizeof(&lz_<name>): an entry whose lz_<name> core/luazero.h does not
 * declare fails to compile (without calling up into the kernels). */
static const char *const entries[] = {
#define LZ_OP(ID, name, ...) sizeof(&lz_##name) ? #name : 0,
#define LZ_OP_ALIAS(name, ID) sizeof(&lz_##name) ? #name : 0,
#include "mem/lz_ops.def"
};

const char *lz_op_entry_name(int i) {
  return i >= 0 && i < (int)(sizeof entries / sizeof entries[0]) ? entries[i] : 0;
}
