"""fusedlayers: fused ReLU*scale, Linear+GELU and LayerNorm for PyTorch and TensorFlow, forward
and backward, from one set of C++ kernels (csrc/).

The functions here pick the framework from the type of their first argument, so the same call
works on any supported tensor. Importing fusedlayers imports no framework: the backend of a
framework is loaded the first time one of its tensors is seen.
"""

import sys
from collections.abc import Sequence

__version__ = "0.1.0"
__all__ = ["layer_norm", "linear_gelu", "relu_scale"]


def _backend(x, op: str):
    """The module implementing `op` for x's framework. Raises TypeError for other types."""
    # x cannot be a tensor of a framework that is not imported yet.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        from .torch import ops
        return ops
    tf = sys.modules.get("tensorflow")
    if tf is not None and isinstance(x, (tf.Tensor, tf.Variable)):
        from .tensorflow import ops
        return ops
    raise TypeError(f"fusedlayers.{op}: x must be a torch.Tensor, tf.Tensor or tf.Variable, "
                    f"got {type(x).__module__}.{type(x).__qualname__}")


def relu_scale(x, alpha: float):
    """y = max(x, 0) * alpha. See fusedlayers.torch.ops.relu_scale (or
    fusedlayers.tensorflow.ops.relu_scale) for shapes and errors."""
    return _backend(x, "relu_scale").relu_scale(x, alpha)


def linear_gelu(x, weight, bias=None, approximate: str = "none"):
    """y = gelu(x @ weight^T + bias), weight (out_features, in_features); approximate 'none'
    (erf) or 'tanh'. See fusedlayers.torch.ops.linear_gelu (or
    fusedlayers.tensorflow.ops.linear_gelu) for shapes and errors."""
    return _backend(x, "linear_gelu").linear_gelu(x, weight, bias, approximate)


def layer_norm(x, normalized_shape: int | Sequence[int], weight=None, bias=None,
               eps: float = 1e-5):
    """Layer normalization over the trailing normalized_shape dims of x. See
    fusedlayers.torch.ops.layer_norm for shapes, dtypes and errors."""
    return _backend(x, "layer_norm").layer_norm(x, normalized_shape, weight, bias, eps)
