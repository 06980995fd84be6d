"""Linear + GELU on TensorFlow tensors: TF's own matmul, then the FusedlayersLinearGeluEpilogue op
(backends/tensorflow/linear_gelu.cc: csrc's bias + GELU epilogue) and its gradient (with dbias).
Same contract as fusedlayers.torch.linear_gelu. The shapes and dtypes of x and the weight are
checked here, before TF's matmul: csrc's op sees only the matmul's output and the bias."""

import tensorflow as tf

from .. import _args
from ..bench.case import Case
from . import _op

__all__ = ["dense_gelu", "linear_gelu"]


def dense_gelu(x, kernel, bias=None, approximate: str = "none") -> tf.Tensor:
    """gelu(x @ kernel + bias) with a Keras Dense kernel (in_features, out_features)."""
    return _matmul_epilogue("linear_gelu", x, kernel, bias, approximate, transpose=False)


def linear_gelu(x, weight, bias=None, approximate: str = "none") -> tf.Tensor:
    """gelu(x @ weight^T + bias), weight (out_features, in_features) as for torch."""
    return _matmul_epilogue("linear_gelu", x, weight, bias, approximate, transpose=True)


def reference(x, weight, bias=None, approximate: str = "none") -> tf.Tensor:
    """The unfused computation linear_gelu replaces, in TF's own ops: tf.matmul over the rows,
    the bias added in x's dtype, tf.nn.gelu."""
    h = tf.matmul(tf.reshape(x, [-1, x.shape[-1]]), weight, transpose_b=True)
    if bias is not None:
        h = h + bias
    y = tf.nn.gelu(h, approximate=approximate == "tanh")
    return tf.reshape(y, tf.concat([tf.shape(x)[:-1], [weight.shape[0]]], 0))


def _matmul_epilogue(op, x, w, bias, approximate, transpose):
    tensors = {"x": x, "weight": w} if bias is None else {"x": x, "weight": w, "bias": bias}
    x, w, *b = _op.prepare(op, **tensors)
    try:
        in_features, out_features = _args.linear(
            f"fusedlayers.{op}", tuple(x.shape.as_list() if x.shape.rank is not None else [None]),
            x.dtype.name, tuple(w.shape.as_list()), w.dtype.name,
            tuple(b[0].shape.as_list()) if b else None, b[0].dtype.name if b else None,
            approximate, transpose)
    except (TypeError, ValueError) as e:
        raise _op.invalid(str(e)) from None
    h = tf.matmul(tf.reshape(x, [-1, in_features]), w, transpose_b=transpose)
    _, y = _op.lib.fusedlayers_linear_gelu_epilogue(h, b[0] if b else tf.zeros([0], x.dtype),
                                                    has_bias=bool(b), approximate=approximate)
    return tf.reshape(y, tf.concat([tf.shape(x)[:-1], [out_features]], 0))


def bench_case(shape, dtype: tf.DType) -> Case:
    """Against a Dense layer's matmul + bias + tf.nn.gelu, with Dense's (in, out) kernel; "gemm":
    the bare matmul. At a layer's scales: kernel and bias ~ N(0, 1 / in_features), so the
    pre-activation is ~ N(0, 1)."""
    m, k, n = shape
    x, kernel, b = _op.random((m, k), dtype), _op.random((k, n), dtype, 1, k ** -0.5), \
        _op.random((n,), dtype, 2, k ** -0.5)
    flops = 2 * m * n * k
    return Case(lambda x, kernel, b: dense_gelu(x, kernel, b),
                lambda x, kernel, b: tf.nn.gelu(tf.matmul(x, kernel) + b, approximate=False),
                [x, kernel, b], {"fwd": flops, "fwd+bwd": 3 * flops},
                variants={"gemm": lambda x, kernel, b: tf.matmul(x, kernel)})


@_op.register_gradient("FusedlayersLinearGeluEpilogue")
def _epilogue_grad(op, dpre, dy):
    has_bias = op.get_attr("has_bias")
    dh, dbias = _op.lib.fusedlayers_linear_gelu_epilogue_grad(dy, op.outputs[0], has_bias=has_bias,
                                                   approximate=op.get_attr("approximate"))
    if dpre is not None:  # pre is not returned by linear_gelu, but keep the math right
        dh += dpre
    return dh, dbias if has_bias else None
