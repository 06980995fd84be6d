"""GeGLU on JAX arrays: the custom calls fusedlayers_geglu_{forward,backward}
(backends/xla/gated_ffi.cc) under jax.custom_vjp. Same contract as fusedlayers.torch.geglu;
csrc/activation/gated.h checks the arguments."""

from functools import partial

import jax

from ..bench.case import Case
from . import _op

__all__ = ["geglu"]


def geglu(gate, up, approximate: str = "none") -> jax.Array:
    """gelu(gate) * up in one pass (Shazeer 2020, arXiv:2002.05202), GELU's erf ('none') or tanh
    form: gate and up of one shape and dtype (float32/float64/float16/bfloat16), math in float32
    (float64 for float64) rounded once; the gradient saves gate and up and recomputes GELU.
    Returns gate's shape and dtype. While tracing, raises TypeError for other dtypes or a
    non-str approximate, ValueError for mismatched shapes or another approximate
    (csrc/activation/gated.h)."""
    gate, up = _op.prepare("geglu", gate=gate, up=up)
    if not isinstance(approximate, str):
        raise TypeError(f"fusedlayers.geglu: approximate must be a str, got "
                        f"{type(approximate).__name__}")
    _op.check("geglu", gate, up, approximate)
    return _geglu(gate, up, approximate)


def gated_rows(gate) -> int:
    """The row dims of a gated call: all but the last (elementwise, so each may be sharded),
    or the one dim of a vector."""
    return min(gate.ndim, max(gate.ndim - 1, 1))


def _forward(gate, up, approximate):
    return _op.call("geglu_forward", _op.like(gate), gate, up, roles="xx->x",
                    rows=gated_rows(gate), approximate=approximate)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _geglu(gate, up, approximate):
    return _forward(gate, up, approximate)


def _geglu_fwd(gate, up, approximate):
    return _forward(gate, up, approximate), (gate, up)


def _geglu_bwd(approximate, saved, dy):
    gate, up = saved
    return tuple(_op.call("geglu_backward", (_op.like(gate), _op.like(up)), dy, gate, up,
                          roles="xxx->xx", rows=gated_rows(gate), approximate=approximate))


_geglu.defvjp(_geglu_fwd, _geglu_bwd)


def gated_bench_case(shape, dtype, fused, eager) -> Case:
    """gate and up of (tokens, ffn): the forward reads two and writes one, the backward reads
    three and writes two."""
    gate = jax.random.normal(jax.random.key(0), shape, dtype)
    up = jax.random.normal(jax.random.key(1), shape, dtype)
    nbytes = gate.size * gate.dtype.itemsize
    return Case(fused, eager, [gate, up], {"fwd": 3 * nbytes, "fwd+bwd": 8 * nbytes})


def bench_case(shape, dtype) -> Case:
    """Against jax.nn.gelu(gate, approximate=True) * up (the tanh form, Gemma's) under jit."""
    return gated_bench_case(shape, dtype, lambda g, u: geglu(g, u, "tanh"),
                            lambda g, u: jax.nn.gelu(g, approximate=True) * u)
