"""fusedlayers for PyTorch: torch.nn modules and functional ops backed by the fusedlayers::
operators (TORCH_LIBRARY, so torch.compile sees them without graph breaks). One module per op of
the table (fusedlayers.ops), whose `__all__` this package exports: the op's function, its
modules, fake kernels, unfused reference and Inductor lowering."""

from .. import ops as _ops
from ..errors import NotBuiltError
from . import _op
from .adamw import AdamW
from .fp8 import Fp8Quantized, fp8_quantize
from .fp8_gated import fp8_gated, fp8_gated_backward
from .fp8_gemm import fp8_gemm
from .fp8_linear import Fp8Linear, fp8_dense, fp8_linear
from .fp8_mlp import fp8_gated_mlp
from .fuse import FuseReport, fuse
from .linear_cross_entropy import linear_cross_entropy

__all__ = ["AdamW", "Fp8Linear", "Fp8Quantized", "FuseReport", "NotBuiltError", "fp8_gated",
           "fp8_dense", "fp8_gated_backward", "fp8_gated_mlp", "fp8_gemm", "fp8_linear", "fp8_quantize",
           "fuse",
           "linear_cross_entropy",
           *_ops.export(__name__, globals(), "torch")]

if _op.LOAD_ERROR is None:
    from . import export, inductor
    export.install()
    inductor.install()
