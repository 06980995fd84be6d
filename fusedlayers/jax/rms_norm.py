"""RMSNorm on JAX arrays: the custom calls fusedlayers_rms_norm_{forward,backward}
(backends/xla/rms_norm_ffi.cc) under jax.custom_vjp. Same contract as fusedlayers.torch.rms_norm;
csrc/norm/rms_norm.h checks the arguments."""

import math
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from .. import _args
from ..bench.case import Case, memory_work
from . import _impl, _op

__all__ = ["rms_norm"]


def rms_norm(x, normalized_shape: int | Sequence[int], weight=None, eps: float | None = None,
             zero_centered: bool = False) -> jax.Array:
    """y = x / sqrt(mean(x^2) + eps) * weight (or * (1 + weight) with zero_centered) over the
    trailing normalized_shape dims of x (Zhang & Sennrich 2019, arXiv:1910.07467). eps=None
    means the machine epsilon of x's dtype, as torch's; it travels as a float32 attribute.
    Dtypes and errors as fusedlayers.jax.layer_norm."""
    shape = tuple(int(d) for d in _args.normalized_shape("fusedlayers.rms_norm",
                                                          normalized_shape))
    x, weight = _op.prepare("rms_norm", x=x, weight=weight)
    eps = float(jnp.finfo(x.dtype).eps) if eps is None else \
        _args.real("fusedlayers.rms_norm", "eps", eps)
    _op.check("rms_norm", x, weight, shape, np.float32(eps), bool(zero_centered))
    return _rms_norm(x, weight, shape, eps, bool(zero_centered))


def _forward(x, weight, shape, eps, zero_centered):
    if _impl.use_xla("rms_norm"):
        return xla_forward(x, weight, shape, eps, zero_centered)
    stats = jax.ShapeDtypeStruct(x.shape[:max(x.ndim - len(shape), 0)], _op.stat_dtype(x))
    return _op.call("rms_norm_forward", (_op.like(x), stats), x,
                    _op.absent(x.dtype) if weight is None else weight,
                    roles="xp->xr", rows=len(stats.shape),
                    normalized_shape=_op.shape_attr(shape), eps=np.float32(eps),
                    has_weight=weight is not None, zero_centered=zero_centered)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _rms_norm(x, weight, shape, eps, zero_centered):
    return _forward(x, weight, shape, eps, zero_centered)[0]


def _rms_norm_fwd(x, weight, shape, eps, zero_centered):
    y, rstd = _forward(x, weight, shape, eps, zero_centered)
    return y, (x, rstd, weight)


def _rms_norm_bwd(shape, eps, zero_centered, saved, dy):
    x, rstd, weight = saved
    if _impl.use_xla("rms_norm"):
        return xla_backward(dy, x, rstd, weight, shape, zero_centered)
    w = _op.absent(x.dtype) if weight is None else weight
    dx, dweight = _op.call("rms_norm_backward", (_op.like(x), _op.like(w)), dy, x, rstd, w,
                           roles="xxrp->xs", rows=rstd.ndim,
                           workspace=_op.workspace("norm", math.prod(shape)),
                           normalized_shape=_op.shape_attr(shape), has_weight=weight is not None,
                           zero_centered=zero_centered)
    return dx, None if weight is None else dweight


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


# ---------------------------------------------------------------- XLA's formula (_impl)

def _axes(x, shape):
    return tuple(range(x.ndim - len(shape), x.ndim))


def _gain(weight, acc, zero_centered):
    return weight.astype(acc) + 1 if zero_centered else weight.astype(acc)


def xla_forward(x, weight, shape, eps, zero_centered):
    """(y, rstd) as the kernel computes them (csrc/norm/norm.h, NormMode::kRms), in jnp."""
    acc = _op.stat_dtype(x)
    xf = x.astype(acc)
    rstd = jax.lax.rsqrt(jnp.mean(xf * xf, _axes(x, shape), keepdims=True) + eps)
    y = xf * rstd
    if weight is not None:
        y = y * _gain(weight, acc, zero_centered)
    return y.astype(x.dtype), rstd.reshape(x.shape[:x.ndim - len(shape)])


def xla_backward(dy, x, rstd, weight, shape, zero_centered):
    """(dx, dweight): dx = rstd (g - xhat mean(g xhat)), g = dy * gain (csrc/norm/norm.h)."""
    acc, axes = _op.stat_dtype(x), _axes(x, shape)
    dyf = dy.astype(acc)
    xhat = x.astype(acc) * rstd.reshape(*rstd.shape, *([1] * len(shape)))
    g = dyf if weight is None else dyf * _gain(weight, acc, zero_centered)
    dx = rstd.reshape(*rstd.shape, *([1] * len(shape))) * (
        g - xhat * jnp.mean(g * xhat, axes, keepdims=True))
    dweight = None if weight is None else jnp.sum(
        dyf * xhat, tuple(range(x.ndim - len(shape)))).astype(weight.dtype)
    return dx.astype(x.dtype), dweight


def bench_case(shape, dtype) -> Case:
    """Against flax.linen.RMSNorm where flax imports, else the same math in jax.numpy."""
    rows, cols = shape
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (rows, cols), dtype)
    w = jax.random.normal(keys[1], (cols,), dtype)
    try:
        import flax.linen as nn
        module = nn.RMSNorm(epsilon=1e-6, dtype=dtype, param_dtype=dtype)
        eager = lambda x, w: module.apply({"params": {"scale": w}}, x)  # noqa: E731
    except ImportError:
        def eager(x, w):
            xf = x.astype(jnp.float32)
            return (xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + 1e-6) * w
                    ).astype(x.dtype)
    nbytes = x.size * x.dtype.itemsize
    return Case(lambda x, w: rms_norm(x, cols, w, 1e-6), eager, [x, w],
                memory_work(nbytes, nbytes))