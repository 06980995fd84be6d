"""ReLU*scale on torch tensors: `fusedlayers::relu_scale` (backends/torch/relu_scale.cpp: schema,
kernels, autograd; no autocast kernel, so it runs in its input's dtype, as relu), its fake
kernels, the functional API and `FusedReLUScale`. The math: csrc/relu_scale.h."""

import torch
from torch import nn

from .. import _args
from . import _op

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


@_op.register_fake("relu_scale")
def _(x, alpha):
    return x.new_empty(x.shape)


@_op.register_fake("relu_scale_with_mask")
def _(x, alpha):
    return x.new_empty(x.shape), x.new_empty(((x.numel() + 31) // 32,), dtype=torch.int32)


@_op.register_fake("relu_scale_backward")
def _(grad_out, mask, alpha):
    _op.check_devices("relu_scale_backward", "grad_out", grad_out, mask=mask)
    return grad_out.new_empty(grad_out.shape)
