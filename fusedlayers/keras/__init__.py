"""fusedlayers for Keras 3: FusedReLUScale, FusedLinearGELU and LayerNorm, drop-in for the
Keras layers they replace, on the TensorFlow or the torch backend."""

from .fuse import fuse
from .layers import FusedLinearGELU, FusedReLUScale, LayerNorm
from .rms_norm import RMSNorm

__all__ = ["FusedLinearGELU", "FusedReLUScale", "LayerNorm", "fuse", "RMSNorm"]
