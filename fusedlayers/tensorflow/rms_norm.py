"""RMSNorm on TensorFlow tensors: the FusedlayersRmsNorm op (backends/tensorflow/rms_norm.cc) and
its gradient. Same contract as fusedlayers.torch.rms_norm; csrc/rms_norm.h checks the arguments
(InvalidArgumentError)."""

from collections.abc import Sequence

import ml_dtypes
import tensorflow as tf

from .. import _args
from . import _op


def rms_norm(x, normalized_shape: int | Sequence[int], weight=None, eps: float | None = None,
             zero_centered: bool = False) -> tf.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight (or * (1 + weight) with zero_centered) over the
    trailing normalized_shape dims of x. eps=None means the machine epsilon of x's dtype, as
    torch's; eps travels as a float32 op attribute."""
    shape = list(_args.normalized_shape("fusedlayers.rms_norm", normalized_shape))
    (xt,) = _op.prepare("rms_norm", x=x)
    rank = xt.shape.rank
    if rank is not None and (rank < len(shape) or any(
            d is not None and d != s for d, s in zip(xt.shape[rank - len(shape):], shape))):
        raise _op.invalid(f"fusedlayers.rms_norm: the last {len(shape)} dimension(s) of input "
                          f"must equal normalized_shape {shape}, got input of shape {xt.shape}")
    return rms_norm_trailing(xt, len(shape), weight, eps, zero_centered)


def rms_norm_trailing(x, norm_ndims: int, weight=None, eps: float | None = None,
                      zero_centered: bool = False) -> tf.Tensor:
    """RMSNorm of the trailing norm_ndims dims (the shape checks are the op's)."""
    tensors = {"x": x} if weight is None else {"x": x, "weight": weight}
    x, *w = _op.prepare("rms_norm", **tensors)
    # ml_dtypes' finfo knows bfloat16 (NumPy's does not)
    eps = float(ml_dtypes.finfo(x.dtype.as_numpy_dtype).eps) if eps is None else \
        _args.real("fusedlayers.rms_norm", "eps", eps)
    if not (0 <= eps <= _op.FLOAT32_MAX):  # the op attribute is float32 (NaN fails too)
        raise _op.invalid(f"fusedlayers.rms_norm: eps must be finite and >= 0 as a float32 "
                          f"(the op attribute's type), got {eps}")
    weight = w[0] if w else tf.zeros([0], x.dtype)
    y, _ = _op.lib.fusedlayers_rms_norm(
        x, weight, norm_ndims=norm_ndims, epsilon=eps, has_weight=bool(w),
        zero_centered=bool(zero_centered), U=tf.float64 if x.dtype == tf.float64 else tf.float32)
    return y


@_op.register_gradient("FusedlayersRmsNorm")
def _rms_norm_grad(op, dy, _drstd):  # rstd is not differentiable
    x, weight = op.inputs
    attrs = {k: op.get_attr(k) for k in ("norm_ndims", "has_weight", "zero_centered")}
    dx, dweight = _op.lib.fusedlayers_rms_norm_grad(dy, x, op.outputs[1], weight, **attrs)
    return dx, dweight if attrs["has_weight"] else None
