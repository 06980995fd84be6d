"""fusedlayers for JAX: functional ops on jax.Array (and inside jit, grad and vmap) backed by XLA
custom calls to the same csrc kernels as the other frameworks (backends/xla), one module per op
of the table (fusedlayers.ops), whose `__all__` this package exports."""

from .. import ops as _ops
from ..errors import NotBuiltError
from ._impl import set_implementation
from ._library import TARGETS as _TARGETS


def export_safety_checks() -> list:
    """What `jax.export.export(fn, disabled_checks=...)` needs to serialize a function that calls
    fusedlayers' ops: jax.export refuses custom calls without a compatibility guarantee, and
    these allow ours by name (DisabledSafetyCheck.custom_call of each fusedlayers_* target).
    Where the artifact is deserialized and run, import fusedlayers.jax first: it registers the
    targets with XLA."""
    import jax.export
    return [jax.export.DisabledSafetyCheck.custom_call(f"fusedlayers_{t}") for t in _TARGETS]


from .fp8 import Fp8Quantized, fp8_quantize  # noqa: E402  (the FP8 ops are not in the op table)
from .fp8_gemm import fp8_gemm  # noqa: E402
from .fp8_linear import fp8_dense, fp8_linear  # noqa: E402
from .linear_cross_entropy import linear_cross_entropy  # noqa: E402  (torch and JAX only so far)

__all__ = ["Fp8Quantized", "NotBuiltError", "export_safety_checks", "fp8_dense", "fp8_gemm",
           "fp8_linear", "fp8_quantize", "linear_cross_entropy", "set_implementation",
           *_ops.export(__name__, globals(), "jax")]
