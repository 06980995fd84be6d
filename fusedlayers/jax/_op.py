"""What the JAX op modules share: the library, loaded (and its handlers registered with XLA) once
when fusedlayers.jax is first imported (without it, importing still works and the first call
raises fusedlayers.NotBuiltError), argument conversion and the custom calls.

The ops are XLA custom calls (jax.ffi.ffi_call) under jax.custom_vjp, so jit, grad and vmap
compose with them. A rule only csrc can check (shapes, parameter dtypes, eps) fails at run time
with csrc's message, as XLA reports a custom call's error (jax.errors.JaxRuntimeError,
INVALID_ARGUMENT); the dtypes csrc does not take are a TypeError here, before tracing.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import NotBuiltError
from . import _library

try:
    lib = _library.load()
    LOAD_ERROR = None
except NotBuiltError as e:  # importing must not fail; the first call does
    lib, LOAD_ERROR = None, str(e)

FLOATS = (jnp.float32, jnp.float64, jnp.float16, jnp.bfloat16)
_CSRC_DTYPES = {jnp.dtype(t): i for i, t in enumerate(FLOATS)}  # csrc's DType enum
NORM, EPILOGUE = 0, 1  # the workspace kinds of fusedlayers_xla_workspace_size


def prepare(op: str, **tensors) -> list:
    """Checks the op can run here and converts each argument (None stays None) to a floating
    jax.Array or tracer."""
    if lib is None:
        raise NotBuiltError(LOAD_ERROR)
    out = []
    for name, value in tensors.items():
        if value is None:
            out.append(None)
            continue
        t = jnp.asarray(value)
        if t.dtype not in FLOATS:
            raise TypeError(f"fusedlayers.{op}: {name} must be float32, float64, float16 or "
                            f"bfloat16, got {t.dtype}")
        out.append(t)
    return out


def call(target: str, results, *operands, vmap_method: str = "sequential", **attributes):
    """The custom call fusedlayers_<target> on operands; results: jax.ShapeDtypeStruct(s)."""
    return jax.ffi.ffi_call(f"fusedlayers_{target}", results, vmap_method=vmap_method)(
        *operands, **attributes)


def like(t) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(t.shape, t.dtype)


def stat_dtype(x):
    """The norms' statistics dtype for x (csrc/norm.h)."""
    return jnp.float64 if x.dtype == jnp.float64 else jnp.float32


def absent(dtype):
    """An operand that stands for an absent optional tensor (its has_<name> attribute is
    False)."""
    return jnp.zeros((0,), dtype)


def shape_attr(shape) -> np.ndarray:
    return np.asarray(shape, np.int64)


def workspace(kind: int, x, cols: int) -> jax.ShapeDtypeStruct:
    """The `workspace` result of a backward custom call over x viewed as rows x cols: the bytes
    the CUDA pass needs (none in a build without CUDA handlers; the CPU handlers use host memory
    of their own)."""
    rows = math.prod(x.shape) // cols if cols else 0
    size = lib.fusedlayers_xla_workspace_size(kind, rows, cols, _CSRC_DTYPES[jnp.dtype(x.dtype)])
    return jax.ShapeDtypeStruct((size,), jnp.uint8)
