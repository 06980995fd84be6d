"""moe_permute on JAX arrays: the custom calls fusedlayers_moe_permute_{forward,backward}
(backends/xla/moe_ffi.cc) under jax.custom_vjp. Same contract as fusedlayers.torch.moe_permute;
csrc/moe/moe.h has the math and checks the arguments. The calls are not partitioned: under a sharded
jit XLA hands them whole arrays."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ..bench.case import Case
from . import _op

__all__ = ["moe_permute"]


def index_array(op: str, arg: str, value, int32_only: bool = False) -> jax.Array:
    """An int32 or int64 array (int32 only where int32_only), else TypeError."""
    t = jnp.asarray(value)
    allowed = (jnp.int32,) if int32_only else (jnp.int32, jnp.int64)
    if t.dtype not in allowed:
        raise TypeError(f"fusedlayers.{op}: {arg} must be "
                        f"{'int32' if int32_only else 'int32 or int64'}, got {t.dtype}")
    return t


def moe_permute(x, top_k_index, num_experts: int):
    """(xs, row_index, offsets): x's token rows in expert order for the experts' grouped GEMMs
    (jax.lax.ragged_dot's group sizes are jnp.diff(offsets, prepend=0)), as
    fusedlayers.torch.moe_permute: x (tokens, hidden) float32/float64/float16/bfloat16,
    top_k_index (tokens, top_k) int32/int64 (an id outside [0, num_experts) reaches no expert);
    xs (tokens * top_k, hidden), row_index (tokens * top_k,) int32, offsets (num_experts,) int32.
    Stable: pairs of one expert keep their token order. Differentiable in x. While tracing,
    raises TypeError for dtypes and ValueError for shapes or num_experts (csrc/moe/moe.h)."""
    x, = _op.prepare("moe_permute", x=x)
    idx = index_array("moe_permute", "top_k_index", top_k_index)
    _op.check("moe_permute", x, tuple(idx.shape), int(num_experts))
    return _permute(x, idx, int(num_experts))


def _forward(x, idx, num_experts):
    tokens, k = idx.shape
    pairs = tokens * k
    workspace = _op.lib.fusedlayers_xla_moe_route_workspace_size(tokens, k, num_experts)
    results = (jax.ShapeDtypeStruct((pairs, x.shape[1]), x.dtype),
               jax.ShapeDtypeStruct((pairs,), jnp.int32),
               jax.ShapeDtypeStruct((num_experts,), jnp.int32),
               jax.ShapeDtypeStruct((workspace,), jnp.uint8))
    xs, row_index, offsets, _ = jax.ffi.ffi_call("fusedlayers_moe_permute_forward", results)(
        x, idx, num_experts=np.int64(num_experts))
    return xs, row_index, offsets


def gather_rows(dxs, idx, row_index, num_experts):
    """dx[t] = sum_j dxs[row(t, j)]: the permute's backward."""
    return jax.ffi.ffi_call("fusedlayers_moe_permute_backward",
                            jax.ShapeDtypeStruct((idx.shape[0], dxs.shape[1]), dxs.dtype))(
        dxs, idx, row_index, num_experts=np.int64(num_experts))


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _permute(x, idx, num_experts):
    return _forward(x, idx, num_experts)


def _permute_fwd(x, idx, num_experts):
    xs, row_index, offsets = _forward(x, idx, num_experts)
    return (xs, row_index, offsets), (idx, row_index)


def _permute_bwd(num_experts, saved, grads):
    idx, row_index = saved
    dx = gather_rows(grads[0], idx, row_index, num_experts)
    return dx, np.zeros(idx.shape, jax.dtypes.float0)


_permute.defvjp(_permute_fwd, _permute_bwd)


def reference(x, top_k_index, num_experts: int):
    """The same in jnp: a stable argsort of the pairs by expert, the gather, a histogram."""
    flat = top_k_index.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    key = jnp.where(valid, flat, num_experts)
    order = jnp.argsort(key, stable=True)
    row_index = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
    counts = jnp.bincount(key, length=num_experts + 1)[:num_experts]
    k = top_k_index.shape[1]
    xs = jnp.where(valid[order, None], x[order // k], 0).astype(x.dtype)
    return xs, row_index.astype(jnp.int32), jnp.cumsum(counts).astype(jnp.int32)


def bench_routing(tokens: int, num_experts: int, top_k: int, dtype):
    """top_k distinct experts per token from random router logits, and their softmax weights."""
    logits = jax.random.normal(jax.random.key(2), (tokens, num_experts))
    weights, index = jax.lax.top_k(jax.nn.softmax(logits, -1), top_k)
    return index, (weights / weights.sum(-1, keepdims=True)).astype(dtype)


def bench_case(shape, dtype) -> Case:
    """shape (tokens, hidden, num_experts, top_k), against the jnp form (reference) under jit;
    bytes as the torch case: x read and tokens * top_k rows written, then the reverse."""
    tokens, hidden, experts, top_k = shape
    x = jax.random.normal(jax.random.key(0), (tokens, hidden), dtype)
    index, _ = bench_routing(tokens, experts, top_k, dtype)
    rows = tokens * hidden * x.dtype.itemsize
    moved = rows + top_k * rows
    return Case(lambda x: moe_permute(x, index, experts)[0],
                lambda x: reference(x, index, experts)[0], [x],
                {"fwd": moved, "fwd+bwd": 2 * moved})
