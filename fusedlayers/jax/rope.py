"""Rotary position embedding on JAX arrays: the custom calls fusedlayers_rope_{forward,backward}
(backends/xla/rope_ffi.cc) under jax.custom_vjp. Same contract as fusedlayers.torch.rope;
csrc/rope/rope.h checks the arguments."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ..bench.case import Case
from . import _impl, _op

__all__ = ["rope"]


def rope(q, k, cos, sin, unsqueeze_dim: int = 1, interleaved: bool = False):
    """(q_embed, k_embed): Hugging Face's apply_rotary_pos_emb of q and k in one call (RoFormer,
    arXiv:2104.09864). q (batch, heads, seq, head_dim), k (batch, kv_heads, seq, head_dim) with
    unsqueeze_dim=1, or (batch, seq, heads, head_dim) with 2 (JAX's usual layout: then batch and
    seq are the rows that shard across devices; with 1, batch); cos, sin (batch or 1, seq,
    rotary_dim), float32 or q's dtype. cos and sin are constants of the positions: their
    gradient is zero, as under jax.lax.stop_gradient. While tracing, raises TypeError for dtypes
    and ValueError for shapes or another unsqueeze_dim (csrc/rope/rope.h)."""
    q, k, cos, sin = _op.prepare("rope", q=q, k=k, cos=cos, sin=sin)
    if isinstance(unsqueeze_dim, bool) or not isinstance(unsqueeze_dim, int):
        raise TypeError(f"fusedlayers.rope: unsqueeze_dim must be an int, got "
                        f"{type(unsqueeze_dim).__name__}")
    _op.check("rope", q, k, cos, sin, unsqueeze_dim, bool(interleaved))
    return _rope(q, k, cos, sin, unsqueeze_dim, bool(interleaved))


def _call(target, q, k, cos, sin, unsqueeze_dim, interleaved):
    if _impl.use_xla("rope"):
        return tuple(_xla_rotate(t, cos, sin, unsqueeze_dim, interleaved,
                                 target == "rope_backward") for t in (q, k))
    # cos and sin as rows of their own: broadcast over the batch (the rows split with q's)
    cos = jnp.broadcast_to(cos, (q.shape[0], *cos.shape[1:]))
    sin = jnp.broadcast_to(sin, cos.shape)
    return tuple(_op.call(target, (_op.like(q), _op.like(k)), q, k, cos, sin, roles="xxxx->xx",
                          rows=unsqueeze_dim, unsqueeze_dim=np.int64(unsqueeze_dim),
                          interleaved=interleaved))


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _rope(q, k, cos, sin, unsqueeze_dim, interleaved):
    return _call("rope_forward", q, k, cos, sin, unsqueeze_dim, interleaved)


def _rope_fwd(q, k, cos, sin, unsqueeze_dim, interleaved):
    return _call("rope_forward", q, k, cos, sin, unsqueeze_dim, interleaved), (cos, sin)


def _rope_bwd(unsqueeze_dim, interleaved, saved, grads):
    cos, sin = saved
    dq, dk = _call("rope_backward", *grads, cos, sin, unsqueeze_dim, interleaved)
    return dq, dk, jnp.zeros_like(cos), jnp.zeros_like(sin)


_rope.defvjp(_rope_fwd, _rope_bwd)


def _xla_rotate(x, cos, sin, unsqueeze_dim, interleaved, transpose):
    """XLA's formula of the kernel's rotation (csrc/rope/rope.h) of x's first rotary_dim dims, or
    (transpose, the backward) of its transpose: dx = dy cos + rot^T(dy sin)."""
    acc = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    c, s = (jnp.expand_dims(t, unsqueeze_dim).astype(acc) for t in (cos, sin))
    r = c.shape[-1]
    xf = x.astype(acc)
    rot = xf[..., :r]
    if transpose:
        v = rot * s
        if interleaved:
            turned = jnp.stack((v[..., 1::2], -v[..., ::2]), -1).reshape(v.shape)
        else:
            turned = jnp.concatenate((v[..., r // 2:], -v[..., :r // 2]), -1)
        out = rot * c + turned
    else:
        if interleaved:
            turned = jnp.stack((-rot[..., 1::2], rot[..., ::2]), -1).reshape(rot.shape)
        else:
            turned = jnp.concatenate((-rot[..., r // 2:], rot[..., :r // 2]), -1)
        out = rot * c + turned * s
    return jnp.concatenate((out, xf[..., r:]), -1).astype(x.dtype)


def _reference(q, k, cos, sin):
    cos, sin = cos[:, :, None], sin[:, :, None]  # (batch, seq, 1, dim): q is (b, s, h, d)
    half = cos.shape[-1] // 2

    def rotate(x):
        rotated = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
        return (x * cos + rotated * sin).astype(x.dtype)
    return rotate(q), rotate(k)


def bench_case(shape, dtype) -> Case:
    """Against Hugging Face's formula in jnp under jit, q and k (batch, seq, heads, head_dim)."""
    b, s, h, hk, d = shape
    q = jax.random.normal(jax.random.key(0), (b, s, h, d), dtype)
    k = jax.random.normal(jax.random.key(1), (b, s, hk, d), dtype)
    theta = jnp.arange(s)[:, None] / 10000 ** (jnp.arange(0, d, 2) / d)
    angles = jnp.concatenate([theta, theta], -1)[None]
    cos, sin = jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)
    nbytes = (q.size + k.size) * q.dtype.itemsize
    return Case(lambda q, k: rope(q, k, cos, sin, 2), lambda q, k: _reference(q, k, cos, sin),
                [q, k], {"fwd": 2 * nbytes, "fwd+bwd": 4 * nbytes})
