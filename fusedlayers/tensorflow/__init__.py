"""fusedlayers for TensorFlow: functional ops on tf tensors backed by the fusedlayers op library
(the same csrc kernels as the torch extension), one module per op of the table (fusedlayers.ops),
whose `__all__` this package exports. Keras layers are in fusedlayers.keras."""

from .. import ops as _ops
from ..errors import NotBuiltError

__all__ = ["NotBuiltError", *_ops.export(__name__, globals(), "tensorflow")]
