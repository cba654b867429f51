"""lz.py — ctypes binding of libluazero for the PyTorch reference tests.

Loads $LZ_LIB (default <repo>/build/lib/libluazero.so). Tensors handed to the
kernels are lz_tensor_wrap views of numpy arrays, so luazero and PyTorch read
the very same bytes. Every call checks its lz_status and raises LzError with
lz_last_error() on failure. A function the library lacks raises LzError naming
it (a kernel file not built yet) when first called, not at import.
"""
import ctypes
import os

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIB_PATH = os.environ.get("LZ_LIB") or os.path.join(REPO, "build", "lib", "libluazero.so")

# enum lz_dtype
F32, BF16, F16, I32, U16, U8 = 0, 1, 2, 3, 4, 5
_NP_OF = {F32: np.float32, BF16: np.uint16, F16: np.float16, I32: np.int32, U16: np.uint16,
          U8: np.uint8}
_LZ_OF = {np.dtype(np.float32): F32, np.dtype(np.float16): F16, np.dtype(np.int32): I32,
          np.dtype(np.uint8): U8}
UNSUPPORTED = 4  # LZ_ERR_UNSUPPORTED


class LzError(RuntimeError):
    def __init__(self, msg, status=None):
        super().__init__(msg)
        self.status = status


class Tensor(ctypes.Structure):
    """struct lz_tensor, field for field as in core/luazero.h."""
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("storage", ctypes.c_void_p),
        ("shape", ctypes.c_int64 * 4),
        ("ndim", ctypes.c_int32),
        ("dtype", ctypes.c_int),   # lz_dtype
        ("device", ctypes.c_int),  # lz_device
        ("flags", ctypes.c_int32),
    ]


class AdamwArgs(ctypes.Structure):
    """struct lz_adamw_args."""
    _fields_ = [
        ("lr", ctypes.c_float),
        ("beta1", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("weight_decay", ctypes.c_float),
        ("grad_scale", ctypes.c_float),
        ("step", ctypes.c_int64),
    ]


class LionArgs(ctypes.Structure):
    """struct lz_lion_args."""
    _fields_ = [
        ("lr", ctypes.c_float),
        ("beta1", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("weight_decay", ctypes.c_float),
        ("grad_scale", ctypes.c_float),
    ]


T = ctypes.POINTER(Tensor)
_f, _i, _i64, _d = ctypes.c_float, ctypes.c_int, ctypes.c_int64, ctypes.c_double

# name: argument types. All return lz_status (int).
_SIGS = {
    "lz_tensor_wrap": [ctypes.POINTER(T), ctypes.c_void_p, _i, _i, ctypes.POINTER(_i64)],
    "lz_tensor_free": [T],
    "lz_threads_set": [_i],
    "lz_matmul": [T, T, T, _i, _i, _f, _f],
    "lz_linear_forward": [T, T, T, T],
    "lz_linear_backward": [T, T, T, T, T, T],
    "lz_layernorm_forward": [T, T, T, T, T, T, _f],
    "lz_layernorm_backward": [T, T, T, T, T, T, T, T],
    "lz_gelu_forward": [T, T],
    "lz_gelu_backward": [T, T, T],
    "lz_rmsnorm_forward": [T, T, T, T, _f],
    "lz_rmsnorm_backward": [T, T, T, T, T, T],
    "lz_rope_forward": [T, T, _i, _i, _i64, _f],
    "lz_rope_backward": [T, T, _i, _i, _i64, _f],
    "lz_rope_freqs_forward": [T, T, T, _i, _i64],
    "lz_rope_freqs_backward": [T, T, T, _i, _i64],
    "lz_swiglu_forward": [T, T, T],
    "lz_swiglu_backward": [T, T, T, T, T],
    "lz_attention_forward": [T, T, T, _i],
    "lz_attention_backward": [T, T, T, T, T, _i],
    "lz_attention_gqa_forward": [T, T, T, _i, _i],
    "lz_attention_gqa_backward": [T, T, T, T, T, _i, _i],
    "lz_attention_opts_forward": [T, T, T, T, _i, _i, _i, _f, _f],
    "lz_attention_opts_backward": [T, T, T, T, T, T, _i, _i, _i, _f, _f],
    "lz_attention_bf16_forward": [T, T, T, T, _i, _i, _i, _f, _f],
    "lz_attention_bf16_backward": [T, T, T, T, T, T, _i, _i, _i, _f, _f],
    "lz_embedding_forward": [T, T, T, T],
    "lz_embedding_backward": [T, T, T, T],
    "lz_cross_entropy_forward": [T, T, T, _i64],
    "lz_cross_entropy_backward": [T, T, T, _i64, _f],
    "lz_add": [T, T, T],
    "lz_axpy": [T, _f, T],
    "lz_scale": [T, _f],
    "lz_fill": [T, _f],
    "lz_sq_norm": [T, ctypes.POINTER(_d)],
    "lz_adamw_step": [T, T, T, T, T, ctypes.POINTER(AdamwArgs)],
    "lz_lion_step": [T, T, T, T, ctypes.POINTER(LionArgs)],
    "lz_adamw8bit_step": [T, T, T, T, T, T, T, ctypes.POINTER(AdamwArgs)],
}

try:
    lib = ctypes.CDLL(LIB_PATH)
except OSError as e:
    raise SystemExit(f"lz.py: cannot load {LIB_PATH}: {e}\n"
                     "build it first (tools/setup) or point LZ_LIB at libluazero.so")

lib.lz_last_error.restype = ctypes.c_char_p
lib.lz_last_error.argtypes = []
lib.lz_cpu_has.restype = ctypes.c_int
lib.lz_cpu_has.argtypes = [ctypes.c_char_p]
lib.lz_f32_to_bf16.restype = ctypes.c_uint16
lib.lz_f32_to_bf16.argtypes = [ctypes.c_float]


def cpu_has(feature):
    return lib.lz_cpu_has(feature.encode()) != 0


def _fn(name):
    try:
        f = getattr(lib, name)
    except AttributeError:
        raise LzError(f"{os.path.basename(LIB_PATH)} has no {name} (its kernel is not built "
                      f"into {LIB_PATH})")
    if f.argtypes is None:
        f.argtypes = _SIGS[name]
        f.restype = ctypes.c_int
    return f


def call(name, *args):
    """Calls lz_<name>, raising LzError with lz_last_error() on a bad status."""
    st = _fn(name)(*args)
    if st != 0:
        raise LzError(f"{name} returned status {st}: {lib.lz_last_error().decode()}", st)


class Wrapped:
    """An lz_tensor borrowing a numpy array (kept alive here)."""

    def __init__(self, arr, dtype=None):
        if not arr.flags["C_CONTIGUOUS"]:
            raise ValueError("lz.wrap needs a C-contiguous array")
        self.arr = arr
        dt = dtype if dtype is not None else _LZ_OF[arr.dtype]
        if arr.dtype != np.dtype(_NP_OF[dt]):
            raise ValueError(f"numpy dtype {arr.dtype} does not hold lz dtype {dt}")
        shape = (ctypes.c_int64 * max(arr.ndim, 1))(*arr.shape)
        self.ptr = T()
        call("lz_tensor_wrap", ctypes.byref(self.ptr), arr.ctypes.data, dt, arr.ndim, shape)

    def __del__(self):
        if getattr(self, "ptr", None):
            lib.lz_tensor_free(self.ptr)
            self.ptr = None


_live = []  # Wrapped objects of the current test; release() frees them


def wrap(arr, dtype=None):
    """lz_tensor* over arr (None -> NULL); alive until release()."""
    if arr is None:
        return None
    w = Wrapped(arr, dtype)
    _live.append(w)
    return w.ptr


def release():
    _live.clear()


def bf16_round(x):
    """float32 array -> (uint16 bf16 bits, float32 values they hold), round to nearest even."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return bits, (bits.astype(np.uint32) << 16).view(np.float32)

