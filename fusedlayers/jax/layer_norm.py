"""LayerNorm on JAX arrays: the custom calls fusedlayers_layer_norm_{forward,backward}
(backends/xla/layer_norm_ffi.cc) under jax.custom_vjp. Same contract as fusedlayers.torch.layer_norm;
csrc/norm/layer_norm.h checks the arguments."""

import math
from collections.abc import Sequence
from functools import partial

import jax
import numpy as np

from .. import _args
from ..bench.case import Case, memory_work
from . import _op

__all__ = ["layer_norm", "layer_norm_trailing"]


def layer_norm(x, normalized_shape: int | Sequence[int], weight=None, bias=None,
               eps: float = 1e-5) -> jax.Array:
    """Layer normalization over the trailing `normalized_shape` dims of x (Ba et al. 2016,
    arXiv:1607.06450), as torch.nn.functional.layer_norm. x: (..., *normalized_shape),
    float32/float64/float16/bfloat16; weight, bias: normalized_shape, x's dtype or float32 for
    half x. Statistics in float32 (float64 for float64); eps travels as a float32 attribute.
    While tracing, raises TypeError for dtypes and non-int shapes, ValueError for shapes and
    eps (csrc/norm/layer_norm.h's rules and messages)."""
    shape = tuple(int(d) for d in _args.normalized_shape("fusedlayers.layer_norm",
                                                          normalized_shape))
    x, weight, bias = _op.prepare("layer_norm", x=x, weight=weight, bias=bias)
    eps = _args.real("fusedlayers.layer_norm", "eps", eps)
    _op.check("layer_norm", x, weight, bias, shape, np.float32(eps), False)
    return _layer_norm(x, weight, bias, shape, eps, False)


def layer_norm_trailing(x, norm_ndims: int, gamma=None, beta=None, eps: float = 1e-5,
                        rms_scaling: bool = False) -> jax.Array:
    """Normalizes the trailing norm_ndims dims; rms_scaling as Keras' LayerNormalization's."""
    x, gamma, beta = _op.prepare("layer_norm", x=x, weight=gamma, bias=beta)
    shape = tuple(x.shape[x.ndim - norm_ndims:])
    eps = _args.real("fusedlayers.layer_norm", "eps", eps)
    _op.check("layer_norm", x, gamma, beta, shape, np.float32(eps), bool(rms_scaling))
    return _layer_norm(x, gamma, beta, shape, eps, bool(rms_scaling))


def _param_dtype(x, weight, bias):
    return weight.dtype if weight is not None else bias.dtype if bias is not None else x.dtype


def _forward(x, weight, bias, shape, eps, rms_scaling):
    stats = jax.ShapeDtypeStruct(x.shape[:max(x.ndim - len(shape), 0)], _op.stat_dtype(x))
    pdt = _param_dtype(x, weight, bias)
    return _op.call("layer_norm_forward", (_op.like(x), stats, stats), x,
                    _op.absent(pdt) if weight is None else weight,
                    _op.absent(pdt) if bias is None else bias,
                    roles="xpp->xrr", rows=len(stats.shape),
                    normalized_shape=_op.shape_attr(shape), eps=np.float32(eps),
                    has_weight=weight is not None, has_bias=bias is not None,
                    rms_scaling=rms_scaling)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _layer_norm(x, weight, bias, shape, eps, rms_scaling):
    return _forward(x, weight, bias, shape, eps, rms_scaling)[0]


def _layer_norm_fwd(x, weight, bias, shape, eps, rms_scaling):
    y, mean, rstd = _forward(x, weight, bias, shape, eps, rms_scaling)
    return y, (x, mean, rstd, weight, bias)


def _layer_norm_bwd(shape, eps, rms_scaling, saved, dy):
    x, mean, rstd, weight, bias = saved
    pdt = _param_dtype(x, weight, bias)
    param = lambda t: _op.absent(pdt) if t is None else t  # noqa: E731
    dx, dweight, dbias = _op.call(
        "layer_norm_backward", (_op.like(x), _op.like(param(weight)), _op.like(param(bias))),
        dy, x, mean, rstd, param(weight), param(bias), roles="xxrrpp->xss", rows=mean.ndim,
        workspace=_op.workspace("norm", math.prod(shape)), normalized_shape=_op.shape_attr(shape),
        has_weight=weight is not None, has_bias=bias is not None, rms_scaling=rms_scaling)
    return dx, None if weight is None else dweight, None if bias is None else dbias


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


def bench_case(shape, dtype) -> Case:
    """Against flax.linen.LayerNorm where flax imports, else the same math in jax.numpy."""
    rows, cols = shape
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (rows, cols), dtype)
    w, b = (jax.random.normal(k, (cols,), dtype) for k in keys[1:])
    try:
        import flax.linen as nn
        module = nn.LayerNorm(epsilon=1e-5, dtype=dtype, param_dtype=dtype)
        eager = lambda x, w, b: module.apply({"params": {"scale": w, "bias": b}}, x)  # noqa: E731
    except ImportError:
        def eager(x, w, b):
            xf = x.astype(jax.numpy.float32)
            mean = xf.mean(-1, keepdims=True)
            var = ((xf - mean) ** 2).mean(-1, keepdims=True)
            return ((xf - mean) * jax.lax.rsqrt(var + 1e-5) * w + b).astype(x.dtype)
    nbytes = x.size * x.dtype.itemsize
    return Case(lambda x, w, b: layer_norm(x, cols, w, b), eager, [x, w, b],
                memory_work(nbytes, nbytes))