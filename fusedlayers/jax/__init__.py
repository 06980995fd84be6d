"""fusedlayers for JAX: functional ops on jax.Array (and inside jit, grad and vmap) backed by XLA
custom calls to the same csrc kernels as the other frameworks (backends/xla), one module per op
of the table (fusedlayers.ops), whose `__all__` this package exports."""

from .. import ops as _ops
from ..errors import NotBuiltError

__all__ = ["NotBuiltError", *_ops.export(__name__, globals(), "jax")]
