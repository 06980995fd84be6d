"""The residual add inside RMSNorm on torch tensors: `fusedlayers::add_rms_norm`
(backends/torch/add_norm.cpp: schema, kernels, autograd), its fake kernels, the
functional API and `AddRMSNorm`, the unfused reference and Inductor's lowering. The math:
csrc/norm/add_norm.h and csrc/norm/norm.h (NormMode::kRms with a residual)."""

from collections.abc import Sequence

import torch

from .. import _args
from ..bench.case import Case
from . import _op
from .rms_norm import RMSNorm
from .rms_norm import _backward as _rms_backward, _eps as _rms_eps, _forward as _rms_forward
from .rms_norm import reference as _rms_reference

__all__ = ["AddRMSNorm", "add_rms_norm"]
add_rms_norm_op = _op.handle("add_rms_norm")


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, normalized_shape: int | Sequence[int],
                 weight: torch.Tensor | None = None, eps: float | None = None,
                 zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h) with h = x + residual and y = rms_norm(h, normalized_shape, weight, eps): a
    pre-norm block's residual add and the next norm in one pass (and one backward pass, where
    h's gradient from the residual stream joins the norm's).

    x: (..., *normalized_shape), float32/float64/float16/bfloat16, any layout. residual: x's
    shape, x's dtype or float32 (a float32 residual stream under half x). weight:
    normalized_shape, x's dtype or float32 (half x). eps: None means torch.finfo(x.dtype).eps.
    zero_centered: gain 1 + weight (Gemma). Returns y in x's dtype and h in residual's (h rounded
    to it before the norm, as the unfused add). Raises ValueError on shape/device/eps errors,
    TypeError on dtype errors. Math: Zhang & Sennrich 2019 (arXiv:1910.07467), csrc/norm/norm.h.
    """
    shape = _args.normalized_shape("fusedlayers.add_rms_norm", normalized_shape)
    y, h, _ = add_rms_norm_op(x, residual, shape, weight, _eps(eps, x), bool(zero_centered))
    return y, h


def _eps(eps, x):
    if eps is not None:
        return _args.real("fusedlayers.add_rms_norm", "eps", eps)
    return _rms_eps(None, x)


class AddRMSNorm(RMSNorm):
    """RMSNorm whose forward takes the block's residual: forward(x, residual) -> (y, h), h = x +
    residual, y = RMSNorm(h). Same arguments, parameter and state_dict key as RMSNorm
    (`weight`)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, h, _ = add_rms_norm_op(x, residual, self.normalized_shape, self.weight,
                                  _eps(self.eps, x), self.zero_centered)
        return y, h


def reference(x: torch.Tensor, residual: torch.Tensor, normalized_shape: int | Sequence[int],
              weight: torch.Tensor | None = None, eps: float | None = None,
              zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused computation add_rms_norm replaces: the add in residual's dtype, then the norm
    with its result in x's dtype."""
    h = x + residual  # residual's dtype: its own, or float32 promoted from half x
    return _rms_reference(h, normalized_shape, weight, eps, zero_centered).to(x.dtype), h


@_op.register_fake("add_rms_norm")
def _(x, residual, normalized_shape, weight, eps, zero_centered=False):
    _op.check_devices("add_rms_norm", "x", x, residual=residual, weight=weight)
    return (x.new_empty(x.shape), residual.new_empty(residual.shape),
            x.new_empty(x.shape[:x.dim() - len(normalized_shape)], dtype=_op.stat_dtype(x)))


@_op.register_fake("add_rms_norm_backward")
def _(dy, dh, h, rstd, normalized_shape, weight, zero_centered=False):
    _op.check_devices("add_rms_norm_backward", "dy", dy, dh=dh, h=h, weight=weight)
    return (dy.new_empty(dy.shape), _op.dresidual_like(h, dy),
            dy.new_empty(0) if weight is None else weight.new_empty(weight.shape))


# ---------------------------------------------------------------- Inductor's lowering

def _forward(x, residual, normalized_shape, weight, eps, zero_centered=False):
    h = (x.to(residual.dtype) + residual).to(residual.dtype)
    y, rstd = _rms_forward(h, normalized_shape, weight, eps, zero_centered)
    return y.to(x.dtype), h, rstd


def _backward(dy, dh, h, rstd, normalized_shape, weight, zero_centered=False):
    # the norm's dx in h's dtype, then dh added in it (csrc/norm/norm.h)
    dnorm, dweight = _rms_backward(dy.to(h.dtype), h, rstd, normalized_shape, weight,
                                    zero_centered)
    dres = dnorm if dh is None else dnorm + dh
    return dres.to(dy.dtype), _op.dresidual_of(dres, dy), dweight


DECOMPOSITIONS = {"add_rms_norm": _forward, "add_rms_norm_backward": _backward}


def bench_case(shape, dtype: torch.dtype, device: torch.device, peers: bool = False) -> Case:
    rows, cols = shape
    x, r, w = (torch.randn(*s, device=device, dtype=dtype, requires_grad=True)
               for s in ((rows, cols), (rows, cols), (cols,)))
    case = Case(lambda: add_rms_norm(x, r, cols, w, 1e-6), lambda: reference(x, r, cols, w, 1e-6),
                [x, r, w], _op.add_norm_work(x))
    if peers and device.type == "cuda":
        try:
            from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
            case.variants["liger"] = lambda: LigerFusedAddRMSNormFunction.apply(
                x, r, w, 1e-6, 0.0, "llama", True)
        except ImportError:
            pass
    return case
