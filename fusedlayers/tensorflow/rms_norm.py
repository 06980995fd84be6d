"""RMSNorm on TensorFlow tensors: the FusedlayersRmsNorm op (backends/tensorflow/rms_norm.cc) and
its gradient. Same contract as fusedlayers.torch.rms_norm; csrc/norm/rms_norm.h checks the arguments
(InvalidArgumentError)."""

from collections.abc import Sequence

import ml_dtypes
import tensorflow as tf

from .. import _args
from ..bench.case import Case, memory_work
from . import _op

__all__ = ["rms_norm"]


def rms_norm(x, normalized_shape: int | Sequence[int], weight=None, eps: float | None = None,
             zero_centered: bool = False) -> tf.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight (or * (1 + weight) with zero_centered) over the
    trailing normalized_shape dims of x. eps=None means the machine epsilon of x's dtype, as
    torch's; eps travels as a float32 op attribute."""
    shape = [int(d) for d in _args.normalized_shape("fusedlayers.rms_norm", normalized_shape)]
    tensors = {"x": x} if weight is None else {"x": x, "weight": weight}
    x, *w = _op.prepare("rms_norm", **tensors)
    # ml_dtypes' finfo knows bfloat16 (NumPy's does not)
    eps = float(ml_dtypes.finfo(x.dtype.as_numpy_dtype).eps) if eps is None else \
        _op.float32_attr("rms_norm", "eps", _args.real("fusedlayers.rms_norm", "eps", eps))
    weight = w[0] if w else tf.zeros([0], x.dtype)
    y, _ = _op.lib.fusedlayers_rms_norm(
        x, weight, normalized_shape=shape, eps=eps, has_weight=bool(w),
        zero_centered=bool(zero_centered), U=_op.stat_dtype(x))
    return y


def bench_case(shape, dtype: tf.DType) -> Case:
    """Against keras.ops.rms_normalization."""
    from keras import ops as keras_ops
    rows, cols = shape
    x, w = _op.random((rows, cols), dtype), _op.random((cols,), dtype, 1)
    nbytes = x.shape.num_elements() * dtype.size
    return Case(lambda x, w: rms_norm(x, cols, w, 1e-6),
                lambda x, w: keras_ops.rms_normalization(x, w, epsilon=1e-6), [x, w],
                memory_work(nbytes, nbytes))


@_op.register_gradient("FusedlayersRmsNorm")
def _rms_norm_grad(op, dy, _drstd):  # rstd is not differentiable
    x, weight = op.inputs
    attrs = {k: op.get_attr(k) for k in ("normalized_shape", "has_weight", "zero_centered")}
    dx, dweight = _op.lib.fusedlayers_rms_norm_grad(dy, x, op.outputs[1], weight, **attrs)
    return dx, dweight if attrs["has_weight"] else None
