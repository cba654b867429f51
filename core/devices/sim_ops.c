/* sim_ops.c — what the sim device runs for each op: the public cpu
 * function, on tensors that live in the device memory's alias (it checks
 * its arguments again and runs the cpu kernel), and the op's name for
 * messages. */
#include "devices/sim_internal.h"
#include "mem/lz_internal.h"

#include <assert.h> /* an op without a case */

static const char *op_names[LZ_OP_COUNT] = {
    [LZ_OP_MATMUL] = "matmul",
    [LZ_OP_LINEAR_FORWARD] = "linear_forward",
    [LZ_OP_LINEAR_BACKWARD] = "linear_backward",
    [LZ_OP_LAYERNORM_FORWARD] = "layernorm_forward",
    [LZ_OP_LAYERNORM_BACKWARD] = "layernorm_backward",
    [LZ_OP_GELU_FORWARD] = "gelu_forward",
    [LZ_OP_GELU_BACKWARD] = "gelu_backward",
    [LZ_OP_ATTENTION_FORWARD] = "attention_forward",
    [LZ_OP_ATTENTION_BACKWARD] = "attention_backward",
    [LZ_OP_EMBEDDING_FORWARD] = "embedding_forward",
    [LZ_OP_EMBEDDING_BACKWARD] = "embedding_backward",
    [LZ_OP_CROSS_ENTROPY_FORWARD] = "cross_entropy_forward",
    [LZ_OP_CROSS_ENTROPY_BACKWARD] = "cross_entropy_backward",
    [LZ_OP_ADD] = "add",
    [LZ_OP_AXPY] = "axpy",
    [LZ_OP_SCALE] = "scale",
    [LZ_OP_FILL] = "fill",
    [LZ_OP_SQ_NORM] = "sq_norm",
    [LZ_OP_HAS_INF_NAN] = "has_inf_nan",
    [LZ_OP_ADAMW_STEP] = "adamw_step",
    [LZ_OP_CONVERT] = "tensor_copy",
    [LZ_OP_LION_STEP] = "lion_step",
    [LZ_OP_RMSNORM_FORWARD] = "rmsnorm_forward",
    [LZ_OP_RMSNORM_BACKWARD] = "rmsnorm_backward",
    [LZ_OP_ROPE_FORWARD] = "rope_forward",
    [LZ_OP_ROPE_BACKWARD] = "rope_backward",
    [LZ_OP_SWIGLU_FORWARD] = "swiglu_forward",
    [LZ_OP_SWIGLU_BACKWARD] = "swiglu_backward",
};

const char *lz_sim_op_name(lz_op op) {
  return (unsigned)op < LZ_OP_COUNT && op_names[op] ? op_names[op] : "an op";
}

/* The public cpu function of op on the item's shadow tensors. */
lz_status lz_sim_run_op(lz_op op, const lz_op_args *a) {
  lz_tensor *const *t = a->t;
  switch (op) {
    case LZ_OP_MATMUL:
      return lz_matmul(t[0], t[1], t[2], (int)a->i[0], (int)a->i[1], a->f[0], a->f[1]);
    case LZ_OP_LINEAR_FORWARD:
      return lz_linear_forward(t[0], t[1], t[2], t[3]);
    case LZ_OP_LINEAR_BACKWARD:
      return lz_linear_backward(t[0], t[1], t[2], t[3], t[4], t[5]);
    case LZ_OP_LAYERNORM_FORWARD:
      return lz_layernorm_forward(t[0], t[1], t[2], t[3], t[4], t[5], a->f[0]);
    case LZ_OP_LAYERNORM_BACKWARD:
      return lz_layernorm_backward(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7]);
    case LZ_OP_GELU_FORWARD:
      return lz_gelu_forward(t[0], t[1]);
    case LZ_OP_GELU_BACKWARD:
      return lz_gelu_backward(t[0], t[1], t[2]);
    case LZ_OP_ATTENTION_FORWARD: /* i[1]: n_kv_head, 0 for n_head */
      return lz_attention_seg_forward(t[0], t[1], t[2], t[3], (int)a->i[0],
                                      (int)(a->i[1] ? a->i[1] : a->i[0]));
    case LZ_OP_ATTENTION_BACKWARD:
      return lz_attention_seg_backward(t[0], t[1], t[2], t[3], t[4], t[5], (int)a->i[0],
                                       (int)(a->i[1] ? a->i[1] : a->i[0]));
    case LZ_OP_EMBEDDING_FORWARD:
      return lz_embedding_pos_forward(t[0], t[1], t[4], t[2], t[3]);
    case LZ_OP_EMBEDDING_BACKWARD:
      return lz_embedding_pos_backward(t[0], t[1], t[2], t[3], t[4]);
    case LZ_OP_CROSS_ENTROPY_FORWARD:
      return lz_cross_entropy_forward(t[0], t[1], t[2], a->i[0]);
    case LZ_OP_CROSS_ENTROPY_BACKWARD:
      return lz_cross_entropy_backward(t[0], t[1], t[2], a->i[0], a->f[0]);
    case LZ_OP_ADD:
      return lz_add(t[0], t[1], t[2]);
    case LZ_OP_AXPY:
      return lz_axpy(t[0], a->f[0], t[1]);
    case LZ_OP_SCALE:
      return lz_scale(t[0], a->f[0]);
    case LZ_OP_FILL:
      return lz_fill(t[0], a->f[0]);
    case LZ_OP_SQ_NORM:
      return lz_sq_norm(t[0], a->out_f64);
    case LZ_OP_HAS_INF_NAN:
      return lz_has_inf_nan(t[0], a->out_int);
    case LZ_OP_ADAMW_STEP:
      return lz_adamw_step(t[0], t[1], t[2], t[3], t[4], a->adamw);
    case LZ_OP_CONVERT:
      return lz_tensor_copy(t[0], t[1]);
    case LZ_OP_LION_STEP:
      return lz_lion_step(t[0], t[1], t[2], t[3], a->lion);
    case LZ_OP_RMSNORM_FORWARD:
      return lz_rmsnorm_forward(t[0], t[1], t[2], t[3], a->f[0]);
    case LZ_OP_RMSNORM_BACKWARD:
      return lz_rmsnorm_backward(t[0], t[1], t[2], t[3], t[4], t[5]);
    case LZ_OP_ROPE_FORWARD:
      if (t[3]) return lz_rope_pos_forward(t[0], t[1], t[2], t[3], (int)a->i[0]);
      if (t[2]) return lz_rope_freqs_forward(t[0], t[1], t[2], (int)a->i[0], a->i[2]);
      return lz_rope_forward(t[0], t[1], (int)a->i[0], (int)a->i[1], a->i[2], a->f[0]);
    case LZ_OP_ROPE_BACKWARD:
      if (t[3]) return lz_rope_pos_backward(t[0], t[1], t[2], t[3], (int)a->i[0]);
      if (t[2]) return lz_rope_freqs_backward(t[0], t[1], t[2], (int)a->i[0], a->i[2]);
      return lz_rope_backward(t[0], t[1], (int)a->i[0], (int)a->i[1], a->i[2], a->f[0]);
    case LZ_OP_SWIGLU_FORWARD:
      return lz_swiglu_forward(t[0], t[1], t[2]);
    case LZ_OP_SWIGLU_BACKWARD:
      return lz_swiglu_backward(t[0], t[1], t[2], t[3], t[4]);
    case LZ_OP_COUNT:
      break;
  }
  assert(!"sim: an op without a case");
  return LZ_ERR_INTERNAL;
}
