"""SwiGLU on JAX arrays: the custom calls fusedlayers_swiglu_{forward,backward}
(backends/xla/gated_ffi.cc) under jax.custom_vjp. Same contract as fusedlayers.torch.swiglu;
csrc/activation/gated.h checks the arguments."""

import jax

from ..bench.case import Case
from . import _impl, _op
from .geglu import gated_bench_case, gated_rows

__all__ = ["swiglu"]


def swiglu(gate, up) -> jax.Array:
    """silu(gate) * up in one pass (Shazeer 2020, arXiv:2002.05202): gate and up of one shape
    and dtype (float32/float64/float16/bfloat16), math in float32 (float64 for float64) rounded
    once; the gradient saves gate and up and recomputes silu. Returns gate's shape and dtype.
    While tracing, raises TypeError for other dtypes and ValueError for mismatched shapes
    (csrc/activation/gated.h)."""
    gate, up = _op.prepare("swiglu", gate=gate, up=up)
    _op.check("swiglu", gate, up)
    return _swiglu(gate, up)


def _forward(gate, up):
    if _impl.use_xla("swiglu"):  # the same math in float32 (float64), rounded once
        acc = _op.stat_dtype(gate)
        return (jax.nn.silu(gate.astype(acc)) * up.astype(acc)).astype(gate.dtype)
    return _op.call("swiglu_forward", _op.like(gate), gate, up, roles="xx->x",
                    rows=gated_rows(gate))


@jax.custom_vjp
def _swiglu(gate, up):
    return _forward(gate, up)


def _swiglu_fwd(gate, up):
    return _forward(gate, up), (gate, up)


def _swiglu_bwd(saved, dy):
    gate, up = saved
    if _impl.use_xla("swiglu"):
        acc = _op.stat_dtype(gate)
        g, u, d = gate.astype(acc), up.astype(acc), dy.astype(acc)
        s = jax.nn.sigmoid(g)
        return ((d * u * s * (1 + g * (1 - s))).astype(gate.dtype),
                (d * g * s).astype(up.dtype))
    return tuple(_op.call("swiglu_backward", (_op.like(gate), _op.like(up)), dy, gate, up,
                          roles="xxx->xx", rows=gated_rows(gate)))


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def bench_case(shape, dtype) -> Case:
    """Against jax.nn.silu(gate) * up under jit."""
    return gated_bench_case(shape, dtype, swiglu, lambda g, u: jax.nn.silu(g) * u)
