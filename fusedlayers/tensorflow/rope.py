"""Rotary position embedding on TensorFlow tensors: the FusedlayersRope op
(backends/tensorflow/rope.cc) and its gradient. Same contract as fusedlayers.torch.rope;
csrc/rope/rope.h checks the arguments (InvalidArgumentError)."""

import math

import tensorflow as tf

from ..bench.case import Case
from . import _op

__all__ = ["rope"]


def rope(q, k, cos, sin, unsqueeze_dim: int = 1, interleaved: bool = False):
    """(q_embed, k_embed): Hugging Face's apply_rotary_pos_emb of q and k in one op (RoFormer,
    arXiv:2104.09864). q (batch, heads, seq, head_dim) and k (batch, kv_heads, seq, head_dim)
    (unsqueeze_dim=1; 2: (batch, seq, heads, head_dim)); cos, sin (batch or 1, seq, rotary_dim),
    float32 or q's dtype. cos and sin get no gradient (None): they are constants of the
    positions."""
    q, k, cos, sin = _op.prepare("rope", q=q, k=k, cos=cos, sin=sin)
    if isinstance(unsqueeze_dim, bool) or not isinstance(unsqueeze_dim, int):
        raise TypeError(f"fusedlayers.rope: unsqueeze_dim must be an int, got "
                        f"{type(unsqueeze_dim).__name__}")
    return tuple(_op.lib.fusedlayers_rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim,
                                          interleaved=bool(interleaved)))


@_op.register_gradient("FusedlayersRope")
def _rope_grad(op, dq_embed, dk_embed):
    dq, dk = _op.lib.fusedlayers_rope_grad(
        dq_embed, dk_embed, op.inputs[2], op.inputs[3],
        unsqueeze_dim=op.get_attr("unsqueeze_dim"), interleaved=op.get_attr("interleaved"))
    return dq, dk, None, None


def _reference(q, k, cos, sin):
    cos, sin = cos[:, None], sin[:, None]
    half = cos.shape[-1] // 2

    def rotate(x):
        rotated = tf.concat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin
    return rotate(q), rotate(k)


def bench_case(shape, dtype: tf.DType) -> Case:
    """Against Hugging Face's formula in TF ops (rotate_half)."""
    b, s, h, hk, d = shape
    q, k = _op.random((b, h, s, d), dtype, seed=0), _op.random((b, hk, s, d), dtype, seed=1)
    pos = tf.range(s, dtype=tf.float32)[:, None]
    theta = pos / tf.pow(10000.0, tf.range(0, d, 2, dtype=tf.float32) / d)
    angles = tf.concat([theta, theta], -1)[None]
    cos, sin = tf.cast(tf.cos(angles), dtype), tf.cast(tf.sin(angles), dtype)
    nbytes = (math.prod(q.shape) + math.prod(k.shape)) * dtype.size
    return Case(lambda q, k: rope(q, k, cos, sin), lambda q, k: _reference(q, k, cos, sin),
                [q, k], {"fwd": 2 * nbytes, "fwd+bwd": 4 * nbytes})
