"""ReLU*scale on TensorFlow tensors: the FusedlayersReluScale op (backends/tensorflow/relu_scale.cc)
and its gradient. Same contract as fusedlayers.torch.relu_scale; csrc/activation/relu_scale.h checks the
arguments (InvalidArgumentError)."""

import tensorflow as tf

from .. import _args
from ..bench.case import Case, memory_work
from . import _op

__all__ = ["relu_scale"]


def relu_scale(x, alpha: float) -> tf.Tensor:
    """y = max(x, 0) * alpha, element-wise, the same csrc kernel as the torch op: NaN stays NaN
    and the gradient at a NaN input is dy * alpha (torch's convention; tf.nn.relu's is 0).
    alpha travels as a float32 op attribute, so float64 results use alpha rounded to float32."""
    (x,) = _op.prepare("relu_scale", x=x)
    alpha = _args.real("fusedlayers.relu_scale", "alpha", alpha)
    return _op.lib.fusedlayers_relu_scale(x, alpha=alpha)[0]  # [1]: the mask for the gradient


def bench_case(shape, dtype: tf.DType) -> Case:
    """Against tf.nn.relu times alpha."""
    x = _op.random(shape, dtype)
    nbytes = x.shape.num_elements() * dtype.size
    return Case(lambda x: relu_scale(x, 0.5), lambda x: tf.nn.relu(x) * 0.5, [x],
                memory_work(nbytes, 2 * x.shape.num_elements() // 8))


@_op.register_gradient("FusedlayersReluScale")
def _relu_scale_grad(op, dy, _dmask):  # the mask is not differentiable
    return _op.lib.fusedlayers_relu_scale_grad(dy, op.outputs[1], alpha=op.get_attr("alpha"))
