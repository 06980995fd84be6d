"""fusedlayers for PyTorch: torch.nn modules and functional ops backed by the fusedlayers::
operators (TORCH_LIBRARY, so torch.compile sees them without graph breaks)."""

from ._library import ExtensionNotBuiltError
from .fuse import FuseReport, fuse
from .layers import FusedConv1DGELU, FusedLinearGELU, FusedReLUScale, LayerNorm
from .ops import dense_gelu, layer_norm, layer_norm_trailing, linear_gelu, relu_scale
from .rms_norm import RMSNorm, rms_norm

__all__ = ["ExtensionNotBuiltError", "FuseReport", "FusedConv1DGELU", "FusedLinearGELU",
           "FusedReLUScale", "LayerNorm", "dense_gelu", "fuse", "layer_norm",
           "layer_norm_trailing", "linear_gelu", "relu_scale", "RMSNorm", "rms_norm"]
