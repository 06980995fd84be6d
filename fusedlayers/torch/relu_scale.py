"""ReLU*scale on torch tensors: `fusedlayers::relu_scale` (backends/torch/relu_scale.cpp: schema,
kernels, autograd; no autocast kernel, so it runs in its input's dtype, as relu), its fake
kernels, the functional API, `FusedReLUScale`, the unfused reference and Inductor's lowering.
The math: csrc/activation/relu_scale.h."""

import torch
import torch.nn.functional as F
from torch import nn

from .. import _args
from ..bench.case import Case, memory_work
from . import _op

__all__ = ["FusedReLUScale", "UnfusedReLUScale", "relu_scale"]
relu_scale_op = _op.handle("relu_scale")


def relu_scale(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """y = max(x, 0) * alpha, element-wise, bit-identical to `torch.relu(x) * alpha`.

    x: any shape and layout, float32/float64/float16/bfloat16. Returns a contiguous tensor of
    x's shape and dtype. Raises TypeError for other dtypes or an alpha that is not a real
    number, ValueError for a non-finite alpha.
    When x requires grad, autograd saves a bitmask of where x > 0 (1 bit per element), not x.
    """
    return relu_scale_op(x, _args.real("fusedlayers.relu_scale", "alpha", alpha))


class FusedReLUScale(nn.Module):
    """y = max(x, 0) * alpha in one pass; replaces `torch.relu(x) * alpha`.

    Input: any shape, float32/float64/float16/bfloat16; output: same shape and dtype.
    """

    def __init__(self, alpha: float = 1.0):
        super().__init__()
        self.alpha = _args.real("FusedReLUScale", "alpha", alpha)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return relu_scale_op(x, self.alpha)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}"


def reference(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """The unfused computation relu_scale replaces."""
    return torch.relu(x) * alpha


class UnfusedReLUScale(nn.Module):
    """The unfused counterpart of FusedReLUScale: torch.relu(x) * alpha."""

    def __init__(self, alpha: float = 1.0):
        super().__init__()
        self.alpha = float(alpha)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reference(x, self.alpha)


@_op.register_fake("relu_scale")
def _(x, alpha):
    return x.new_empty(x.shape)


@_op.register_fake("relu_scale_with_mask")
def _(x, alpha):
    return x.new_empty(x.shape), x.new_empty(((x.numel() + 31) // 32,), dtype=torch.uint32)


@_op.register_fake("relu_scale_backward")
def _(dy, mask, alpha):
    _op.check_devices("relu_scale_backward", "dy", dy, mask=mask)
    return dy.new_empty(dy.shape)


# ---------------------------------------------------------------- Inductor's lowering

def _with_mask(x, alpha):
    # The mask in csrc/activation/relu_scale.h's layout: bit i % 32 of word i / 32 set where x[i] is not
    # <= 0, zero-padded; uint32 words as the operator returns them.
    n = x.numel()
    words = (n + 31) // 32
    keep = F.pad(torch.logical_not(x <= 0).reshape(-1).to(torch.int64), (0, words * 32 - n))
    bits = keep.reshape(words, 32) << torch.arange(32, device=x.device, dtype=torch.int64)
    return reference(x, alpha), bits.sum(-1).to(torch.uint32)


def _backward(dy, mask, alpha):
    bits = (mask.to(torch.int64).unsqueeze(-1)
            >> torch.arange(32, device=mask.device, dtype=torch.int64)) & 1
    keep = bits.reshape(-1)[:dy.numel()].reshape(dy.shape) != 0
    return torch.where(keep, dy * alpha, torch.zeros_like(dy))


DECOMPOSITIONS = {"relu_scale": reference, "relu_scale_with_mask": _with_mask,
                  "relu_scale_backward": _backward}


def bench_case(shape, dtype: torch.dtype, device: torch.device, peers: bool = False) -> Case:
    x = torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)
    x_bytes = x.numel() * x.element_size()
    return Case(lambda: relu_scale(x, 0.5), lambda: reference(x, 0.5), [x],
                memory_work(x_bytes, 2 * x.numel() // 8))  # the mask: written and read, 1 bit
