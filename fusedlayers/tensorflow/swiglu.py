"""SwiGLU on TensorFlow tensors: the FusedlayersSwiglu op (backends/tensorflow/gated.cc) and its
gradient. Same contract as fusedlayers.torch.swiglu; csrc/activation/gated.h checks the arguments
(InvalidArgumentError)."""

import tensorflow as tf

from ..bench.case import Case
from . import _op

__all__ = ["swiglu"]


def swiglu(gate, up) -> tf.Tensor:
    """silu(gate) * up in one pass (Shazeer 2020, arXiv:2002.05202): gate and up of one shape
    and dtype (float32/float64/float16/bfloat16), math in float32 (float64 for float64) rounded
    once; the gradient recomputes silu from gate. Returns gate's shape and dtype."""
    gate, up = _op.prepare("swiglu", gate=gate, up=up)
    return _op.lib.fusedlayers_swiglu(gate, up)


@_op.register_gradient("FusedlayersSwiglu")
def _swiglu_grad(op, dy):
    return _op.lib.fusedlayers_swiglu_grad(dy, op.inputs[0], op.inputs[1])


def bench_case(shape, dtype: tf.DType) -> Case:
    """Against tf.nn.silu(gate) * up."""
    gate, up = _op.random(shape, dtype, seed=0), _op.random(shape, dtype, seed=1)
    nbytes = gate.shape.num_elements() * dtype.size
    return Case(swiglu, lambda g, u: tf.nn.silu(g) * u, [gate, up],
                {"fwd": 3 * nbytes, "fwd+bwd": 8 * nbytes})
