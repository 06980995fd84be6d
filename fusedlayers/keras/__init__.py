"""fusedlayers for Keras 3: one layer module per op of the table (fusedlayers.ops), drop-in for
the Keras layers they replace, on the TensorFlow or the torch backend; `fuse(model)` swaps them
into a model's clone."""

from .. import ops as _ops
from ._layer import framework
from .fp8_dense import Fp8Dense  # the FP8 ops are not in the op table
from .fuse import fuse

__all__ = ["Fp8Dense", "framework", "fuse", *_ops.export(__name__, globals(), "keras",
                                                        optional=True)]
