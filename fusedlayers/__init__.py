"""fusedlayers: fused ReLU*scale, Linear+GELU, LayerNorm and RMSNorm for PyTorch and TensorFlow,
forward and backward, from one set of C++ kernels (csrc/).

The functions here pick the framework from the type of their first argument, so the same call
works on any supported tensor. Importing fusedlayers imports no framework: the backend of a
framework is loaded the first time one of its tensors is seen.
"""

import sys
from collections.abc import Sequence

from ._sources import NotBuiltError

__version__ = "0.1.0"
# The public ops, each a function below and in every framework backend (fusedlayers.torch,
# fusedlayers.tensorflow) under the same name.
OPS = ("relu_scale", "linear_gelu", "layer_norm", "rms_norm")
__all__ = [*OPS, "NotBuiltError"]


def _backend(x, op: str, **others):
    """The framework backend (fusedlayers.torch or fusedlayers.tensorflow) for x. Raises
    TypeError for other types of x, and when one of `others` (the op's other tensors, None where absent) is a tensor of another
    framework: a torch op takes torch tensors only; a TensorFlow op takes anything
    tf.convert_to_tensor does (NumPy arrays, lists), but not a torch tensor."""
    # x cannot be a tensor of a framework that is not imported yet.
    torch = sys.modules.get("torch")
    tf = sys.modules.get("tensorflow")
    if torch is not None and isinstance(x, torch.Tensor):
        for name, t in others.items():
            if t is not None and not isinstance(t, torch.Tensor):
                raise TypeError(f"fusedlayers.{op}: x is a torch.Tensor, so {name} must be one "
                                f"too, got {_type_name(t)}")
        from . import torch as backend
        return backend
    if tf is not None and isinstance(x, (tf.Tensor, tf.Variable)):
        for name, t in others.items():
            if torch is not None and isinstance(t, torch.Tensor):
                raise TypeError(f"fusedlayers.{op}: x is a TensorFlow tensor, so {name} must "
                                f"not be a torch.Tensor")
        from . import tensorflow as backend
        return backend
    raise TypeError(f"fusedlayers.{op}: x must be a torch.Tensor, tf.Tensor or tf.Variable, "
                    f"got {_type_name(x)}")


def _type_name(value) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def relu_scale(x, alpha: float):
    """y = max(x, 0) * alpha. See fusedlayers.torch.relu_scale (or
    fusedlayers.tensorflow.relu_scale) for shapes and errors."""
    return _backend(x, "relu_scale").relu_scale(x, alpha)


def linear_gelu(x, weight, bias=None, approximate: str = "none"):
    """y = gelu(x @ weight^T + bias), weight (out_features, in_features); approximate 'none'
    (erf) or 'tanh'. See fusedlayers.torch.linear_gelu (or
    fusedlayers.tensorflow.linear_gelu) for shapes and errors."""
    backend = _backend(x, "linear_gelu", weight=weight, bias=bias)
    return backend.linear_gelu(x, weight, bias, approximate)


def layer_norm(x, normalized_shape: int | Sequence[int], weight=None, bias=None,
               eps: float = 1e-5):
    """Layer normalization over the trailing normalized_shape dims of x. See
    fusedlayers.torch.layer_norm for shapes, dtypes and errors."""
    backend = _backend(x, "layer_norm", weight=weight, bias=bias)
    return backend.layer_norm(x, normalized_shape, weight, bias, eps)


def rms_norm(x, normalized_shape: int | Sequence[int], weight=None, eps: float | None = None,
             zero_centered: bool = False):
    """RMS normalization over the trailing normalized_shape dims of x. See
    fusedlayers.torch.rms_norm for shapes, dtypes and errors."""
    backend = _backend(x, "rms_norm", weight=weight)
    return backend.rms_norm(x, normalized_shape, weight, eps, zero_centered)
