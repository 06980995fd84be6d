"""FP8 quantization on TensorFlow tensors: the FusedlayersFp8Quantize op
(backends/tensorflow/fp8_quantize.cc), the same csrc kernels and bits as
fusedlayers.torch.fp8_quantize. The scaling rule and the layouts: csrc/fp8/fp8.h. Runs outside
XLA (the op has no XLA kernel)."""

from typing import NamedTuple

import numpy as np
import tensorflow as tf

from .. import _csrc_check
from . import _op

__all__ = ["Fp8Quantized", "fp8_quantize"]

FORMATS = {"e4m3": tf.dtypes.experimental.float8_e4m3fn,
           "e5m2": tf.dtypes.experimental.float8_e5m2}


class Fp8Quantized(NamedTuple):
    """x quantized: `data` (x's shape, FP8) with `scale_inv` (float32, x ~ data * scale_inv per
    block) and, where asked, x^T's: `data_t` (cols x rows) with `scale_inv_t`, else None."""
    data: tf.Tensor
    scale_inv: tf.Tensor
    data_t: tf.Tensor | None
    scale_inv_t: tf.Tensor | None


def fp8_quantize(x, scaling: str = "1x128", format: str = "e4m3", transpose: bool = False,
                 power_of_2_scales: bool = False, scaling_t: str | None = None) -> Fp8Quantized:
    """x quantized to FP8 with its scales, in one pass over x (two for tensorwise: amax, cast).

    x: [..., cols], float32/float16/bfloat16, viewed as rows x cols. scaling: "1x128", "128x128"
    or "tensorwise"; format: "e4m3" (tf float8_e4m3fn, max 448) or "e5m2" (float8_e5m2, max
    57344); transpose: also x^T quantized with its own blocks along x's rows; power_of_2_scales:
    scales rounded down to powers of two; scaling_t: x^T's scaling, None for `scaling`, or
    "128x128" with scaling "1x128". Returns Fp8Quantized with fusedlayers.torch's shapes
    (scale_inv [] tensorwise, [rows, ceil(cols/128)] 1x128, [ceil(rows/128), ceil(cols/128)]
    128x128) and bits (csrc/fp8/fp8.h; formats: Micikevicius et al. 2022, arXiv:2209.05433).
    Not differentiable. Raises InvalidArgumentError for other dtypes, an unknown scaling or
    format, a scaling_t other than those, a 0-d x, or x^T by 128x128 tiles of x whose leading
    sizes are unknown while tracing.
    """
    (x,) = _op.prepare("fp8_quantize", x=x)
    scaling_t = scaling_t or scaling
    # csrc's words, before Tq needs the format
    _op.check("fp8_quantize", x, scaling, format, scaling_t)
    q, s, q_t, s_t = _op.lib.fusedlayers_fp8_quantize(
        x, scaling=scaling, format=format, transpose=bool(transpose),
        power_of_2_scales=bool(power_of_2_scales), scaling_t=scaling_t, Tq=FORMATS[format])
    cols = x.shape[-1]
    # rows unknown while tracing (a tf.function's None batch) is read only by 128x128's x^T
    rows = int(np.prod(x.shape[:-1], dtype=np.int64)) if x.shape[:-1].is_fully_defined() else None
    if rows is None and transpose and scaling_t == "128x128":
        raise _op.invalid("fusedlayers.fp8_quantize: x^T by 128x128 tiles needs x's leading "
                          "sizes known while tracing")
    if not transpose:
        return Fp8Quantized(q, scale_view(s, scaling, rows, cols), None, None)
    return Fp8Quantized(q, scale_view(s, scaling, rows, cols), q_t,
                        scale_view(s_t, scaling_t, cols, rows))


def scale_view(storage, scaling: str, rows: int, cols: int):
    """fp8_quantize's scales from csrc's storage (_csrc_check.fp8_scale_view)."""
    return _csrc_check.fp8_scale_view(_op.clib, storage, scaling, rows, cols, tf.transpose)


def scale_storage(scale_inv, scaling: str, rows: int, cols: int):
    """csrc's storage of fp8_quantize's scales, for the GEMM op (_csrc_check.fp8_scale_storage)."""
    return _csrc_check.fp8_scale_storage(_op.clib, scale_inv, scaling, rows, cols, tf.transpose,
                                         lambda a, n: tf.pad(a, [[0, 0], [0, n]]))
