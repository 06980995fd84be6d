"""FP8 norms on torch tensors: `fp8_rms_norm` and `fp8_layer_norm` (with an optional residual
add), whose forward (`fusedlayers::fp8_norm_forward`, backends/torch/fp8_norm.cpp) writes the
norm's output and, in the same pass, that output quantized to FP8: the operand of the FP8
linear layers the norm feeds. Their rule (csrc/fp8/fp8_norm.h): the FP8 values and scales are
fp8_quantize of the returned y, bit for bit. `produce` is how fuse()'s norms hand their FP8
output to those layers (fusedlayers.torch.fp8's record of quantized tensors)."""

import torch

from . import _op
from .fp8 import Fp8Quantized, check_names, fake_outputs, remember

__all__ = ["fp8_layer_norm", "fp8_rms_norm"]
forward_op = _op.handle("fp8_norm_forward")


class _Fp8Norm(torch.autograd.Function):
    """(y, h, q, scale_inv, q_t, scale_inv_t); y and h differentiable, on the add+norm backward
    ops (h = x where there is no residual: the plain norm's gradient)."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, normalized_shape, eps, rms, zero_centered,
                scaling, format, transpose, power_of_2_scales):
        y, h, mean, rstd, *q = forward_op(x, residual, normalized_shape, weight, bias, eps, rms,
                                          zero_centered, scaling, format, transpose,
                                          power_of_2_scales)
        ctx.save_for_backward(x if residual is None else h, mean, rstd, weight, bias)
        ctx.set_materialize_grads(False)
        ctx.normalized_shape, ctx.rms, ctx.zero_centered = normalized_shape, rms, zero_centered
        ctx.add, ctx.x_dtype = residual is not None, x.dtype
        ctx.mark_non_differentiable(*[t for t in q if t is not None])
        return (y, h if residual is not None else None, *q)

    @staticmethod
    def backward(ctx, dy, dh, *_):
        h, mean, rstd, weight, bias = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros(h.shape, dtype=ctx.x_dtype, device=h.device)
        ns = ctx.normalized_shape
        if ctx.rms:
            dx, dres, dw = torch.ops.fusedlayers.add_rms_norm_backward(
                dy, dh, h, rstd, ns, weight, ctx.zero_centered)
            db = None
        else:
            dx, dres, dw, db = torch.ops.fusedlayers.add_layer_norm_backward(
                dy, dh, h, mean, rstd, ns, weight, bias)
        # an empty dresidual: h has x's dtype and dx is the gradient of both
        dresidual = (dres if dres.numel() else dx) if ctx.add else None
        return (dx, dresidual, dw if weight is not None else None,
                db if bias is not None else None, *([None] * 8))


def _norm(rms: bool, x, normalized_shape, weight, bias, eps, residual, zero_centered, scaling,
          format, transpose, power_of_2_scales):
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else \
        tuple(int(s) for s in normalized_shape)
    y, h, *q = _Fp8Norm.apply(x, residual, weight, bias, shape, float(eps), rms,
                              bool(zero_centered), scaling, format, bool(transpose),
                              bool(power_of_2_scales))
    return y, h, Fp8Quantized(*q)


def fp8_rms_norm(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
                 eps: float = 1e-6, residual: torch.Tensor | None = None,
                 zero_centered: bool = False, scaling: str = "1x128", format: str = "e4m3",
                 transpose: bool = False, power_of_2_scales: bool = False):
    """RMSNorm (or add+RMSNorm) whose output also comes quantized to FP8 from the same pass:
    `y = rms_norm(x)` (with a residual: `h = x + residual`, `y = rms_norm(h)`, as add_rms_norm)
    and `fp8_quantize(y, scaling, format, transpose, power_of_2_scales)`, bit for bit.

    x: (..., *normalized_shape), float32, float16 or bfloat16; weight, eps, zero_centered as
    rms_norm's; residual: x's shape, x's dtype or float32. scaling: "1x128" or "tensorwise";
    format, transpose, power_of_2_scales: as fp8_quantize's. On CUDA, bfloat16/float16 rows of
    a multiple of 128 up to 8192 columns with 1x128 scaling run in one pass over x on sm_90
    (csrc/fp8/fp8_norm.h); elsewhere the norm, then the quantization.
    Returns (y, h, quantized): y of x's shape and dtype, differentiable; h (residual's dtype,
    differentiable) or None without a residual; quantized an Fp8Quantized of y as
    fp8_quantize returns it (no gradient). Raises TypeError for float64 or other dtypes,
    ValueError for shapes, eps, a 128x128 scaling or unknown names. Zhang & Sennrich 2019,
    arXiv:1910.07467; FP8: Micikevicius et al. 2022, arXiv:2209.05433.
    """
    return _norm(True, x, normalized_shape, weight, None, eps, residual, zero_centered, scaling,
                 format, transpose, power_of_2_scales)


def fp8_layer_norm(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, eps: float = 1e-5,
                   residual: torch.Tensor | None = None, scaling: str = "1x128",
                   format: str = "e4m3", transpose: bool = False,
                   power_of_2_scales: bool = False):
    """LayerNorm (or add+LayerNorm) whose output also comes quantized to FP8 from the same pass;
    arguments, result and errors as fp8_rms_norm's, with bias as layer_norm's. Ba, Kiros &
    Hinton 2016, arXiv:1607.06450."""
    return _norm(False, x, normalized_shape, weight, bias, eps, residual, False, scaling, format,
                 transpose, power_of_2_scales)


def produce(norm, rms: bool, x: torch.Tensor, residual: torch.Tensor | None, eps: float):
    """(y, h) of fuse()'s norm module `norm` (an RMSNorm where rms, else a LayerNorm) on x (+ residual), with y's
    FP8 quantization recorded for the FP8 layers that read y (fusedlayers.torch.fp8), where
    norm.fp8 holds their recipe; None where the module's own path applies: no recipe, a norm
    whose previous FP8 output no layer read (it stops writing one), autocast (whose norms run
    in float32 on CUDA), torch.compile (which fuses the quantization itself), memory_efficient
    LayerNorm."""
    recipe = getattr(norm, "fp8", None)
    if recipe is None or torch.compiler.is_compiling() or \
            getattr(norm, "memory_efficient", False) or \
            torch.is_autocast_enabled(x.device.type) and x.dtype != torch.float32:
        return None
    reads = getattr(norm, "_fp8_reads", None)
    if reads is not None and reads[0] == 0:
        norm.fp8 = None  # its output feeds no FP8 layer
        return None
    scaling, pow2 = recipe.input_scaling, recipe.power_of_2_scales
    transpose = "wgrad" in recipe.gemms
    y, h, q = _norm(rms, x, norm.normalized_shape, norm.weight, getattr(norm, "bias", None), eps,
                    residual, getattr(norm, "zero_centered", False), scaling, "e4m3", transpose,
                    pow2)
    norm._fp8_reads = remember(y, q, scaling, "e4m3", pow2)
    return y, h


@_op.register_fake("fp8_norm_forward")
def _(x, residual, normalized_shape, weight, bias, eps, rms, zero_centered=False,
      scaling="1x128", format="e4m3", transpose=False, power_of_2_scales=False):
    op = "fp8_rms_norm" if rms else "fp8_layer_norm"
    _op.check_devices(op, "x", x, residual=residual, weight=weight, bias=bias)
    check_names(op, scaling, format)
    if scaling == "128x128":
        raise ValueError(f"fusedlayers.{op}: scaling must be '1x128' or 'tensorwise' (128x128 "
                         "tiles are for weights)")
    stats = x.shape[:x.dim() - len(normalized_shape)]
    h = None if residual is None else residual.new_empty(residual.shape)
    mean = None if rms else x.new_empty(stats, dtype=_op.stat_dtype(x))
    return (x.new_empty(x.shape), h, mean, x.new_empty(stats, dtype=_op.stat_dtype(x)),
            *fake_outputs(x, tuple(x.shape), scaling, format, transpose))
