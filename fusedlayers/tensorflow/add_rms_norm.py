"""The residual add inside RMSNorm on TensorFlow tensors: the FusedlayersAddRmsNorm op
(backends/tensorflow/add_norm.cc) and its gradient. Same contract as
fusedlayers.torch.add_rms_norm; csrc/norm/add_norm.h checks the arguments (InvalidArgumentError)."""

from collections.abc import Sequence

import ml_dtypes
import tensorflow as tf

from .. import _args
from ..bench.case import Case
from . import _op

__all__ = ["add_rms_norm"]


def add_rms_norm(x, residual, normalized_shape: int | Sequence[int], weight=None,
                 eps: float | None = None, zero_centered: bool = False):
    """(y, h): h = x + residual in residual's dtype, y = rms_norm(h) in x's dtype (or with a
    gain 1 + weight with zero_centered). eps=None means the machine epsilon of x's dtype, as
    torch's; eps travels as a float32 op attribute."""
    shape = [int(d) for d in _args.normalized_shape("fusedlayers.add_rms_norm", normalized_shape)]
    tensors = {"x": x, "residual": residual, **({} if weight is None else {"weight": weight})}
    x, residual, *w = _op.prepare("add_rms_norm", **tensors)
    eps = float(ml_dtypes.finfo(x.dtype.as_numpy_dtype).eps) if eps is None else \
        _op.float32_attr("add_rms_norm", "eps", _args.real("fusedlayers.add_rms_norm", "eps",
                                                           eps))
    y, h, _ = _op.lib.fusedlayers_add_rms_norm(
        x, residual, w[0] if w else tf.zeros([0], x.dtype), normalized_shape=shape, eps=eps,
        has_weight=bool(w), zero_centered=bool(zero_centered), U=_op.stat_dtype(x))
    return y, h


def bench_case(shape, dtype: tf.DType) -> Case:
    """Against the add and keras.ops.rms_normalization."""
    from keras import ops as keras_ops
    rows, cols = shape
    x, r, w = (_op.random((rows, cols), dtype), _op.random((rows, cols), dtype, 1),
               _op.random((cols,), dtype, 2))

    def eager(x, r, w):
        h = x + r
        return keras_ops.rms_normalization(h, w, epsilon=1e-6), h
    return Case(lambda x, r, w: add_rms_norm(x, r, cols, w, 1e-6), eager, [x, r, w],
                _op.add_norm_work(x))


@_op.register_gradient("FusedlayersAddRmsNorm")
def _add_rms_norm_grad(op, dy, dh, _drstd):  # rstd is not differentiable
    _, _, weight = op.inputs
    _, h, rstd = op.outputs
    attrs = {k: op.get_attr(k) for k in ("normalized_shape", "has_weight", "zero_centered")}
    dx, dresidual, dweight = _op.lib.fusedlayers_add_rms_norm_grad(
        _op.or_zeros(dy, op.outputs[0]), _op.or_absent(dh, h), h, rstd, weight,
        has_dh=dh is not None, **attrs)
    return dx, _op.dresidual(dx, dresidual, h), dweight if attrs["has_weight"] else None
