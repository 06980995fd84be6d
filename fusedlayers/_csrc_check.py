"""csrc's argument checks for static shapes, dtypes and attributes, called through the C symbols
fusedlayers_xla_<op>_check (backends/xla/<op>.cc) of a loaded library, and csrc's rows per chunk
of linear_cross_entropy: the JAX library, and the
TensorFlow op library, which compiles the same XLA sources. A framework's ops call `run` while
tracing, so csrc words the error before anything runs. Imports no framework."""

import ctypes

import numpy as np


class _TracedTensor(ctypes.Structure):
    """backends/xla/ffi_binding.h's TracedTensor: a tensor's dtype and dims, without data."""
    _fields_ = [("dtype", ctypes.c_int32), ("defined", ctypes.c_int32), ("ndim", ctypes.c_int64),
                ("dims", ctypes.POINTER(ctypes.c_int64))]


def _c_argument(value, csrc_dtype) -> list:
    """A check's argument as ctypes values: a tensor (anything with shape and dtype, or None for
    an absent one) as a TracedTensor pointer, a shape as its dims and their count, a bool, an
    int (int64), a float32 (np.float32, as the handlers' float attributes) or float64
    (np.float64), a str."""
    if isinstance(value, (bool, np.bool_)):
        return [ctypes.c_bool(bool(value))]
    if isinstance(value, np.float32):
        return [ctypes.c_float(value)]
    if isinstance(value, np.float64):
        return [ctypes.c_double(value)]
    if isinstance(value, (int, np.integer)):
        return [ctypes.c_int64(int(value))]
    if isinstance(value, str):
        return [ctypes.c_char_p(value.encode())]
    if isinstance(value, (tuple, list, np.ndarray)):
        dims = (ctypes.c_int64 * max(len(value), 1))(*value)
        return [dims, ctypes.c_int64(len(value))]
    if value is None or hasattr(value, "dtype") and hasattr(value, "shape"):
        shape = () if value is None else tuple(value.shape)
        dims = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        dtype = 0 if value is None else csrc_dtype(value.dtype)
        return [ctypes.pointer(_TracedTensor(dtype, value is not None, len(shape), dims))]
    raise TypeError(f"fusedlayers: no C form for a check argument of type {type(value).__name__}")


def static(*arguments) -> bool:
    """Whether every size among the arguments (shapes, and tensors' shapes) is a concrete int."""
    return all(isinstance(d, (int, np.integer)) for a in arguments
               for d in (a if isinstance(a, (tuple, list)) else getattr(a, "shape", ())))


def run(lib, op: str, csrc_dtype, *arguments) -> tuple[int, str]:
    """(kind, message) of fusedlayers_xla_<op>_check on the arguments, in its order: kind 0 when
    they pass, 1 for a value error, 2 for a dtype error (csrc's Error::Kind). csrc_dtype maps a
    tensor's dtype to csrc's DType enum."""
    c_arguments = [c for a in arguments for c in _c_argument(a, csrc_dtype)]
    message = ctypes.create_string_buffer(1024)
    kind = getattr(lib, f"fusedlayers_xla_{op}_check")(*c_arguments, message, len(message))
    return kind, message.value.decode()


def chunk_rows(lib, n: int, h: int, v: int) -> int:
    """csrc's rows per chunk of linear_cross_entropy for n rows, h features and v words
    (fusedlayers_xla_linear_cross_entropy_chunk_rows, int64 in and out)."""
    fn = lib.fusedlayers_xla_linear_cross_entropy_chunk_rows
    fn.restype, fn.argtypes = ctypes.c_int64, [ctypes.c_int64] * 3
    return int(fn(n, h, v))


def grouped_gemm_hopper(lib, rows: int, k: int, n: int, groups: int, dtype: int,
                        arch: int) -> bool:
    """Whether CUDA runs grouped_gemm of x (rows, k), y (rows, n) and `groups` weights of csrc
    DType `dtype` on its Hopper kernels on a GPU of compute capability `arch` (major * 10 +
    minor): csrc's rule (fusedlayers_xla_grouped_gemm_path)."""
    fn = lib.fusedlayers_xla_grouped_gemm_path
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_int] * 2
    return fn(rows, k, n, groups, dtype, arch) == 0


def grouped_gemm_workspace_size(lib, rows: int, k: int, n: int, groups: int, dtype: int) -> int:
    """grouped_gemm's CUDA workspace bytes for those operands on the current GPU (0 without
    CUDA kernels): fusedlayers_xla_grouped_gemm_workspace_size."""
    fn = lib.fusedlayers_xla_grouped_gemm_workspace_size
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_int]
    return int(fn(rows, k, n, groups, dtype))


def fp8_scale_sizes(lib, scaling: str, rows: int, cols: int, transposed: bool) -> tuple:
    """csrc's scale_inv storage (dim0, dim1, ld) for `scaling` of rows x cols values, or of
    their transpose (fusedlayers_xla_fp8_scale_sizes: fp8_scale_sizes of csrc/fp8/fp8.h)."""
    fn = lib.fusedlayers_xla_fp8_scale_sizes
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_bool,
                   ctypes.POINTER(ctypes.c_int64)]
    out = (ctypes.c_int64 * 3)()
    if fn(scaling.encode(), rows, cols, transposed, out):
        raise ValueError(f"fusedlayers: no FP8 scaling {scaling!r}")
    return tuple(out)


def fp8_gemm_workspace_size(lib) -> int:
    """The bytes of fp8_gemm's workspace result: cuBLASLt's on CUDA, 0 in builds without CUDA."""
    fn = lib.fusedlayers_xla_fp8_gemm_workspace_size
    fn.restype, fn.argtypes = ctypes.c_size_t, []
    return int(fn())


def fp8_scale_view(lib, storage, scaling: str, rows: int, cols: int, transpose):
    """The scales of rows x cols values as fp8_quantize returns them (torch's shapes), from
    csrc's storage in any framework's arrays (`transpose`: its 2-D transpose): 1x128's [blocks,
    rows] transposed, 128x128's padded rows cut to their tiles."""
    if scaling == "1x128":
        return transpose(storage)
    if scaling == "128x128":
        return storage[:, :fp8_scale_sizes(lib, scaling, rows, cols, False)[1]]
    return storage


def fp8_scale_storage(lib, scale_inv, scaling: str, rows: int, cols: int, transpose, pad):
    """fp8_scale_view's inverse, for the GEMM ops: csrc's storage of rows x cols values' scales
    (`pad(a, n)`: a with n zero columns appended; 128x128's row padding is never read). Scales
    of another shape pass as they are, for csrc's check to refuse."""
    if len(scale_inv.shape) == 2 and scaling == "1x128":
        return transpose(scale_inv)
    if len(scale_inv.shape) == 2 and scaling == "128x128":
        _, dim1, ld = fp8_scale_sizes(lib, scaling, rows, cols, False)
        if scale_inv.shape[1] == dim1:
            return pad(scale_inv, ld - dim1)
    return scale_inv
