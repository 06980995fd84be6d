"""fusedlayers for TensorFlow: functional ops on tf tensors backed by the fusedlayers op library
(the same csrc kernels as the torch extension). Keras layers are in fusedlayers.keras."""

from ._library import OpLibraryNotBuiltError
from .ops import dense_gelu, layer_norm, layer_norm_trailing, linear_gelu, relu_scale
from .rms_norm import rms_norm

__all__ = ["OpLibraryNotBuiltError", "dense_gelu", "layer_norm", "layer_norm_trailing",
           "linear_gelu", "relu_scale", "rms_norm"]
