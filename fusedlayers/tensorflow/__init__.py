"""fusedlayers for TensorFlow: functional ops on tf tensors backed by the fusedlayers op library
(the same csrc kernels as the torch extension), one module per op. Keras layers are in
fusedlayers.keras."""

from .._sources import NotBuiltError
from .layer_norm import layer_norm, layer_norm_trailing
from .linear_gelu import dense_gelu, linear_gelu
from .relu_scale import relu_scale
from .rms_norm import rms_norm

__all__ = ["NotBuiltError", "dense_gelu", "layer_norm", "layer_norm_trailing", "linear_gelu",
           "relu_scale", "rms_norm"]
