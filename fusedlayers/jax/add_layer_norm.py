"""The residual add inside LayerNorm on JAX arrays: the custom calls
fusedlayers_add_layer_norm_{forward,backward} (backends/xla/add_norm_ffi.cc) under jax.custom_vjp.
Same contract as fusedlayers.torch.add_layer_norm; csrc/norm/add_norm.h checks the arguments."""

import math
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from .. import _args
from ..bench.case import Case
from . import _op

__all__ = ["add_layer_norm"]


def add_layer_norm(x, residual, normalized_shape: int | Sequence[int], weight=None, bias=None,
                   eps: float = 1e-5):
    """(y, h): h = x + residual in residual's dtype (x's, or float32 under half x), y =
    layer_norm(h) in x's dtype (Ba et al. 2016, arXiv:1607.06450). eps travels as a float32
    attribute. While tracing, raises TypeError for dtypes, ValueError for shapes and eps
    (csrc/norm/add_norm.h's rules and messages)."""
    shape = tuple(int(d) for d in _args.normalized_shape("fusedlayers.add_layer_norm",
                                                          normalized_shape))
    x, residual, weight, bias = _op.prepare("add_layer_norm", x=x, residual=residual,
                                            weight=weight, bias=bias)
    eps = _args.real("fusedlayers.add_layer_norm", "eps", eps)
    _op.check("add_layer_norm", x, residual, weight, bias, shape, np.float32(eps))
    return _add_layer_norm(x, residual, weight, bias, shape, eps)


def _param_dtype(x, weight, bias):
    return weight.dtype if weight is not None else bias.dtype if bias is not None else x.dtype


def _forward(x, residual, weight, bias, shape, eps):
    stats = jax.ShapeDtypeStruct(x.shape[:max(x.ndim - len(shape), 0)], _op.stat_dtype(x))
    pdt = _param_dtype(x, weight, bias)
    return _op.call("add_layer_norm_forward", (_op.like(x), _op.like(residual), stats, stats), x,
                    residual, _op.absent(pdt) if weight is None else weight,
                    _op.absent(pdt) if bias is None else bias,
                    roles="xxpp->xxrr", rows=len(stats.shape),
                    normalized_shape=_op.shape_attr(shape), eps=np.float32(eps),
                    has_weight=weight is not None, has_bias=bias is not None)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _add_layer_norm(x, residual, weight, bias, shape, eps):
    y, h, _, _ = _forward(x, residual, weight, bias, shape, eps)
    return y, h


def _add_layer_norm_fwd(x, residual, weight, bias, shape, eps):
    y, h, mean, rstd = _forward(x, residual, weight, bias, shape, eps)
    return (y, h), (h, mean, rstd, weight, bias)


def _add_layer_norm_bwd(shape, eps, saved, cotangents):
    h, mean, rstd, weight, bias = saved
    dy, dh = cotangents
    pdt = _param_dtype(dy, weight, bias)
    param = lambda t: _op.absent(pdt) if t is None else t  # noqa: E731
    dx, dresidual, dweight, dbias = _op.call(
        "add_layer_norm_backward",
        (_op.like(dy), _op.dresidual_result(h, dy), _op.like(param(weight)),
         _op.like(param(bias))),
        dy, dh, h, mean, rstd, param(weight), param(bias),
        roles=f"xxxrrpp->x{_op.dresidual_role(h, dy)}ss", rows=mean.ndim,
        workspace=_op.workspace("norm", math.prod(shape)),
        normalized_shape=_op.shape_attr(shape), has_dh=True, has_weight=weight is not None,
        has_bias=bias is not None)
    return (dx, dx if h.dtype == dy.dtype else dresidual, None if weight is None else dweight,
            None if bias is None else dbias)


_add_layer_norm.defvjp(_add_layer_norm_fwd, _add_layer_norm_bwd)


def bench_case(shape, dtype) -> Case:
    """Against the add and the norm in jax.numpy (float32 statistics, as flax's LayerNorm)."""
    rows, cols = shape
    keys = jax.random.split(jax.random.key(0), 4)
    x, r = (jax.random.normal(k, (rows, cols), dtype) for k in keys[:2])
    w, b = (jax.random.normal(k, (cols,), dtype) for k in keys[2:])

    def eager(x, r, w, b):
        h = x + r
        hf = h.astype(jnp.float32)
        mean = hf.mean(-1, keepdims=True)
        var = ((hf - mean) ** 2).mean(-1, keepdims=True)
        return ((hf - mean) * jax.lax.rsqrt(var + 1e-5) * w + b).astype(x.dtype), h
    return Case(lambda x, r, w, b: add_layer_norm(x, r, cols, w, b), eager, [x, r, w, b],
                _op.add_norm_work(x))
