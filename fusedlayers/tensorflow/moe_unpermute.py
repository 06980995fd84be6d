"""moe_unpermute on TensorFlow tensors: the FusedlayersMoeUnpermute op
(backends/tensorflow/moe.cc) and its gradient. Same contract as fusedlayers.torch.moe_unpermute;
csrc/moe/moe.h checks the arguments (InvalidArgumentError)."""

import tensorflow as tf

from ..bench.case import Case
from . import _op
from .moe_permute import bench_routing, index_tensor, moe_permute

__all__ = ["moe_unpermute"]


def moe_unpermute(ys, top_k_index, row_index, top_k_weights, num_experts: int) -> tf.Tensor:
    """out[t] = sum_j top_k_weights[t, j] * ys[row_index[t * top_k + j]], as
    fusedlayers.torch.moe_unpermute: ys (tokens * top_k, hidden), top_k_index (tokens, top_k)
    int32/int64, row_index moe_permute's (int32), top_k_weights (tokens, top_k) float32 or ys'
    dtype, or None for 1. Differentiable in ys and top_k_weights."""
    ys, = _op.prepare("moe_unpermute", ys=ys)
    if top_k_weights is None:
        w = tf.zeros([0], ys.dtype)
    else:
        w, = _op.prepare("moe_unpermute", top_k_weights=top_k_weights)
    idx = index_tensor("moe_unpermute", "top_k_index", top_k_index)
    rows = index_tensor("moe_unpermute", "row_index", row_index, int32_only=True)
    return _op.lib.fusedlayers_moe_unpermute(ys, idx, rows, w, num_experts=int(num_experts))


@_op.register_gradient("FusedlayersMoeUnpermute")
def _moe_unpermute_grad(op, dout):
    ys, idx, rows, w = op.inputs
    weighted = w.shape.num_elements() != 0
    dys, dw = _op.lib.fusedlayers_moe_unpermute_grad(
        dout, ys if weighted else tf.zeros([0], ys.dtype), idx, rows, w,
        num_experts=op.get_attr("num_experts"))
    return dys, None, None, dw if weighted else None


def reference(ys, top_k_index, row_index, top_k_weights, num_experts: int):
    """The same in TF ops: the rows gathered back, weighted, summed over top_k in float32."""
    tokens, k = top_k_index.shape
    acc = tf.float64 if ys.dtype == tf.float64 else tf.float32
    valid = (top_k_index >= 0) & (top_k_index < num_experts)
    rows = tf.cast(tf.reshape(tf.gather(ys, row_index), [tokens, k, -1]), acc)
    if top_k_weights is not None:
        rows = rows * tf.cast(top_k_weights, acc)[..., None]
    rows = tf.where(valid[..., None], rows, tf.zeros_like(rows))
    return tf.cast(tf.reduce_sum(rows, 1), ys.dtype)


def bench_case(shape, dtype: tf.DType) -> Case:
    """shape (tokens, hidden, num_experts, top_k), against the TF-ops form; bytes as torch's."""
    tokens, hidden, experts, top_k = shape
    index, weights = bench_routing(tokens, experts, top_k, dtype)
    ys, row_index, _ = moe_permute(_op.random((tokens, hidden), dtype), index, experts)
    rows = tokens * hidden * dtype.size
    fwd = top_k * rows + rows
    return Case(lambda ys, w: moe_unpermute(ys, index, row_index, w, experts),
                lambda ys, w: reference(ys, index, row_index, w, experts), [ys, weights],
                {"fwd": fwd, "fwd+bwd": fwd + rows + 2 * top_k * rows})
