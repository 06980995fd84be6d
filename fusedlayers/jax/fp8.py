"""FP8 quantization on JAX arrays: the custom call fusedlayers_fp8_quantize
(backends/xla/fp8_quantize_ffi.cc), the same csrc kernels and bits as fusedlayers.torch.fp8_quantize.
The scaling rule and the layouts: csrc/fp8/fp8.h. A whole op (_op.plain_call): under a sharded jit
XLA hands it whole arrays (a block's scale depends on all of it)."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import _csrc_check
from . import _op

__all__ = ["Fp8Quantized", "fp8_quantize"]

FORMATS = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
_FORMAT_NAMES = {jnp.dtype(t): name for name, t in FORMATS.items()}


class Fp8Quantized(NamedTuple):
    """x quantized: `data` (x's shape, FP8) with `scale_inv` (float32, x ~ data * scale_inv per
    block) and, where asked, x^T's: `data_t` (cols x rows) with `scale_inv_t`, else None. A
    pytree (jit, grad and vmap carry it)."""
    data: jax.Array
    scale_inv: jax.Array
    data_t: jax.Array | None
    scale_inv_t: jax.Array | None


def format_name(dtype) -> str:
    """"e4m3" or "e5m2" for an FP8 dtype; TypeError naming it otherwise."""
    name = _FORMAT_NAMES.get(jnp.dtype(dtype))
    if name is None:
        raise TypeError(f"fusedlayers.fp8_gemm: operands must be float8_e4m3fn or float8_e5m2, "
                        f"got {jnp.dtype(dtype)}")
    return name


def fp8_quantize(x, scaling: str = "1x128", format: str = "e4m3", transpose: bool = False,
                 power_of_2_scales: bool = False, scaling_t: str | None = None) -> Fp8Quantized:
    """x quantized to FP8 with its scales, in one pass over x (two for tensorwise: amax, cast).

    x: [..., cols], float32/float16/bfloat16, viewed as rows x cols. scaling: "1x128" (one scale
    per 128 values of a row, as DeepSeek-V3's activations and gradients), "128x128" (per tile, as
    its weights) or "tensorwise". format: "e4m3" (jnp.float8_e4m3fn, max 448) or "e5m2"
    (jnp.float8_e5m2, max 57344). transpose: also x^T (cols x rows) quantized with its own
    blocks along x's rows (what a weight gradient's GEMM reads), from the same read of x.
    power_of_2_scales: scales rounded down to powers of two (exact dequantization). scaling_t:
    x^T's scaling, None (default) for `scaling`, or "128x128" with scaling "1x128" (x^T by the
    tiles' scales, x by its 1x128 blocks).

    Returns Fp8Quantized: data [..., cols]; scale_inv float32 of shape [] (tensorwise),
    [rows, ceil(cols/128)] (1x128) or [ceil(rows/128), ceil(cols/128)] (128x128); data_t
    [cols, rows] and scale_inv_t (x^T's, of the same forms for scaling_t) with transpose. The values and scales
    are fusedlayers.torch.fp8_quantize's, bit for bit: per block s = fmt_max / amax in float32 (1
    for an all-zero block), data = x * s rounded once to nearest even and saturated at fmt_max,
    scale_inv = 1 / s; a block holding NaN or Inf gets NaN values and a NaN scale
    (csrc/fp8/fp8.h; formats: Micikevicius et al. 2022, arXiv:2209.05433). Not differentiable.
    While tracing, raises TypeError for other dtypes and ValueError for an unknown scaling or
    format, a scaling_t other than those, or a 0-d x.
    """
    x = jnp.asarray(x)
    if x.dtype not in (jnp.float32, jnp.float16, jnp.bfloat16):
        raise TypeError(f"fusedlayers.fp8_quantize: x must be float32, float16 or bfloat16, got "
                        f"{x.dtype}")
    x, = _op.prepare("fp8_quantize", x=x)
    scaling_t = scaling_t or scaling
    _op.check("fp8_quantize", x, scaling, format, scaling_t)
    cols = x.shape[-1]
    rows = int(np.prod(x.shape[:-1], dtype=np.int64)) if cols else 0
    fp8 = FORMATS[format]

    def storage(scaling, transposed):
        dim0, _, ld = _csrc_check.fp8_scale_sizes(_op.lib, scaling, rows, cols, transposed)
        return () if scaling == "tensorwise" else (dim0, ld)
    results = (jax.ShapeDtypeStruct(x.shape, fp8),
               jax.ShapeDtypeStruct(storage(scaling, False), jnp.float32),
               jax.ShapeDtypeStruct((cols, rows) if transpose else (0,), fp8),
               jax.ShapeDtypeStruct(storage(scaling_t, True) if transpose else (0,), jnp.float32),
               jax.ShapeDtypeStruct((1 if scaling == "tensorwise" else 0,), jnp.float32))
    q, s, q_t, s_t, _ = _op.plain_call("fp8_quantize", results, x, scaling=scaling,
                                       format=format, transpose=np.bool_(transpose),
                                       power_of_2_scales=np.bool_(power_of_2_scales),
                                       scaling_t=scaling_t)
    if not transpose:
        return Fp8Quantized(q, scale_view(s, scaling, rows, cols), None, None)
    return Fp8Quantized(q, scale_view(s, scaling, rows, cols), q_t,
                        scale_view(s_t, scaling_t, cols, rows))


def scale_view(storage, scaling: str, rows: int, cols: int):
    """fp8_quantize's scales from csrc's storage (_csrc_check.fp8_scale_view)."""
    return _csrc_check.fp8_scale_view(_op.lib, storage, scaling, rows, cols, jnp.transpose)


def scale_storage(scale_inv, scaling: str, rows: int, cols: int):
    """csrc's storage of fp8_quantize's scales, for the GEMM op (_csrc_check.fp8_scale_storage)."""
    return _csrc_check.fp8_scale_storage(_op.lib, scale_inv, scaling, rows, cols, jnp.transpose,
                                         lambda a, n: jnp.pad(a, ((0, 0), (0, n))))
