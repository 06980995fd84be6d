"""moe_permute on TensorFlow tensors: the FusedlayersMoePermute op (backends/tensorflow/moe.cc)
and its gradient. Same contract as fusedlayers.torch.moe_permute; csrc/moe/moe.h checks the arguments
(InvalidArgumentError). On TF's GPU outside XLA the rows move on the GPU and the route runs on the
host, where TF keeps the int32 tensors of GPU ops (top_k_index, row_index and offsets live in host
memory); under jit_compile everything runs on XLA's device."""

import math

import numpy as np
import tensorflow as tf

from ..bench.case import Case
from . import _op

__all__ = ["moe_permute"]


def index_tensor(op: str, arg: str, value, int32_only: bool = False) -> tf.Tensor:
    """An int32 or int64 tensor (int32 only where int32_only), else InvalidArgumentError."""
    t = tf.convert_to_tensor(value)
    allowed = (tf.int32,) if int32_only else (tf.int32, tf.int64)
    if t.dtype not in allowed:
        raise _op.invalid(f"fusedlayers.{op}: {arg} must be "
                          f"{'int32' if int32_only else 'int32 or int64'}, got {t.dtype.name}")
    return t


def moe_permute(x, top_k_index, num_experts: int):
    """(xs, row_index, offsets): x's token rows in expert order, as
    fusedlayers.torch.moe_permute: x (tokens, hidden) float32/float64/float16/bfloat16,
    top_k_index (tokens, top_k) int32/int64; xs (tokens * top_k, hidden), row_index
    (tokens * top_k,) int32, offsets (num_experts,) int32. Differentiable in x."""
    x, = _op.prepare("moe_permute", x=x)
    idx = index_tensor("moe_permute", "top_k_index", top_k_index)
    return tuple(_op.lib.fusedlayers_moe_permute(x, idx, num_experts=int(num_experts)))


@_op.register_gradient("FusedlayersMoePermute")
def _moe_permute_grad(op, dxs, drow_index, doffsets):
    dx = _op.lib.fusedlayers_moe_permute_grad(dxs, op.inputs[1], op.outputs[1],
                                              num_experts=op.get_attr("num_experts"))
    return dx, None


def reference(x, top_k_index, num_experts: int):
    """The same in TF ops: a stable argsort by expert, the gather, a histogram."""
    flat = tf.reshape(top_k_index, [-1])
    valid = (flat >= 0) & (flat < num_experts)
    key = tf.where(valid, flat, tf.cast(num_experts, flat.dtype))
    order = tf.argsort(key, stable=True)
    k = top_k_index.shape[1]
    xs = tf.where(tf.gather(valid, order)[:, None], tf.gather(x, order // k), tf.zeros_like(x[:1]))
    return xs


def bench_routing(tokens: int, num_experts: int, top_k: int, dtype: tf.DType):
    """top_k distinct experts per token from random router logits, and their softmax weights."""
    logits = np.random.default_rng(2).standard_normal((tokens, num_experts)).astype(np.float32)
    weights, index = tf.math.top_k(tf.nn.softmax(logits, -1), top_k)
    return index, tf.cast(weights / tf.reduce_sum(weights, -1, keepdims=True), dtype)


def bench_case(shape, dtype: tf.DType) -> Case:
    """shape (tokens, hidden, num_experts, top_k), against the TF-ops form; bytes as torch's."""
    tokens, hidden, experts, top_k = shape
    x = _op.random((tokens, hidden), dtype)
    index, _ = bench_routing(tokens, experts, top_k, dtype)
    rows = math.prod(x.shape) * dtype.size
    moved = rows + top_k * rows
    return Case(lambda x: moe_permute(x, index, experts)[0],
                lambda x: reference(x, index, experts), [x],
                {"fwd": moved, "fwd+bwd": 2 * moved})
