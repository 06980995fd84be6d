"""LayerNorm on torch tensors: `fusedlayers::layer_norm` (backends/torch/layer_norm.cpp: schema,
kernels, autograd, autocast), its fake kernels, the functional API and `LayerNorm`, drop-in for
`torch.nn.LayerNorm`, the unfused reference and Inductor's lowering. The math: csrc/norm/norm.h
(NormMode::kLayer). Under torch.autocast it runs in
float32 on CUDA and in the input dtype on the CPU, as `torch.nn.functional.layer_norm` there;
float64 stays float64."""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .. import _args
from ..bench.case import Case, memory_work
from . import _op

__all__ = ["LayerNorm", "layer_norm", "layer_norm_trailing"]
layer_norm_op = _op.handle("layer_norm")


def layer_norm(x: torch.Tensor, normalized_shape: int | Sequence[int],
               weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5, memory_efficient: bool = False) -> torch.Tensor:
    """Layer normalization over the trailing `normalized_shape` dims of x, replacing
    `torch.nn.functional.layer_norm` (Ba et al. 2016, arXiv:1607.06450).

    x: (..., *normalized_shape), float32/float64/float16/bfloat16, any layout. weight, bias:
    normalized_shape, in x's dtype or float32 (for half x). Statistics in float32 (float64 for
    float64). memory_efficient=True saves the output instead of the input for the backward (as
    Apex does); it then needs a weight without zeros. Raises ValueError on shape/device/eps
    errors and TypeError on dtype errors or a normalized_shape / eps of the wrong type.
    """
    shape = _args.normalized_shape("fusedlayers.layer_norm", normalized_shape)
    eps = _args.real("fusedlayers.layer_norm", "eps", eps)
    return layer_norm_op(x, shape, weight, bias, eps, bool(memory_efficient))[0]


def layer_norm_trailing(x: torch.Tensor, norm_ndims: int, gamma: torch.Tensor | None = None,
                        beta: torch.Tensor | None = None, eps: float = 1e-5,
                        rms_scaling: bool = False) -> torch.Tensor:
    """Normalizes the trailing norm_ndims dims; rms_scaling as Keras' LayerNormalization's."""
    shape = list(x.shape[x.dim() - norm_ndims:])
    eps = _args.real("fusedlayers.layer_norm", "eps", eps)
    return layer_norm_op(x, shape, gamma, beta, eps, False, rms_scaling)[0]


class LayerNorm(nn.Module):
    """Layer normalization over the trailing `normalized_shape` dims; replaces nn.LayerNorm
    with the same arguments, parameters (weight = gamma, bias = beta) and state_dict keys.

    memory_efficient=True saves the output instead of the input for backward (Apex's
    FusedLayerNorm option); it then requires weight without zeros. Statistics in float32.
    """

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True,
                 memory_efficient: bool = False, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.normalized_shape = tuple(int(d) for d in _args.normalized_shape("LayerNorm",
                                                                             normalized_shape))
        self.eps = _args.real("LayerNorm", "eps", eps)
        self.elementwise_affine = elementwise_affine
        self.memory_efficient = memory_efficient
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, **factory))
            if bias:
                self.bias = nn.Parameter(torch.empty(self.normalized_shape, **factory))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    reset_parameters = nn.LayerNorm.reset_parameters  # ones / zeros, as nn.LayerNorm

    @classmethod
    def from_layer_norm(cls, layer_norm: nn.LayerNorm, memory_efficient: bool = False
                        ) -> "LayerNorm":
        """A LayerNorm sharing the Parameters of `layer_norm` (an nn.LayerNorm), copying
        nothing."""
        fused = cls(layer_norm.normalized_shape, eps=layer_norm.eps, elementwise_affine=False,
                    memory_efficient=memory_efficient)
        fused.elementwise_affine = layer_norm.elementwise_affine
        fused.weight, fused.bias = layer_norm.weight, layer_norm.bias
        return fused

    @classmethod
    def fuse_candidates(cls, module: nn.Module) -> tuple[list["LayerNorm"], bool]:
        """fuse()'s rule (see RMSNorm.fuse_candidates): a torch.nn.LayerNorm, certainly."""
        return ([cls.from_layer_norm(module)], True) if isinstance(module, nn.LayerNorm) else \
            ([], False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm_op(x, self.normalized_shape, self.weight, self.bias, self.eps,
                             self.memory_efficient)[0]

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}, "
                f"memory_efficient={self.memory_efficient}")


def reference(x: torch.Tensor, normalized_shape: int | Sequence[int],
              weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
              eps: float = 1e-5) -> torch.Tensor:
    """The unfused computation layer_norm replaces."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    return F.layer_norm(x, shape, weight, bias, eps)


FUSED_MODULE = LayerNorm  # fuse() swaps modules by LayerNorm.fuse_candidates


@_op.register_fake("layer_norm")
def _(x, normalized_shape, weight, bias, eps, memory_efficient=False, rms_scaling=False):
    _op.check_devices("layer_norm", "x", x, weight=weight, bias=bias)
    stat_shape = x.shape[:x.dim() - len(normalized_shape)]
    return (x.new_empty(x.shape), x.new_empty(stat_shape, dtype=_op.stat_dtype(x)),
            x.new_empty(stat_shape, dtype=_op.stat_dtype(x)))


@_op.register_fake("layer_norm_backward")
def _(dy, saved, mean, rstd, normalized_shape, weight, bias, memory_efficient=False,
      rms_scaling=False):
    _op.check_devices("layer_norm_backward", "saved", saved, dy=dy, weight=weight, bias=bias)
    return (saved.new_empty(saved.shape),
            saved.new_empty(0) if weight is None else weight.new_empty(weight.shape),
            saved.new_empty(0) if bias is None else bias.new_empty(bias.shape))


# ---------------------------------------------------------------- Inductor's lowering

def _forward(x, normalized_shape, weight, bias, eps, memory_efficient=False, rms_scaling=False):
    # The math of csrc/norm/norm.h: statistics and output in float32 (float64 for float64),
    # returned in the leading shape; rms_scaling=True scales x itself (Keras' rms_scaling).
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    xf = x.to(_op.stat_dtype(x))
    var, mean = torch.var_mean(xf, dim=dims, correction=0, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    y = (xf if rms_scaling else xf - mean) * rstd
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    lead = x.shape[:dims[0]]
    return y.to(x.dtype), mean.reshape(lead), rstd.reshape(lead)


def _backward(dy, saved, mean, rstd, normalized_shape, weight, bias, memory_efficient=False,
              rms_scaling=False):
    # With g = dy * weight: dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat)), or for
    # rms_scaling=True dx = rstd * (g - x_hat * rstd * mean(g * x)) (csrc/norm/norm.h).
    dims = list(range(saved.dim() - len(normalized_shape), saved.dim()))
    lead_dims = list(range(dims[0]))
    keep = (*mean.shape, *([1] * len(dims)))
    acc = _op.stat_dtype(saved)
    dy, s, rstd = dy.to(acc), saved.to(acc), rstd.reshape(keep)
    g = dy if weight is None else dy * weight
    if memory_efficient:  # saved is the output: x_hat = (y - bias) / weight
        x_hat = s if bias is None else s - bias
        x_hat = x_hat if weight is None else x_hat / weight
    else:
        x_hat = (s - mean.reshape(keep)) * rstd
    if not rms_scaling:
        dx = rstd * (g - g.mean(dims, keepdim=True) - x_hat * (g * x_hat).mean(dims, keepdim=True))
        y_hat = x_hat  # what weight multiplies
    else:
        dx = rstd * (g - x_hat * rstd * (g * s).mean(dims, keepdim=True))
        y_hat = s * rstd
    empty = saved.new_empty(0)
    dweight = empty if weight is None else (dy * y_hat).sum(lead_dims).to(weight.dtype)
    dbias = empty if bias is None else dy.sum(lead_dims).to(bias.dtype)
    return dx.to(saved.dtype), dweight, dbias


DECOMPOSITIONS = {"layer_norm": _forward, "layer_norm_backward": _backward}


def bench_case(shape, dtype: torch.dtype, device: torch.device, peers: bool = False) -> Case:
    rows, cols = shape
    x, w, b = (torch.randn(*s, device=device, dtype=dtype, requires_grad=True)
               for s in ((rows, cols), (cols,), (cols,)))
    fused = lambda w, b: layer_norm(x, cols, w, b)  # noqa: E731
    case = Case(lambda: fused(w, b), lambda: reference(x, cols, w, b), [x, w, b],
                memory_work(x.numel() * x.element_size(), x.numel() * x.element_size()))
    if dtype in (torch.float16, torch.bfloat16):  # mixed precision's float32 parameters
        w32, b32 = (p.detach().float().requires_grad_() for p in (w, b))
        case.variants["fused-w32"] = (lambda: fused(w32, b32), [w32, b32])
        # unfused, as mixed precision runs it: float32 math (autocast's policy), x's dtype out
        case.variants["eager-w32"] = (lambda: reference(x.float(), cols, w32, b32).to(dtype),
                                      [w32, b32])
    if peers and device.type == "cuda":
        try:
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction
            case.variants["liger"] = lambda: LigerLayerNormFunction.apply(x, w, b, 1e-5)
        except ImportError:
            pass
    return case
