"""The fused ops on TensorFlow tensors, backed by the op library built from csrc (see
backends/tensorflow). Gradients are registered for the forward ops and call the backward ops, so
they work eagerly, in tf.function, under tf.GradientTape and in a reloaded SavedModel (importing
this module, which a reload needs anyway to load the op library, registers them).

The linear part of linear_gelu is TF's own matmul; the bias + GELU epilogue and its gradient
(with dbias) are csrc's. The ops have no XLA kernels: calling them while XLA compiles the graph
(jit_compile=True) raises a clear error.
"""

import math
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from .. import _args
from . import _library

try:
    _lib = _library.load()
    _LOAD_ERROR = None
except _library.OpLibraryNotBuiltError as e:  # importing must not fail; the first call does
    _lib, _LOAD_ERROR = None, str(e)

_FLOATS = (tf.float32, tf.float64, tf.float16, tf.bfloat16)
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _invalid(message: str) -> tf.errors.InvalidArgumentError:
    return tf.errors.InvalidArgumentError(None, None, message)


def _prepare(op: str, **tensors) -> list[tf.Tensor]:
    """Checks the op can run here and converts each argument to a floating tensor."""
    if _lib is None:
        raise _library.OpLibraryNotBuiltError(_LOAD_ERROR)
    graph = tf.compat.v1.get_default_graph()
    if getattr(graph, "_xla_compile", False) or _in_xla_context(graph):
        raise _invalid(f"fusedlayers.{op} has no XLA kernel and cannot run under "
                       f"jit_compile=True; compile this function or model with "
                       f"jit_compile=False (fusedlayers' Keras layers set supports_jit=False).")
    out = []
    for name, value in tensors.items():
        t = tf.convert_to_tensor(value)
        if t.dtype not in _FLOATS:
            raise _invalid(f"fusedlayers.{op}: {name} must be float32, float64, float16 or "
                           f"bfloat16, got {t.dtype.name}")
        out.append(t)
    return out


def _in_xla_context(graph) -> bool:
    from tensorflow.python.ops import control_flow_util
    return control_flow_util.GraphOrParentsInXlaContext(graph)


def relu_scale(x, alpha: float) -> tf.Tensor:
    """y = max(x, 0) * alpha, element-wise, the same csrc kernel as the torch op: NaN stays NaN
    and the gradient at a NaN input is dy * alpha (torch's convention; tf.nn.relu's is 0).
    alpha travels as a float32 op attribute, so float64 results use alpha rounded to float32."""
    (x,) = _prepare("relu_scale", x=x)
    alpha = _args.real("fusedlayers.relu_scale", "alpha", alpha)
    if not math.isfinite(alpha):
        raise _invalid(f"fusedlayers.relu_scale: alpha must be finite, got {alpha}")
    return _lib.fusedlayers_relu_scale(x, alpha=alpha)[0]  # [1]: the mask for the gradient


def dense_gelu(x, kernel, bias=None, approximate: str = "none") -> tf.Tensor:
    """gelu(x @ kernel + bias) with a Keras Dense kernel (in_features, out_features)."""
    return _matmul_bias_gelu("linear_gelu", x, kernel, bias, approximate, transpose=False)


def linear_gelu(x, weight, bias=None, approximate: str = "none") -> tf.Tensor:
    """gelu(x @ weight^T + bias), weight (out_features, in_features) as for torch."""
    return _matmul_bias_gelu("linear_gelu", x, weight, bias, approximate, transpose=True)


def _matmul_bias_gelu(op, x, w, bias, approximate, transpose):
    tensors = {"x": x, "weight": w} if bias is None else {"x": x, "weight": w, "bias": bias}
    x, w, *b = _prepare(op, **tensors)
    if approximate not in ("none", "tanh"):
        raise _invalid(f"fusedlayers.{op}: approximate must be 'none' or 'tanh', "
                       f"got {approximate!r}")
    if w.shape.rank != 2:
        raise _invalid(f"fusedlayers.{op}: weight must be 2-D, got shape {w.shape}")
    in_features, out_features = (w.shape[1], w.shape[0]) if transpose else tuple(w.shape)
    if x.shape.rank is not None and (x.shape.rank < 1 or x.shape[-1] not in (None, in_features)):
        raise _invalid(f"fusedlayers.{op}: the last dimension of x must equal in_features = "
                       f"{in_features}, got x of shape {x.shape}")
    for name, t in (("weight", w), *(("bias", t) for t in b)):
        if t.dtype != x.dtype:
            raise _invalid(f"fusedlayers.{op}: {name} must have x's dtype {x.dtype.name}, "
                           f"got {t.dtype.name}")
    if b and b[0].shape != (out_features,):
        raise _invalid(f"fusedlayers.{op}: bias must have shape ({out_features},), "
                       f"got {b[0].shape}")
    h = tf.matmul(tf.reshape(x, [-1, in_features]), w, transpose_b=transpose)
    _, y = _lib.fusedlayers_bias_gelu(h, b[0] if b else tf.zeros([0], x.dtype),
                                      has_bias=bool(b), approximate=approximate)
    return tf.reshape(y, tf.concat([tf.shape(x)[:-1], [out_features]], 0))


def layer_norm(x, normalized_shape: int | Sequence[int], weight=None, bias=None,
               eps: float = 1e-5) -> tf.Tensor:
    """Layer normalization over the trailing normalized_shape dims of x; same contract as the
    torch op (weight/bias of shape normalized_shape, x's dtype or float32 for half x). eps
    travels as a float32 op attribute (as TF's own normalization ops take it)."""
    shape = list(_args.normalized_shape("fusedlayers.layer_norm", normalized_shape))
    if any(d < 1 for d in shape):
        raise _invalid(f"fusedlayers.layer_norm: normalized_shape must have positive sizes, "
                       f"got {shape}")
    (xt,) = _prepare("layer_norm", x=x)
    rank = xt.shape.rank
    if rank is not None and (rank < len(shape) or any(
            d is not None and d != s for d, s in zip(xt.shape[rank - len(shape):], shape))):
        raise _invalid(f"fusedlayers.layer_norm: the last {len(shape)} dimension(s) of x must "
                       f"equal normalized_shape {shape}, got x of shape {xt.shape}")
    return layer_norm_trailing(xt, len(shape), weight, bias, eps)


def layer_norm_trailing(x, norm_ndims: int, gamma=None, beta=None, eps: float = 1e-5,
                        rms_scaling: bool = False) -> tf.Tensor:
    """Normalizes the trailing norm_ndims dims; rms_scaling as Keras' LayerNormalization's."""
    tensors = {"x": x, **({"gamma": gamma} if gamma is not None else {}),
               **({"beta": beta} if beta is not None else {})}
    x, *params = _prepare("layer_norm", **tensors)
    eps = _args.real("fusedlayers.layer_norm", "eps", eps)
    if not (0 <= eps <= _FLOAT32_MAX):  # the op attribute is float32 (NaN fails too)
        raise _invalid(f"fusedlayers.layer_norm: eps must be finite and >= 0 as a float32 "
                       f"(the op attribute's type), got {eps}")
    half = x.dtype in (tf.float16, tf.bfloat16)
    for name, t in zip([n for n in ("gamma", "beta") if n in tensors], params):
        if t.dtype != x.dtype and not (half and t.dtype == tf.float32):
            raise _invalid(f"fusedlayers.layer_norm: x is {x.dtype.name}, so {name} dtype must be "
                           f"{x.dtype.name}{' or float32' if half else ''}, got {t.dtype.name}")
    if len(params) == 2 and params[0].dtype != params[1].dtype:
        raise _invalid(f"fusedlayers.layer_norm: gamma and beta must share a dtype, got "
                       f"{params[0].dtype.name} and {params[1].dtype.name}")
    param_dtype = params[0].dtype if params else x.dtype
    absent = tf.zeros([0], param_dtype)
    gamma = params[0] if gamma is not None else absent
    beta = params[-1] if beta is not None else absent
    y, _, _ = _lib.fusedlayers_layer_norm(
        x, gamma, beta, norm_ndims=norm_ndims, epsilon=float(eps),
        has_gamma=gamma is not absent, has_beta=beta is not absent, rms_scaling=rms_scaling,
        U=tf.float64 if x.dtype == tf.float64 else tf.float32)
    return y


def _register_gradients() -> None:
    def relu_scale_grad(op, dy, _dmask):  # the mask is not differentiable
        return _lib.fusedlayers_relu_scale_grad(dy, op.outputs[1], alpha=op.get_attr("alpha"))

    def layer_norm_grad(op, dy, _dmean, _drstd):  # mean and rstd are not differentiable
        x, gamma, beta = op.inputs
        _, mean, rstd = op.outputs
        attrs = {k: op.get_attr(k) for k in ("norm_ndims", "has_gamma", "has_beta",
                                             "rms_scaling")}
        dx, dgamma, dbeta = _lib.fusedlayers_layer_norm_grad(dy, x, mean, rstd, gamma, beta,
                                                             **attrs)
        return (dx, dgamma if attrs["has_gamma"] else None,
                dbeta if attrs["has_beta"] else None)

    def bias_gelu_grad(op, dpre, dy):
        has_bias = op.get_attr("has_bias")
        dh, dbias = _lib.fusedlayers_bias_gelu_grad(dy, op.outputs[0], has_bias=has_bias,
                                                    approximate=op.get_attr("approximate"))
        if dpre is not None:  # pre is not returned by linear_gelu, but keep the math right
            dh += dpre
        return dh, dbias if has_bias else None

    for name, fn in (("FusedlayersReluScale", relu_scale_grad),
                     ("FusedlayersLayerNorm", layer_norm_grad),
                     ("FusedlayersBiasGelu", bias_gelu_grad)):
        try:
            tf.RegisterGradient(name)(fn)
        except KeyError:  # already registered in this process (module reloaded)
            pass


if _lib is not None:
    _register_gradients()
