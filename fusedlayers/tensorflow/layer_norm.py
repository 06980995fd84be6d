"""LayerNorm on TensorFlow tensors: the FusedlayersLayerNorm op (backends/tensorflow/layer_norm.cc)
and its gradient. Same contract as fusedlayers.torch.layer_norm; csrc/norm/layer_norm.h checks the
arguments (InvalidArgumentError)."""

from collections.abc import Sequence

import tensorflow as tf

from .. import _args
from ..bench.case import Case, memory_work
from . import _op

__all__ = ["layer_norm", "layer_norm_trailing"]


def layer_norm(x, normalized_shape: int | Sequence[int], weight=None, bias=None,
               eps: float = 1e-5) -> tf.Tensor:
    """Layer normalization over the trailing normalized_shape dims of x; same contract as the
    torch op (weight/bias of shape normalized_shape, x's dtype or float32 for half x). eps
    travels as a float32 op attribute (as TF's own normalization ops take it)."""
    shape = [int(d) for d in _args.normalized_shape("fusedlayers.layer_norm", normalized_shape)]
    return _layer_norm(x, shape, weight, bias, eps, False)


def layer_norm_trailing(x, norm_ndims: int, gamma=None, beta=None, eps: float = 1e-5,
                        rms_scaling: bool = False) -> tf.Tensor:
    """Normalizes the trailing norm_ndims dims (known sizes); rms_scaling as Keras'
    LayerNormalization's."""
    (xt,) = _op.prepare("layer_norm", x=x)
    return _layer_norm(xt, _op.trailing_shape("layer_norm", xt, norm_ndims), gamma, beta, eps,
                       rms_scaling)


def _layer_norm(x, normalized_shape: list, weight, bias, eps, rms_scaling: bool) -> tf.Tensor:
    tensors = {"x": x, **({"weight": weight} if weight is not None else {}),
               **({"bias": bias} if bias is not None else {})}
    x, *params = _op.prepare("layer_norm", **tensors)
    eps = _op.float32_attr("layer_norm", "eps", _args.real("fusedlayers.layer_norm", "eps", eps))
    # weight and bias share the op's type attribute P: TF would reject a mismatch with a message
    # naming neither; csrc checks every other rule.
    if len(params) == 2 and params[0].dtype != params[1].dtype:
        raise _op.invalid(f"fusedlayers.layer_norm: weight and bias must share a dtype, got "
                          f"{params[0].dtype.name} and {params[1].dtype.name}")
    param_dtype = params[0].dtype if params else x.dtype
    absent = tf.zeros([0], param_dtype)
    weight = params[0] if weight is not None else absent
    bias = params[-1] if bias is not None else absent
    y, _, _ = _op.lib.fusedlayers_layer_norm(
        x, weight, bias, normalized_shape=normalized_shape, eps=float(eps),
        has_weight=weight is not absent, has_bias=bias is not absent, rms_scaling=rms_scaling,
        U=_op.stat_dtype(x))
    return y


def bench_case(shape, dtype: tf.DType) -> Case:
    """Against keras.ops.layer_normalization."""
    from keras import ops as keras_ops
    rows, cols = shape
    x, w, b = _op.random((rows, cols), dtype), _op.random((cols,), dtype, 1), \
        _op.random((cols,), dtype, 2)
    nbytes = x.shape.num_elements() * dtype.size
    return Case(lambda x, w, b: layer_norm(x, cols, w, b),
                lambda x, w, b: keras_ops.layer_normalization(x, w, b, epsilon=1e-5), [x, w, b],
                memory_work(nbytes, nbytes))


@_op.register_gradient("FusedlayersLayerNorm")
def _layer_norm_grad(op, dy, _dmean, _drstd):  # mean and rstd are not differentiable
    x, weight, bias = op.inputs
    _, mean, rstd = op.outputs
    attrs = {k: op.get_attr(k) for k in ("normalized_shape", "has_weight", "has_bias",
                                         "rms_scaling")}
    dx, dweight, dbias = _op.lib.fusedlayers_layer_norm_grad(dy, x, mean, rstd, weight, bias,
                                                             **attrs)
    return dx, dweight if attrs["has_weight"] else None, dbias if attrs["has_bias"] else None
