"""The residual add inside LayerNorm on TensorFlow tensors: the FusedlayersAddLayerNorm op
(backends/tensorflow/add_norm.cc) and its gradient. Same contract as
fusedlayers.torch.add_layer_norm; csrc/norm/add_norm.h checks the arguments (InvalidArgumentError)."""

from collections.abc import Sequence

import tensorflow as tf

from .. import _args
from ..bench.case import Case
from . import _op

__all__ = ["add_layer_norm"]


def add_layer_norm(x, residual, normalized_shape: int | Sequence[int], weight=None, bias=None,
                   eps: float = 1e-5):
    """(y, h): h = x + residual in residual's dtype, y = layer_norm(h) in x's dtype. eps
    travels as a float32 op attribute."""
    shape = [int(d) for d in _args.normalized_shape("fusedlayers.add_layer_norm",
                                                    normalized_shape)]
    tensors = {"x": x, "residual": residual, **({} if weight is None else {"weight": weight}),
               **({} if bias is None else {"bias": bias})}
    x, residual, *params = _op.prepare("add_layer_norm", **tensors)
    eps = _op.float32_attr("add_layer_norm", "eps",
                           _args.real("fusedlayers.add_layer_norm", "eps", eps))
    # weight and bias share the op's type attribute P (as layer_norm's)
    if len(params) == 2 and params[0].dtype != params[1].dtype:
        raise _op.invalid(f"fusedlayers.add_layer_norm: weight and bias must share a dtype, got "
                          f"{params[0].dtype.name} and {params[1].dtype.name}")
    absent = tf.zeros([0], params[0].dtype if params else x.dtype)
    y, h, _, _ = _op.lib.fusedlayers_add_layer_norm(
        x, residual, params[0] if weight is not None else absent,
        params[-1] if bias is not None else absent, normalized_shape=shape, eps=float(eps),
        has_weight=weight is not None, has_bias=bias is not None, U=_op.stat_dtype(x))
    return y, h


def bench_case(shape, dtype: tf.DType) -> Case:
    """Against the add and keras.ops.layer_normalization."""
    from keras import ops as keras_ops
    rows, cols = shape
    x, r, w, b = (_op.random((rows, cols), dtype), _op.random((rows, cols), dtype, 1),
                  _op.random((cols,), dtype, 2), _op.random((cols,), dtype, 3))

    def eager(x, r, w, b):
        h = x + r
        return keras_ops.layer_normalization(h, w, b, epsilon=1e-5), h
    return Case(lambda x, r, w, b: add_layer_norm(x, r, cols, w, b), eager, [x, r, w, b],
                _op.add_norm_work(x))


@_op.register_gradient("FusedlayersAddLayerNorm")
def _add_layer_norm_grad(op, dy, dh, _dmean, _drstd):  # mean, rstd are not differentiable
    _, _, weight, bias = op.inputs
    _, h, mean, rstd = op.outputs
    attrs = {k: op.get_attr(k) for k in ("normalized_shape", "has_weight", "has_bias")}
    dx, dresidual, dweight, dbias = _op.lib.fusedlayers_add_layer_norm_grad(
        _op.or_zeros(dy, op.outputs[0]), _op.or_absent(dh, h), h, mean, rstd, weight, bias,
        has_dh=dh is not None, **attrs)
    return (dx, _op.dresidual(dx, dresidual, h), dweight if attrs["has_weight"] else None,
            dbias if attrs["has_bias"] else None)
