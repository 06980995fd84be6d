"""fusedlayers for Flax: NNX modules drop-in for flax.nnx's (same constructor arguments,
defaults and parameters), on fusedlayers.jax's ops, for the ops that have one (fusedlayers.ops)."""

from .. import ops as _ops
from .fp8_linear import Fp8Linear  # the FP8 ops are not in the op table

__all__ = ["Fp8Linear", *_ops.export(__name__, globals(), "flax", optional=True)]
