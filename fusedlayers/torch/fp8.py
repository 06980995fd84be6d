"""FP8 quantization on torch tensors: `fusedlayers::fp8_quantize` (backends/torch/fp8_quantize.cpp),
its fake kernel, the functional API and the unfused float64 reference. The scaling rule and the
layouts: csrc/fp8/fp8.h."""

from typing import NamedTuple

import numpy as np
import torch
import torch.utils.weak

from . import _op

__all__ = ["Fp8Quantized", "fp8_quantize"]
fp8_quantize_op = _op.handle("fp8_quantize")

SCALINGS = ("tensorwise", "1x128", "128x128")
FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
BLOCK = 128


class Fp8Quantized(NamedTuple):
    """x quantized: `data` (x's shape, FP8) with `scale_inv` (float32, x ~ data * scale_inv
    per block) and, where asked, x^T's: `data_t` (cols x rows) with `scale_inv_t`, else None."""
    data: torch.Tensor
    scale_inv: torch.Tensor
    data_t: torch.Tensor | None
    scale_inv_t: torch.Tensor | None


def fp8_quantize(x: torch.Tensor, scaling: str = "1x128", format: str = "e4m3",
                 transpose: bool = False, power_of_2_scales: bool = False,
                 scaling_t: str | None = None) -> Fp8Quantized:
    """x quantized to FP8 with its scales, in one pass over x (two for tensorwise: amax, cast).

    x: [..., cols], float32/float16/bfloat16, any layout (copied to contiguous where it is not),
    viewed as rows x cols. scaling: "1x128" (one scale per 128 values of a row, as DeepSeek-V3's
    activations and gradients), "128x128" (per tile, as its weights) or "tensorwise".
    format: "e4m3" (torch.float8_e4m3fn, max 448) or "e5m2" (torch.float8_e5m2, max 57344).
    transpose: also x^T (cols x rows) quantized with its own blocks along x's rows (what a
    weight gradient's GEMM reads), from the same read of x. power_of_2_scales: scales rounded
    to powers of two (exact dequantization). scaling_t: x^T's scaling, None (default) for
    `scaling`, or "128x128" with scaling "1x128": x^T by the 128x128 tiles' scales (the bits
    of fp8_quantize(x, "128x128", transpose=True)'s data_t) while x keeps its 1x128 blocks.

    Returns Fp8Quantized: data [..., cols]; scale_inv float32 of shape [] (tensorwise),
    [rows, ceil(cols/128)] (1x128, column-major) or [ceil(rows/128), ceil(cols/128)] (128x128,
    rows stored padded to 4 floats): the layouts cuBLASLt's (and `torch._scaled_mm`'s)
    blockwise GEMMs read; data_t [cols, rows] and scale_inv_t (x^T's, of the same forms for
    scaling_t) with transpose.

    Per block: s = fmt_max / amax in float32 (1 for an all-zero block), data = x * s rounded once
    to nearest even and saturated at fmt_max, scale_inv = 1 / s; a block holding NaN or Inf gets
    NaN values and a NaN scale (csrc/fp8/fp8.h). Formats: Micikevicius et al. 2022,
    arXiv:2209.05433. Raises TypeError for other dtypes, ValueError for an unknown scaling or
    format, a scaling_t other than those, or a 0-d x.
    """
    return Fp8Quantized(*fp8_quantize_op(x, scaling, format, transpose, power_of_2_scales,
                                         scaling_t))


def check_names(op: str, scaling: str, format: str, scaling_t: str | None = None) -> None:
    """The scaling and format names every FP8 op takes, checked as csrc does (for fake kernels)."""
    if format not in FORMATS:
        raise ValueError(f"fusedlayers.{op}: format must be 'e4m3' or 'e5m2', got {format!r}")
    for name, s in (("scaling", scaling), ("scaling_t", scaling_t or scaling)):
        if s not in SCALINGS:
            raise ValueError(f"fusedlayers.{op}: {name} must be 'tensorwise', '1x128' or "
                             f"'128x128', got {s!r}")
    if scaling_t not in (None, scaling) and (scaling, scaling_t) != ("1x128", "128x128"):
        raise ValueError(f"fusedlayers.{op}: scaling_t must be scaling ({scaling!r}), or "
                         f"'128x128' with scaling '1x128', got {scaling_t!r}")


def fake_outputs(like: torch.Tensor, shape, scaling: str, format: str, transpose: bool,
                 scaling_t: str | None = None):
    """The (data, scale_inv, data_t, scale_inv_t) a quantization of values of `shape` returns,
    as empty tensors on like's device (the fake kernels' outputs)."""
    cols = shape[-1]
    rows = int(np.prod(shape[:-1], dtype=np.int64)) if cols else 0
    data = like.new_empty(shape, dtype=FORMATS[format])

    def scales(scaling, rows, cols):
        if scaling == "tensorwise":
            return like.new_empty((), dtype=torch.float32)
        if scaling == "1x128":
            return like.new_empty((-(-cols // BLOCK), rows), dtype=torch.float32).t()
        blocks = -(-cols // BLOCK)
        return like.new_empty((-(-rows // BLOCK), -(-blocks // 4) * 4),
                              dtype=torch.float32)[:, :blocks]
    if not transpose:
        return data, scales(scaling, rows, cols), None, None
    return data, scales(scaling, rows, cols), like.new_empty((cols, rows), dtype=FORMATS[format]), \
        scales(scaling_t or scaling, cols, rows)


@_op.register_fake("fp8_quantize")
def _(x, scaling="1x128", format="e4m3", transpose=False, power_of_2_scales=False,
      scaling_t=None):
    check_names("fp8_quantize", scaling, format, scaling_t)
    return fake_outputs(x, tuple(x.shape), scaling, format, transpose, scaling_t)


def round_to_fp8(v: np.ndarray, format: str) -> np.ndarray:
    """float64 values rounded once to the format's nearest (ties to even), saturated at its
    max; NaN stays NaN. The float64 reference of the kernels' cast."""
    mantissa, min_exp, fmt_max = {"e4m3": (3, -6, 448.0), "e5m2": (2, -14, 57344.0)}[format]
    v = np.asarray(v, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        exp = np.frexp(np.where(np.isfinite(v), v, 0.0))[1] - 1  # floor(log2 |v|), exactly
    exp = np.maximum(exp, min_exp)
    step = np.exp2(exp - mantissa)  # the grid's spacing at |v| (subnormals: the smallest)
    out = np.round(v / step) * step  # exact division by a power of two; np.round: ties to even
    return np.where(np.isnan(v), np.nan, np.clip(out, -fmt_max, fmt_max))


def reference(x: torch.Tensor, scaling: str = "1x128", format: str = "e4m3",
              transpose: bool = False, power_of_2_scales: bool = False,
              scaling_t: str | None = None):
    """The unfused computation in float64 (numpy) of fp8_quantize's values: (values, scale_inv,
    values_t, scale_inv_t), the values as float64 FP8 numbers (not yet dequantized), the
    scales in the op's shapes. s = fmt_max / amax is rounded to float32 as the kernels do."""
    fmt_max = {"e4m3": 448.0, "e5m2": 57344.0}[format]
    x2 = x.detach().reshape(-1, x.shape[-1]).double().cpu().numpy() if x.shape[-1] else \
        np.zeros((0, 0))

    def blocks(a, scaling):  # (rows, cols) -> per-value multiplier and the block scales
        rows, cols = a.shape
        if scaling == "tensorwise":
            groups = [(slice(None), slice(None))]
        elif scaling == "1x128":
            groups = [(slice(r, r + 1), slice(c, c + BLOCK))
                      for c in range(0, cols, BLOCK) for r in range(rows)]
        else:
            groups = [(slice(r, r + BLOCK), slice(c, c + BLOCK))
                      for r in range(0, rows, BLOCK) for c in range(0, cols, BLOCK)]
        s = np.empty_like(a)
        scale_inv = []
        for g in groups:
            s[g] = mult = _multiplier(a[g], fmt_max, power_of_2_scales)
            scale_inv.append(np.float32(1) / mult)
        scale_inv = np.array(scale_inv, dtype=np.float32)
        if scaling == "tensorwise":
            scale_inv = scale_inv.reshape(()) if a.size else np.float32(1).reshape(())
        elif scaling == "1x128":
            scale_inv = scale_inv.reshape(-(-cols // BLOCK), rows).T
        else:
            scale_inv = scale_inv.reshape(-(-rows // BLOCK), -(-cols // BLOCK))
        return round_to_fp8(a * s, format), scale_inv

    values, scale_inv = blocks(x2, scaling)
    if not transpose:
        return values.reshape(x.shape), scale_inv, None, None
    values_t, scale_inv_t = blocks(np.ascontiguousarray(x2.T), scaling_t or scaling)
    return values.reshape(x.shape), scale_inv, values_t, scale_inv_t


def _multiplier(block: np.ndarray, fmt_max: float, power_of_2: bool) -> np.float32:
    if block.size == 0:
        return np.float32(1)
    with np.errstate(invalid="ignore"):
        amax = np.float32(np.nan if np.isnan(block).any() else np.abs(block).max())
    if amax == 0:
        return np.float32(1)
    if not np.isfinite(amax):
        return np.float32(np.nan)
    with np.errstate(over="ignore"):
        s = np.float32(fmt_max) / amax  # float32 division, as the kernels
    s = min(s, np.finfo(np.float32).max)
    return np.float32(2.0 ** np.floor(np.log2(s))) if power_of_2 else np.float32(s)


# ---------------------------------------------------------------- one quantization per tensor
# The FP8 quantizations of the tensors FP8 layers read, keyed by the tensor object itself (the
# same object wherever one module's output feeds several layers: attention's q, k and v
# projections) and checked against its version counter (an in-place change invalidates it). An
# entry lives as long as its tensor. Eager only: under torch.compile every layer quantizes its
# own input and the compiler's CSE merges what repeats; so do inference tensors (inference_mode),
# which keep no version counter, tensor subclasses (fake, distributed), whose identity or
# version may not be their data's, and CUDA graph captures: a graph replays the kernels it
# captured, not this record, so an entry made before the capture (the warm-up's) would stand in
# for the quantization each replay must run on the static input's new values.
_QUANTIZED = torch.utils.weak.WeakIdKeyDictionary()


class _Entry(NamedTuple):
    version: int
    key: tuple  # (scaling, format, power_of_2_scales, scaling_t)
    quantized: Fp8Quantized


def quantize_input(x: torch.Tensor, scaling: str, format: str, transpose: bool,
                   power_of_2_scales: bool, scaling_t: str | None = None) -> Fp8Quantized:
    """fp8_quantize(x.reshape(-1, cols), ...) read from the record of x where one matches (same
    version, scalings, format and scales, x^T present where asked), else computed and recorded:
    layers reading one tensor quantize it once and save one x^T for their weight gradients."""
    cols = x.shape[-1]
    if torch.compiler.is_compiling() or type(x) is not torch.Tensor or x.is_inference() or \
            (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return fp8_quantize(x.reshape(-1, cols), scaling, format, transpose, power_of_2_scales,
                            scaling_t)
    entry = _QUANTIZED.get(x)
    key = (scaling, format, power_of_2_scales, scaling_t or scaling)
    if entry is None or entry.version != x._version or entry.key != key or \
            (transpose and entry.quantized.data_t is None):
        entry = _Entry(x._version, key,
                       fp8_quantize(x, scaling, format, transpose, power_of_2_scales, scaling_t))
        _QUANTIZED[x] = entry
    q = entry.quantized
    return Fp8Quantized(q.data.reshape(-1, cols), q.scale_inv, q.data_t if transpose else None,
                        q.scale_inv_t if transpose else None)
