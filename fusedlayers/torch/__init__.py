"""fusedlayers for PyTorch: torch.nn modules and functional ops backed by the fusedlayers::
operators (TORCH_LIBRARY, so torch.compile sees them without graph breaks). One module per op
(relu_scale, linear_gelu, layer_norm, rms_norm: the op's functions, modules and fake kernels)."""

from .._sources import NotBuiltError
from . import _op
from .fuse import FuseReport, fuse
from .layer_norm import LayerNorm, layer_norm, layer_norm_trailing
from .linear_gelu import FusedConv1DGELU, FusedLinearGELU, dense_gelu, linear_gelu
from .relu_scale import FusedReLUScale, relu_scale
from .rms_norm import RMSNorm, rms_norm

if _op.LOAD_ERROR is None:
    from . import inductor
    inductor.install()

__all__ = ["FuseReport", "FusedConv1DGELU", "FusedLinearGELU", "FusedReLUScale", "LayerNorm",
           "NotBuiltError", "RMSNorm", "dense_gelu", "fuse", "layer_norm", "layer_norm_trailing",
           "linear_gelu", "relu_scale", "rms_norm"]
