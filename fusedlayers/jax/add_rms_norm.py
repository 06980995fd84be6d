"""The residual add inside RMSNorm on JAX arrays: the custom calls
fusedlayers_add_rms_norm_{forward,backward} (backends/xla/add_norm_ffi.cc) under jax.custom_vjp.
Same contract as fusedlayers.torch.add_rms_norm; csrc/norm/add_norm.h checks the arguments."""

import math
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from .. import _args
from ..bench.case import Case
from . import _impl, _op
from .rms_norm import xla_backward as _rms_xla_backward, xla_forward as _rms_xla_forward

__all__ = ["add_rms_norm"]


def add_rms_norm(x, residual, normalized_shape: int | Sequence[int], weight=None,
                 eps: float | None = None, zero_centered: bool = False):
    """(y, h): h = x + residual in residual's dtype (x's, or float32 under half x), y =
    rms_norm(h) in x's dtype (Zhang & Sennrich 2019, arXiv:1910.07467; the gain 1 + weight with
    zero_centered). eps=None means the machine epsilon of x's dtype; it travels as a float32
    attribute. While tracing, raises TypeError for dtypes, ValueError for shapes and eps
    (csrc/norm/add_norm.h's rules and messages)."""
    shape = tuple(int(d) for d in _args.normalized_shape("fusedlayers.add_rms_norm",
                                                          normalized_shape))
    x, residual, weight = _op.prepare("add_rms_norm", x=x, residual=residual, weight=weight)
    eps = float(jnp.finfo(x.dtype).eps) if eps is None else \
        _args.real("fusedlayers.add_rms_norm", "eps", eps)
    _op.check("add_rms_norm", x, residual, weight, shape, np.float32(eps), bool(zero_centered))
    return _add_rms_norm(x, residual, weight, shape, eps, bool(zero_centered))


def _forward(x, residual, weight, shape, eps, zero_centered):
    if _impl.use_xla("add_rms_norm"):  # the add rounded to residual's dtype, then the norm
        acc = _op.stat_dtype(x)
        h = (x.astype(acc) + residual.astype(acc)).astype(residual.dtype)
        y, rstd = _rms_xla_forward(h, weight, shape, eps, zero_centered)
        return y.astype(x.dtype), h, rstd
    stats = jax.ShapeDtypeStruct(x.shape[:max(x.ndim - len(shape), 0)], _op.stat_dtype(x))
    return _op.call("add_rms_norm_forward", (_op.like(x), _op.like(residual), stats), x,
                    residual, _op.absent(x.dtype) if weight is None else weight,
                    roles="xxp->xxr", rows=len(stats.shape),
                    normalized_shape=_op.shape_attr(shape), eps=np.float32(eps),
                    has_weight=weight is not None, zero_centered=zero_centered)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _add_rms_norm(x, residual, weight, shape, eps, zero_centered):
    y, h, _ = _forward(x, residual, weight, shape, eps, zero_centered)
    return y, h


def _add_rms_norm_fwd(x, residual, weight, shape, eps, zero_centered):
    y, h, rstd = _forward(x, residual, weight, shape, eps, zero_centered)
    return (y, h), (h, rstd, weight)


def _add_rms_norm_bwd(shape, eps, zero_centered, saved, cotangents):
    h, rstd, weight = saved
    dy, dh = cotangents
    if _impl.use_xla("add_rms_norm"):  # the norm's dx in h's dtype, then dh added (norm.h)
        dnorm, dweight = _rms_xla_backward(dy, h, rstd, weight, shape, zero_centered)
        acc = _op.stat_dtype(dy)
        dres = (dnorm.astype(acc) + dh.astype(acc)).astype(h.dtype)
        return dres.astype(dy.dtype), dres, dweight
    w = _op.absent(dy.dtype) if weight is None else weight
    dx, dresidual, dweight = _op.call(
        "add_rms_norm_backward", (_op.like(dy), _op.dresidual_result(h, dy), _op.like(w)),
        dy, dh, h, rstd, w, roles=f"xxxrp->x{_op.dresidual_role(h, dy)}s", rows=rstd.ndim,
        workspace=_op.workspace("norm", math.prod(shape)),
        normalized_shape=_op.shape_attr(shape), has_dh=True, has_weight=weight is not None,
        zero_centered=zero_centered)
    return (dx, dx if h.dtype == dy.dtype else dresidual,
            None if weight is None else dweight)


_add_rms_norm.defvjp(_add_rms_norm_fwd, _add_rms_norm_bwd)


def bench_case(shape, dtype) -> Case:
    """Against the add and the norm in jax.numpy (float32 statistics, as flax's RMSNorm)."""
    rows, cols = shape
    keys = jax.random.split(jax.random.key(0), 3)
    x, r = (jax.random.normal(k, (rows, cols), dtype) for k in keys[:2])
    w = jax.random.normal(keys[2], (cols,), dtype)

    def eager(x, r, w):
        h = x + r
        hf = h.astype(jnp.float32)
        return (hf * jax.lax.rsqrt((hf * hf).mean(-1, keepdims=True) + 1e-6) * w
                ).astype(x.dtype), h
    return Case(lambda x, r, w: add_rms_norm(x, r, cols, w, 1e-6), eager, [x, r, w],
                _op.add_norm_work(x))
