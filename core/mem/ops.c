/* ops.c — what the op declaration (mem/lz_ops.def) says, as tables: each
 * op's name, argument names and dtypes and whether it hands a value back,
 * the list of public ops Lua binds, and the one dtype check every op runs
 * through (lz_op_check_dtypes). */
#include "mem/lz_backend.h"
#include "mem/lz_internal.h"

#include <stdio.h> /* snprintf */

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

static int accepts(lz_op_dtypes mask, lz_dtype dt) {
  return (unsigned)dt < LZ_DTYPE_COUNT && (mask >> dt & 1u);
}

/* mask's dtypes in words, "f32, bf16 or f16"; each after the first behind
 * `each` ("both " words a pair that must agree). */
static const char *dtype_words(lz_op_dtypes mask, const char *each, char *buf, size_t size) {
  int n = 0, seen = 0;
  for (int d = 0; d < LZ_DTYPE_COUNT; d++) n += accepts(mask, (lz_dtype)d);
  size_t at = 0;
  buf[0] = 0;
  for (int d = 0; d < LZ_DTYPE_COUNT && at < size; d++) {
    if (!accepts(mask, (lz_dtype)d)) continue;
    const char *sep = seen == 0 ? "" : seen == n - 1 ? " or " : ", ";
    at += (size_t)snprintf(buf + at, size - at, "%s%s%s", sep, seen ? each : "",
                           lz_dtype_name((lz_dtype)d));
    seen++;
  }
  return buf;
}

static lz_status refuse(const char *op_name, const lz_op_arg *arg, const lz_tensor *t) {
  char b[96], w[64];
  return lz_fail(LZ_ERR_INVALID, "%s: %s is %s, expected dtype %s", op_name, arg->name,
                 lz_tensor_describe(t, b, sizeof b), dtype_words(arg->dtypes, "", w, sizeof w));
}

lz_status lz_op_check_dtypes(const char *op_name, lz_op op, const lz_op_args *a) {
  const lz_op_arg *args = lz_op_infos[op].args;
  for (int i = 0; i < LZ_OP_MAX_TENSORS; i++) {
    const lz_tensor *t = a->t[i];
    const lz_op_dtypes want = args[i].dtypes;
    if (!t || !args[i].name) continue;
    if (!(want & LZ_DT_SAME)) {
      if (!accepts(want, t->dtype)) return refuse(op_name, &args[i], t);
      continue;
    }
    const int r = want & 0xff;
    const lz_tensor *ref = a->t[r];
    if (!ref || ref->dtype == t->dtype) continue; /* ref's own slot checks it */
    if (!accepts(args[r].dtypes, ref->dtype)) return refuse(op_name, &args[r], ref);
    char br[96], bt[96], w[64];
    return lz_fail(LZ_ERR_INVALID, "%s: %s is %s and %s is %s; both must be %s", op_name,
                   args[r].name, lz_tensor_describe(ref, br, sizeof br), args[i].name,
                   lz_tensor_describe(t, bt, sizeof bt),
                   dtype_words(args[r].dtypes, "both ", w, sizeof w));
  }
  return LZ_OK;
}
