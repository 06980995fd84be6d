"""torch.nn modules for the fused ops, drop-in for the unfused layers they replace: same
constructor arguments, defaults, parameters, initialisation and state_dict keys."""

from collections.abc import Sequence

import torch
from torch import nn

from . import ops


class FusedReLUScale(nn.Module):
    """y = max(x, 0) * alpha in one pass; replaces `torch.relu(x) * alpha`.

    Input: any shape, float32/float64/float16/bfloat16; output: same shape and dtype.
    """

    def __init__(self, alpha: float = 1.0):
        super().__init__()
        self.alpha = float(alpha)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.relu_scale(x, self.alpha)

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
    def from_linear(cls, linear: nn.Linear, approximate: str = "none") -> "FusedLinearGELU":
        """A FusedLinearGELU sharing `linear`'s parameters (fuses `linear` + GELU)."""
        fused = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    approximate=approximate, device="meta")
        fused.weight, fused.bias = linear.weight, linear.bias
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear_gelu(x, self.weight, self.bias, self.approximate)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, approximate={self.approximate!r}")


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
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.eps, self.elementwise_affine = eps, elementwise_affine
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps,
                              self.memory_efficient)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}, "
                f"memory_efficient={self.memory_efficient}")
