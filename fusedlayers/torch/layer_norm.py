"""LayerNorm on torch tensors: `fusedlayers::layer_norm` (backends/torch/layer_norm.cpp: schema,
kernels, autograd, autocast), its fake kernels, the functional API and `LayerNorm`, drop-in for
`torch.nn.LayerNorm`. The math: csrc/norm.h (NormMode::kLayer). Under torch.autocast it runs in
float32 on CUDA and in the input dtype on the CPU, as `torch.nn.functional.layer_norm` there;
float64 stays float64."""

from collections.abc import Sequence

import torch
from torch import nn

from .. import _args
from . import _op

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


@_op.register_fake("layer_norm")
def _(x, normalized_shape, weight, bias, eps, memory_efficient=False, rms_scaling=False):
    _op.check_devices("layer_norm", "input", x, weight=weight, bias=bias)
    stat_shape = x.shape[:x.dim() - len(normalized_shape)]
    return (x.new_empty(x.shape), x.new_empty(stat_shape, dtype=_op.stat_dtype(x)),
            x.new_empty(stat_shape, dtype=_op.stat_dtype(x)))

@_op.register_fake("layer_norm_backward")
def _(grad_out, saved, mean, rstd, normalized_shape, weight, bias, memory_efficient=False,
      rms_scaling=False):
    _op.check_devices("layer_norm_backward", "saved", saved, grad_out=grad_out, weight=weight,
                   bias=bias)
    return (saved.new_empty(saved.shape),
            saved.new_empty(0) if weight is None else weight.new_empty(weight.shape),
            saved.new_empty(0) if bias is None else bias.new_empty(bias.shape))
