"""The residual add inside LayerNorm on torch tensors: `fusedlayers::add_layer_norm`
(backends/torch/add_norm.cpp), its fake kernels, the functional API and `AddLayerNorm`, the
unfused reference and Inductor's lowering. The math: csrc/norm/add_norm.h and csrc/norm/norm.h
(NormMode::kLayer with a residual)."""

from collections.abc import Sequence

import torch

from .. import _args
from ..bench.case import Case
from . import _op
from .layer_norm import LayerNorm
from .layer_norm import _backward as _ln_backward, _forward as _ln_forward
from .layer_norm import reference as _ln_reference

__all__ = ["AddLayerNorm", "add_layer_norm"]
add_layer_norm_op = _op.handle("add_layer_norm")


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor,
                   normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None,
                   eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h) with h = x + residual and y = layer_norm(h, normalized_shape, weight, bias, eps):
    a block's residual add and the norm after it in one pass, forward and backward (BERT's
    `LayerNorm(hidden + input_tensor)`, a pre-norm block's add before the next norm).

    x: (..., *normalized_shape), float32/float64/float16/bfloat16, any layout. residual: x's
    shape, x's dtype or float32 (half x). weight, bias: normalized_shape, x's dtype or float32
    (half x), one dtype for both. Returns y in x's dtype and h in residual's (h rounded to it
    before the norm, as the unfused add). Raises ValueError on shape/device/eps errors,
    TypeError on dtype errors. Math: Ba et al. 2016 (arXiv:1607.06450), csrc/norm/norm.h.
    """
    shape = _args.normalized_shape("fusedlayers.add_layer_norm", normalized_shape)
    eps = _args.real("fusedlayers.add_layer_norm", "eps", eps)
    y, h, _, _ = add_layer_norm_op(x, residual, shape, weight, bias, eps)
    return y, h


class AddLayerNorm(LayerNorm):
    """LayerNorm whose forward takes the block's residual: forward(x, residual) -> (y, h), h = x
    + residual, y = LayerNorm(h). Same arguments, parameters and state_dict keys as LayerNorm
    (`weight`, `bias`)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, h, _, _ = add_layer_norm_op(x, residual, self.normalized_shape, self.weight,
                                       self.bias, self.eps)
        return y, h


def reference(x: torch.Tensor, residual: torch.Tensor, normalized_shape: int | Sequence[int],
              weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
              eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused computation add_layer_norm replaces: the add in residual's dtype, then the
    norm with its result in x's dtype."""
    h = x + residual  # residual's dtype: its own, or float32 promoted from half x
    return _ln_reference(h, normalized_shape, weight, bias, eps).to(x.dtype), h


@_op.register_fake("add_layer_norm")
def _(x, residual, normalized_shape, weight, bias, eps):
    _op.check_devices("add_layer_norm", "x", x, residual=residual, weight=weight, bias=bias)
    stats = x.shape[:x.dim() - len(normalized_shape)]
    return (x.new_empty(x.shape), residual.new_empty(residual.shape),
            x.new_empty(stats, dtype=_op.stat_dtype(x)),
            x.new_empty(stats, dtype=_op.stat_dtype(x)))


@_op.register_fake("add_layer_norm_backward")
def _(dy, dh, h, mean, rstd, normalized_shape, weight, bias):
    _op.check_devices("add_layer_norm_backward", "dy", dy, dh=dh, h=h, weight=weight, bias=bias)
    return (dy.new_empty(dy.shape), _op.dresidual_like(h, dy),
            dy.new_empty(0) if weight is None else weight.new_empty(weight.shape),
            dy.new_empty(0) if bias is None else bias.new_empty(bias.shape))


# ---------------------------------------------------------------- Inductor's lowering

def _forward(x, residual, normalized_shape, weight, bias, eps):
    h = (x.to(residual.dtype) + residual).to(residual.dtype)
    y, mean, rstd = _ln_forward(h, normalized_shape, weight, bias, eps)
    return y.to(x.dtype), h, mean, rstd


def _backward(dy, dh, h, mean, rstd, normalized_shape, weight, bias):
    # the norm's dx in h's dtype, then dh added in it (csrc/norm/norm.h)
    dnorm, dweight, dbias = _ln_backward(dy.to(h.dtype), h, mean, rstd, normalized_shape,
                                          weight, bias)
    dres = dnorm if dh is None else dnorm + dh
    return dres.to(dy.dtype), _op.dresidual_of(dres, dy), dweight, dbias


DECOMPOSITIONS = {"add_layer_norm": _forward, "add_layer_norm_backward": _backward}


def bench_case(shape, dtype: torch.dtype, device: torch.device, peers: bool = False) -> Case:
    rows, cols = shape
    x, r, w, b = (torch.randn(*s, device=device, dtype=dtype, requires_grad=True)
                  for s in ((rows, cols), (rows, cols), (cols,), (cols,)))
    return Case(lambda: add_layer_norm(x, r, cols, w, b), lambda: reference(x, r, cols, w, b),
                [x, r, w, b], _op.add_norm_work(x))
