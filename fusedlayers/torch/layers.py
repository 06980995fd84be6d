"""torch.nn modules for the fused ops, drop-in for the unfused layers they replace: same
constructor arguments, defaults, parameters, initialisation and state_dict keys. Each forward is
one call of the operator (autograd and autocast are decided in C++), so a module costs no more
host time than the op itself."""

from collections.abc import Sequence

import torch
from torch import nn

from .. import _args
from . import ops


class FusedReLUScale(nn.Module):
    """y = max(x, 0) * alpha in one pass; replaces `torch.relu(x) * alpha`.

    Input: any shape, float32/float64/float16/bfloat16; output: same shape and dtype.
    """

    def __init__(self, alpha: float = 1.0):
        super().__init__()
        self.alpha = _args.real("FusedReLUScale", "alpha", alpha)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.relu_scale_op(x, self.alpha)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}"


class FusedLinearGELU(nn.Module):
    """gelu(x @ weight^T + bias); replaces `nn.Linear(in_features, out_features)` + `nn.GELU()`.

    Parameters, initialisation and state_dict keys are nn.Linear's: weight (out_features,
    in_features), bias (out_features,). Input (..., in_features) -> output (..., out_features).
    approximate: 'none' (erf GELU) or 'tanh', as nn.GELU.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 approximate: str = "none", device=None, dtype=None):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"FusedLinearGELU: approximate must be 'none' or 'tanh', "
                             f"got {approximate!r}")
        factory = {"device": device, "dtype": dtype}
        self.in_features, self.out_features, self.approximate = in_features, out_features, approximate
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    reset_parameters = nn.Linear.reset_parameters  # identical initialisation to nn.Linear

    @classmethod
    def from_linear(cls, linear: nn.Module, approximate: str = "none") -> "FusedLinearGELU":
        """A FusedLinearGELU sharing the Parameters of `linear` (an nn.Linear, or any module
        with an (out_features, in_features) `weight` and a `bias` used as nn.Linear uses them):
        fuses `linear` + GELU, copying nothing."""
        out_features, in_features = linear.weight.shape
        fused = cls(in_features, out_features, bias=linear.bias is not None,
                    approximate=approximate, device="meta")
        fused.weight, fused.bias = linear.weight, linear.bias
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear_gelu_op(x, self.weight, self.bias, self.approximate)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, approximate={self.approximate!r}")


class FusedConv1DGELU(nn.Module):
    """gelu(x @ weight + bias) with the weight stored (in_features, out_features), as GPT-2's
    `Conv1D` (transformers.pytorch_utils) keeps it; replaces `Conv1D(nf, nx)` + GELU with its
    parameters, initialisation and state_dict keys: weight (nx, nf), bias (nf,). The weight is
    read in place and its gradient written in the same layout: nothing is transposed or copied.

    Input (..., nx) -> output (..., nf). approximate: 'none' (erf GELU) or 'tanh' (GPT-2's
    `gelu_new`).
    """

    def __init__(self, nf: int, nx: int, approximate: str = "none", device=None, dtype=None):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"FusedConv1DGELU: approximate must be 'none' or 'tanh', "
                             f"got {approximate!r}")
        self.nf, self.nx, self.approximate = nf, nx, approximate
        self.weight = nn.Parameter(torch.empty(nx, nf, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(nf, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=0.02)  # as Conv1D

    @classmethod
    def from_conv1d(cls, conv1d: nn.Module, approximate: str = "none") -> "FusedConv1DGELU":
        """A FusedConv1DGELU sharing the Parameters of `conv1d` (any module computing
        `x @ weight + bias` with weight (in_features, out_features)), copying nothing."""
        nx, nf = conv1d.weight.shape
        fused = cls(nf, nx, approximate=approximate, device="meta")
        fused.weight, fused.bias = conv1d.weight, conv1d.bias
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear_gelu_op(x, self.weight.t(), self.bias, self.approximate)

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}, approximate={self.approximate!r}"


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.layer_norm_op(x, self.normalized_shape, self.weight, self.bias, self.eps,
                                 self.memory_efficient)[0]

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}, "
                f"memory_efficient={self.memory_efficient}")
