"""GeGLU on TensorFlow tensors: the FusedlayersGeglu op (backends/tensorflow/gated.cc) and its
gradient. Same contract as fusedlayers.torch.geglu; csrc/activation/gated.h checks the arguments
(InvalidArgumentError)."""

import tensorflow as tf

from ..bench.case import Case
from . import _op

__all__ = ["geglu"]


def geglu(gate, up, approximate: str = "none") -> tf.Tensor:
    """gelu(gate) * up in one pass (Shazeer 2020, arXiv:2002.05202), GELU's erf ('none') or tanh
    form: gate and up of one shape and dtype (float32/float64/float16/bfloat16), math in float32
    (float64 for float64) rounded once; the gradient recomputes GELU from gate. Returns gate's
    shape and dtype."""
    gate, up = _op.prepare("geglu", gate=gate, up=up)
    if not isinstance(approximate, str):
        raise TypeError(f"fusedlayers.geglu: approximate must be a str, got "
                        f"{type(approximate).__name__}")
    return _op.lib.fusedlayers_geglu(gate, up, approximate=approximate)


@_op.register_gradient("FusedlayersGeglu")
def _geglu_grad(op, dy):
    return _op.lib.fusedlayers_geglu_grad(dy, op.inputs[0], op.inputs[1],
                                          approximate=op.get_attr("approximate"))


def bench_case(shape, dtype: tf.DType) -> Case:
    """Against tf.nn.gelu(gate, approximate=True) * up (the tanh form, Gemma's)."""
    gate, up = _op.random(shape, dtype, seed=0), _op.random(shape, dtype, seed=1)
    nbytes = gate.shape.num_elements() * dtype.size
    return Case(lambda g, u: geglu(g, u, "tanh"), lambda g, u: tf.nn.gelu(g, approximate=True) * u,
                [gate, up], {"fwd": 3 * nbytes, "fwd+bwd": 8 * nbytes})
