"""ReLU*scale on JAX arrays: the custom calls fusedlayers_relu_scale_{forward,backward}
(backends/xla/relu_scale_ffi.cc) under jax.custom_vjp. Same contract as fusedlayers.torch.relu_scale;
csrc/activation/relu_scale.h checks the arguments."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from .. import _args
from ..bench.case import Case, memory_work
from . import _op

__all__ = ["relu_scale"]


def relu_scale(x, alpha: float) -> jax.Array:
    """y = max(x, 0) * alpha, element-wise, bit-identical to `jax.nn.relu(x) * alpha` computed
    in float32 (float64 for float64). x: any shape, float32/float64/float16/bfloat16. alpha
    travels as a float32 attribute. The gradient saves 1 bit per element (a packed mask), not x.
    While tracing, raises TypeError for other dtypes or a non-real alpha, ValueError for a
    non-finite one (csrc/activation/relu_scale.h)."""
    (x,) = _op.prepare("relu_scale", x=x)
    alpha = _args.real("fusedlayers.relu_scale", "alpha", alpha)
    _op.check("relu_scale", x, np.float32(alpha))
    return _relu_scale(x, alpha)


def _forward(x, alpha: float, with_mask: bool):
    words = (x.size + 31) // 32 if with_mask else 0
    # Elementwise: its rows are x's leading dim (one contiguous part of x, and of its mask).
    return _op.call("relu_scale_forward", (_op.like(x), jax.ShapeDtypeStruct((words,), jnp.uint32)),
                    x, roles="x->xm" if with_mask else "x->xp", rows=min(x.ndim, 1),
                    alpha=np.float32(alpha), with_mask=with_mask)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _relu_scale(x, alpha):
    return _forward(x, alpha, False)[0]


def _relu_scale_fwd(x, alpha):
    return _forward(x, alpha, True)


def _relu_scale_bwd(alpha, mask, dy):
    return (_op.call("relu_scale_backward", _op.like(dy), dy, mask, roles="xm->x",
                     rows=min(dy.ndim, 1), alpha=np.float32(alpha)),)


_relu_scale.defvjp(_relu_scale_fwd, _relu_scale_bwd)


def bench_case(shape, dtype) -> Case:
    """Against jax.nn.relu times alpha."""
    x = jax.random.normal(jax.random.key(0), shape, dtype)
    return Case(lambda x: relu_scale(x, 0.5), lambda x: jax.nn.relu(x) * 0.5, [x],
                memory_work(x.size * x.dtype.itemsize, 2 * x.size // 8))