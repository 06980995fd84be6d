"""Linear + GELU on TensorFlow tensors: TF's own matmul, then the FusedlayersBiasGelu op
(backends/tensorflow/bias_gelu.cc: csrc's bias + GELU epilogue) and its gradient (with dbias).
Same contract as fusedlayers.torch.linear_gelu. The shapes and dtypes of x and the weight are
checked here, before TF's matmul: csrc's op sees only the matmul's output and the bias."""

import tensorflow as tf

from . import _op


def dense_gelu(x, kernel, bias=None, approximate: str = "none") -> tf.Tensor:
    """gelu(x @ kernel + bias) with a Keras Dense kernel (in_features, out_features)."""
    return _matmul_bias_gelu("linear_gelu", x, kernel, bias, approximate, transpose=False)


def linear_gelu(x, weight, bias=None, approximate: str = "none") -> tf.Tensor:
    """gelu(x @ weight^T + bias), weight (out_features, in_features) as for torch."""
    return _matmul_bias_gelu("linear_gelu", x, weight, bias, approximate, transpose=True)


def _matmul_bias_gelu(op, x, w, bias, approximate, transpose):
    tensors = {"x": x, "weight": w} if bias is None else {"x": x, "weight": w, "bias": bias}
    x, w, *b = _op.prepare(op, **tensors)
    if approximate not in ("none", "tanh"):
        raise _op.invalid(f"fusedlayers.{op}: approximate must be 'none' or 'tanh', "
                          f"got {approximate!r}")
    if w.shape.rank != 2:
        raise _op.invalid(f"fusedlayers.{op}: weight must be 2-D, got shape {w.shape}")
    in_features, out_features = (w.shape[1], w.shape[0]) if transpose else tuple(w.shape)
    if x.shape.rank is not None and (x.shape.rank < 1 or x.shape[-1] not in (None, in_features)):
        raise _op.invalid(f"fusedlayers.{op}: the last dimension of x must equal in_features = "
                          f"{in_features}, got x of shape {x.shape}")
    for name, t in (("weight", w), *(("bias", t) for t in b)):
        if t.dtype != x.dtype:
            raise _op.invalid(f"fusedlayers.{op}: {name} must have x's dtype {x.dtype.name}, "
                              f"got {t.dtype.name}")
    if b and b[0].shape != (out_features,):
        raise _op.invalid(f"fusedlayers.{op}: bias must have shape ({out_features},), "
                          f"got {b[0].shape}")
    h = tf.matmul(tf.reshape(x, [-1, in_features]), w, transpose_b=transpose)
    _, y = _op.lib.fusedlayers_bias_gelu(h, b[0] if b else tf.zeros([0], x.dtype),
                                      has_bias=bool(b), approximate=approximate)
    return tf.reshape(y, tf.concat([tf.shape(x)[:-1], [out_features]], 0))


@_op.register_gradient("FusedlayersBiasGelu")
def _bias_gelu_grad(op, dpre, dy):
    has_bias = op.get_attr("has_bias")
    dh, dbias = _op.lib.fusedlayers_bias_gelu_grad(dy, op.outputs[0], has_bias=has_bias,
                                                   approximate=op.get_attr("approximate"))
    if dpre is not None:  # pre is not returned by linear_gelu, but keep the math right
        dh += dpre
    return dh, dbias if has_bias else None
