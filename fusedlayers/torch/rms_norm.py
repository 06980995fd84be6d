"""RMSNorm on torch tensors: `fusedlayers::rms_norm` (backends/torch/rms_norm.cpp: schema,
kernels, autograd, autocast), its fake kernels, the functional API and `RMSNorm`, drop-in for
`torch.nn.RMSNorm`, the unfused reference and Inductor's lowering. The math: csrc/norm/norm.h
(NormMode::kRms)."""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .. import _args
from ..bench.case import Case, memory_work
from . import _op

__all__ = ["RMSNorm", "rms_norm"]
rms_norm_op = _op.handle("rms_norm")


def _eps(eps: float | None, x: torch.Tensor) -> float:
    """torch's eps=None: the machine epsilon of x's dtype (any value for a non-float x: the op
    rejects its dtype)."""
    if eps is not None:
        return _args.real("fusedlayers.rms_norm", "eps", eps)
    floating = isinstance(x, torch.Tensor) and x.is_floating_point()
    return torch.finfo(x.dtype).eps if floating else 0.0


def rms_norm(x: torch.Tensor, normalized_shape: int | Sequence[int],
             weight: torch.Tensor | None = None, eps: float | None = None,
             zero_centered: bool = False) -> torch.Tensor:
    """Root mean square normalization over the trailing `normalized_shape` dims of x, replacing
    `torch.nn.functional.rms_norm` (Zhang & Sennrich 2019, arXiv:1910.07467):
    y = x / sqrt(mean(x^2) + eps) * weight, or * (1 + weight) with zero_centered (Gemma's gain).

    x: (..., *normalized_shape), float32/float64/float16/bfloat16, any layout. weight:
    normalized_shape, x's dtype or float32 (for half x). eps: None means torch.finfo(x.dtype).eps,
    as torch's. Statistics in float32 (float64 for float64). Returns x's shape and dtype. Raises
    ValueError on shape/device/eps errors, TypeError on dtype errors or arguments of the wrong
    type.
    """
    shape = _args.normalized_shape("fusedlayers.rms_norm", normalized_shape)
    return rms_norm_op(x, shape, weight, _eps(eps, x), bool(zero_centered))[0]


class RMSNorm(nn.Module):
    """Drop-in for `torch.nn.RMSNorm`: same arguments, defaults, parameter and state_dict key
    (`weight`, ones, of normalized_shape). zero_centered=True (not in torch) applies the gain as
    1 + weight and initialises weight to zeros, as Gemma's RMSNorm.

    Input (..., *normalized_shape) -> output of the same shape and dtype.
    """

    def __init__(self, normalized_shape: int | Sequence[int], eps: float | None = None,
                 elementwise_affine: bool = True, device=None, dtype=None, *,
                 zero_centered: bool = False):
        super().__init__()
        self.normalized_shape = _args.normalized_shape("RMSNorm", normalized_shape)
        self.eps = None if eps is None else _args.real("RMSNorm", "eps", eps)
        self.elementwise_affine = elementwise_affine
        self.zero_centered = bool(zero_centered)
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, device=device,
                                                   dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            (nn.init.zeros_ if self.zero_centered else nn.init.ones_)(self.weight)

    @classmethod
    def from_rms_norm(cls, module: nn.Module, zero_centered: bool = False) -> "RMSNorm":
        """An RMSNorm sharing the Parameter of `module` (a torch.nn.RMSNorm, or a Llama-style
        RMSNorm with `weight` and `variance_epsilon` or `eps`), not copying it."""
        weight = getattr(module, "weight", None)
        eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
        shape = getattr(module, "normalized_shape", None) or tuple(weight.shape)
        fused = cls(shape, eps=eps, elementwise_affine=False, zero_centered=zero_centered)
        fused.elementwise_affine = weight is not None
        fused.weight = weight
        return fused

    @classmethod
    def fuse_candidates(cls, module: nn.Module) -> tuple[list["RMSNorm"], bool]:
        """fuse()'s rule: the RMSNorms that may replace `module`, sharing its Parameter, and
        whether the first is certain (module is a torch.nn.RMSNorm) or each must match module on
        a probe (a Llama-style look-alike: no children, one 1-D `weight`, a float `eps` or
        `variance_epsilon`, whose gain is weight or, as Gemma's, 1 + weight)."""
        if isinstance(module, nn.RMSNorm):
            return [cls.from_rms_norm(module)], True
        # a LayerNorm without bias has the same Parameters
        from .layer_norm import LayerNorm
        if isinstance(module, (nn.LayerNorm, LayerNorm, RMSNorm)) or list(module.children()):
            return [], False
        params = dict(module.named_parameters(recurse=False))
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if list(params) != ["weight"] or params["weight"].dim() != 1 or not isinstance(eps, float):
            return [], False
        return [cls.from_rms_norm(module, zero_centered=zc) for zc in (False, True)], False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_op(x, self.normalized_shape, self.weight, _eps(self.eps, x),
                           self.zero_centered)[0]

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}"
                + (", zero_centered=True" if self.zero_centered else ""))


def reference(x: torch.Tensor, normalized_shape: int | Sequence[int],
              weight: torch.Tensor | None = None, eps: float | None = None,
              zero_centered: bool = False) -> torch.Tensor:
    """The unfused computation rms_norm replaces."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    gain = weight + 1 if weight is not None and zero_centered else weight
    return F.rms_norm(x, shape, gain, eps)


FUSED_MODULE = RMSNorm  # fuse() swaps modules by RMSNorm.fuse_candidates


@_op.register_fake("rms_norm")
def _(x, normalized_shape, weight, eps, zero_centered=False):
    _op.check_devices("rms_norm", "x", x, weight=weight)
    return (x.new_empty(x.shape),
            x.new_empty(x.shape[:x.dim() - len(normalized_shape)], dtype=_op.stat_dtype(x)))


@_op.register_fake("rms_norm_backward")
def _(dy, x, rstd, normalized_shape, weight, zero_centered=False):
    _op.check_devices("rms_norm_backward", "x", x, dy=dy, weight=weight)
    return (x.new_empty(x.shape),
            x.new_empty(0) if weight is None else weight.new_empty(weight.shape))


# ---------------------------------------------------------------- Inductor's lowering

def _forward(x, normalized_shape, weight, eps, zero_centered=False):
    # csrc/norm/norm.h, NormMode::kRms: rstd in float32 (float64 for float64), the gain 1 + weight
    # with zero_centered (1 where weight is absent), added in that type.
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    xf = x.to(_op.stat_dtype(x))
    rstd = torch.rsqrt(xf.square().mean(dims, keepdim=True) + eps)
    y = xf * rstd
    if weight is not None:
        y = y * (weight.to(xf.dtype) + 1 if zero_centered else weight)
    return y.to(x.dtype), rstd.reshape(x.shape[:dims[0]])


def _backward(dy, x, rstd, normalized_shape, weight, zero_centered=False):
    # With g = dy * gain and x_hat = x * rstd: dx = rstd * (g - x_hat * mean(g * x_hat)),
    # dweight = sum over rows of dy * x_hat (csrc/norm/norm.h).
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    acc = _op.stat_dtype(x)
    dy, xf = dy.to(acc), x.to(acc)
    rstd = rstd.reshape(*rstd.shape, *([1] * len(dims)))
    x_hat = xf * rstd
    g = dy
    if weight is not None:
        g = dy * (weight.to(acc) + 1 if zero_centered else weight)
    dx = rstd * (g - x_hat * (g * x_hat).mean(dims, keepdim=True))
    dweight = (x.new_empty(0) if weight is None
               else (dy * x_hat).sum(list(range(dims[0]))).to(weight.dtype))
    return dx.to(x.dtype), dweight


DECOMPOSITIONS = {"rms_norm": _forward, "rms_norm_backward": _backward}


def bench_case(shape, dtype: torch.dtype, device: torch.device, peers: bool = False) -> Case:
    rows, cols = shape
    x, w = (torch.randn(*s, device=device, dtype=dtype, requires_grad=True)
            for s in ((rows, cols), (cols,)))
    fused = lambda w: rms_norm(x, cols, w, 1e-6)  # noqa: E731
    case = Case(lambda: fused(w), lambda: reference(x, cols, w, 1e-6), [x, w],
                memory_work(x.numel() * x.element_size(), x.numel() * x.element_size()))
    if dtype in (torch.float16, torch.bfloat16):  # mixed precision's float32 parameters
        w32 = w.detach().float().requires_grad_()
        case.variants["fused-w32"] = (lambda: fused(w32), [w32])
        # unfused, as mixed precision runs it: float32 math, x's dtype out
        case.variants["eager-w32"] = (lambda: reference(x.float(), cols, w32, 1e-6).to(dtype),
                                      [w32])
    if peers and device.type == "cuda":
        try:
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction
            case.variants["liger"] = lambda: LigerRMSNormFunction.apply(x, w, 1e-6)
        except ImportError:
            pass
        try:
            from quack import rmsnorm
            case.variants["quack"] = lambda: rmsnorm(x, w, 1e-6)
        except ImportError:
            pass
    return case
