"""fusedlayers for TensorFlow: functional ops on tf tensors backed by the fusedlayers op library
(the same csrc kernels as the torch extension), one module per op of the table (fusedlayers.ops),
whose `__all__` this package exports. Keras layers are in fusedlayers.keras."""

from .. import ops as _ops
from ..errors import NotBuiltError
from .fp8 import Fp8Quantized, fp8_quantize  # the FP8 ops are not in the op table
from .fp8_gemm import fp8_gemm
from .fp8_linear import fp8_dense, fp8_linear

__all__ = ["Fp8Quantized", "NotBuiltError", "fp8_dense", "fp8_gemm", "fp8_linear", "fp8_quantize",
           *_ops.export(__name__, globals(), "tensorflow")]
