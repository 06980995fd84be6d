"""Unfused reference implementations, built from stock PyTorch ops: what each fused op must
match. Used by the tests, the examples and the benchmark; never by the fused path."""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def relu_scale(x: torch.Tensor, alpha: float) -> torch.Tensor:
    return torch.relu(x) * alpha


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                approximate: str = "none") -> torch.Tensor:
    return F.gelu(F.linear(x, weight, bias), approximate=approximate)


def layer_norm(x: torch.Tensor, normalized_shape: int | Sequence[int],
               weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    return F.layer_norm(x, shape, weight, bias, eps)


class ReLUScale(nn.Module):
    """The unfused counterpart of fusedlayers.torch.FusedReLUScale."""

    def __init__(self, alpha: float = 1.0):
        super().__init__()
        self.alpha = float(alpha)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return relu_scale(x, self.alpha)

