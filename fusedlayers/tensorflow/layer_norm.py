"""LayerNorm on TensorFlow tensors: the FusedlayersLayerNorm op (backends/tensorflow/layer_norm.cc)
and its gradient. Same contract as fusedlayers.torch.layer_norm; csrc/layer_norm.h checks the
arguments (InvalidArgumentError)."""

from collections.abc import Sequence

import tensorflow as tf

from .. import _args
from . import _op


def layer_norm(x, normalized_shape: int | Sequence[int], weight=None, bias=None,
               eps: float = 1e-5) -> tf.Tensor:
    """Layer normalization over the trailing normalized_shape dims of x; same contract as the
    torch op (weight/bias of shape normalized_shape, x's dtype or float32 for half x). eps
    travels as a float32 op attribute (as TF's own normalization ops take it)."""
    shape = list(_args.normalized_shape("fusedlayers.layer_norm", normalized_shape))
    if any(d < 1 for d in shape):
        raise _op.invalid(f"fusedlayers.layer_norm: normalized_shape must have positive sizes, "
                          f"got {shape}")
    (xt,) = _op.prepare("layer_norm", x=x)
    rank = xt.shape.rank
    if rank is not None and (rank < len(shape) or any(
            d is not None and d != s for d, s in zip(xt.shape[rank - len(shape):], shape))):
        raise _op.invalid(f"fusedlayers.layer_norm: the last {len(shape)} dimension(s) of x must "
                          f"equal normalized_shape {shape}, got x of shape {xt.shape}")
    return layer_norm_trailing(xt, len(shape), weight, bias, eps)


def layer_norm_trailing(x, norm_ndims: int, gamma=None, beta=None, eps: float = 1e-5,
                        rms_scaling: bool = False) -> tf.Tensor:
    """Normalizes the trailing norm_ndims dims; rms_scaling as Keras' LayerNormalization's."""
    tensors = {"x": x, **({"gamma": gamma} if gamma is not None else {}),
               **({"beta": beta} if beta is not None else {})}
    x, *params = _op.prepare("layer_norm", **tensors)
    eps = _args.real("fusedlayers.layer_norm", "eps", eps)
    if not (0 <= eps <= _op.FLOAT32_MAX):  # the op attribute is float32 (NaN fails too)
        raise _op.invalid(f"fusedlayers.layer_norm: eps must be finite and >= 0 as a float32 "
                          f"(the op attribute's type), got {eps}")
    # gamma and beta share the op's type attribute P: TF would reject a mismatch with a message
    # naming neither; csrc checks every other rule.
    if len(params) == 2 and params[0].dtype != params[1].dtype:
        raise _op.invalid(f"fusedlayers.layer_norm: gamma and beta must share a dtype, got "
                          f"{params[0].dtype.name} and {params[1].dtype.name}")
    param_dtype = params[0].dtype if params else x.dtype
    absent = tf.zeros([0], param_dtype)
    gamma = params[0] if gamma is not None else absent
    beta = params[-1] if beta is not None else absent
    y, _, _ = _op.lib.fusedlayers_layer_norm(
        x, gamma, beta, norm_ndims=norm_ndims, epsilon=float(eps),
        has_gamma=gamma is not absent, has_beta=beta is not absent, rms_scaling=rms_scaling,
        U=tf.float64 if x.dtype == tf.float64 else tf.float32)
    return y


@_op.register_gradient("FusedlayersLayerNorm")
def _layer_norm_grad(op, dy, _dmean, _drstd):  # mean and rstd are not differentiable
    x, gamma, beta = op.inputs
    _, mean, rstd = op.outputs
    attrs = {k: op.get_attr(k) for k in ("norm_ndims", "has_gamma", "has_beta", "rms_scaling")}
    dx, dgamma, dbeta = _op.lib.fusedlayers_layer_norm_grad(dy, x, mean, rstd, gamma, beta,
                                                            **attrs)
    return dx, dgamma if attrs["has_gamma"] else None, dbeta if attrs["has_beta"] else None
