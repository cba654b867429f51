-- public.lua — the public surface: what a script of one's own may call and
-- expect to keep working (docs/api.md describes each). Anything else is
-- internal and may change. tests/lua/test_public.lua holds every name here
-- to exist and to be in docs/api.md, every name the top-level package
-- exports to be public or listed in `internal`, and the examples and the
-- document's code to require public modules only.
local M = {}

-- Modules and the names in each that are public.
M.modules = {
  ["luazero"] = { "version", "tensor", "from_table", "is_tensor", "threads", "mem", "mem_peak",
                  "mem_total", "mem_total_peak", "peak_rss", "device_init", "ops", "root",
                  "arena_bytes" },
  ["luazero.comm"] = { "init", "rank", "size", "barrier", "all_reduce", "broadcast" },
  ["luazero.config"] = { "load", "unimplemented_message" },
  ["luazero.optim"] = { "schedule" },
  ["luazero.zero"] = { "initialize" },
  ["luazero.data"] = { "load", "loader", "free", "decode_bytes" },
  ["luazero.data.instruct"] = { "open_tokenizer" },
  ["luazero.nn"] = { "Module", "Linear", "LayerNorm", "RMSNorm", "Embedding", "TokenEmbedding",
                     "CausalSelfAttention", "GQA", "Rope", "MLP", "SwiGLUMLP", "Block",
                     "Sequential", "TiedHead", "LoRA", "Model", "CausalLM" },
  ["luazero.hf"] = { "config_path", "model_config", "load_into", "checksum" },
  ["luazero.generate"] = { "run" },
  ["luazero.jsonl"] = { "open" },
  ["luazero.run.text"] = { "decode" },
  ["models.registry"] = { "config", "new", "names" },
  ["models.lora"] = { "apply", "default_targets" },
}

-- Methods of the objects those calls return.
M.methods = {
  engine = { "train_batch", "forward", "backward", "step", "is_gradient_accumulation_boundary",
             "evaluate", "save", "load", "params_checksum", "describe", "set_init_path", "free" },
  loader = { "next_batch", "val_batch", "position", "set_position", "free" },
  tensor = { "numel", "sizes", "dim", "dtype_name", "get", "set", "totable", "fill", "zero",
             "copy", "view", "reshape", "to", "free" },
  module = { "extend", "init", "param", "add", "walk", "freeze", "activation", "scratch",
             "run_forward", "run_backward", "matmul_operands", "own_memory", "train",
             "evaluate" },
}

-- Names the top-level package exports that are not public: the binding's
-- own machinery, used by the modules above it.
M.internal = {
  "C", "ffi", "check", "last_error", "dtypes", "categories", "category_order", "devices",
  "Tensor", "pinned", "arena", "arena_over", "ARENA_ALIGN", "mem_device",
  "mem_device_peak", "mem_device_total_peak", "mem_reset_peak", "sim", "sim_copy_ns",
  "SQ_NORM_BLOCK",
  "device_capacity", "device_synchronize", "copy_async", "stream_synchronize", "event",
  "copy_bytes", "copy_bytes_reset", "cuda", "cpu_has", "bf16_matmul", "bf16_attention", "cpu_path",
  "executable", "xxh64",
  "hasher", "swap", "Swap", "adamw_args", "lion_args", "mkdir", "read_file",
}

return M
