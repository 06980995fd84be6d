"""moe_unpermute on JAX arrays: the custom calls fusedlayers_moe_unpermute_{forward,backward}
(backends/xla/moe_ffi.cc) under jax.custom_vjp. Same contract as fusedlayers.torch.moe_unpermute;
csrc/moe/moe.h has the math and checks the arguments. The calls are not partitioned."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ..bench.case import Case
from . import _op
from .moe_permute import bench_routing, index_array, moe_permute

__all__ = ["moe_unpermute"]


def moe_unpermute(ys, top_k_index, row_index, top_k_weights, num_experts: int) -> jax.Array:
    """out[t] = sum_j top_k_weights[t, j] * ys[row_index[t * top_k + j]] over the pairs that
    reach an expert, as fusedlayers.torch.moe_unpermute: ys (tokens * top_k, hidden),
    top_k_index (tokens, top_k) int32/int64 and row_index (moe_permute's, int32), top_k_weights
    (tokens, top_k) float32 or ys' dtype, or None for 1. Returns (tokens, hidden) in ys' dtype,
    summed in float32 (float64 for float64) in j order. Differentiable in ys and top_k_weights.
    While tracing, raises TypeError for dtypes and ValueError for shapes (csrc/moe/moe.h)."""
    ys, w = _op.prepare("moe_unpermute", ys=ys, top_k_weights=top_k_weights)
    idx = index_array("moe_unpermute", "top_k_index", top_k_index)
    rows = index_array("moe_unpermute", "row_index", row_index, int32_only=True)
    _op.check("moe_unpermute", ys, tuple(idx.shape), tuple(rows.shape), w, int(num_experts))
    if w is None:
        return _unpermute_unweighted(ys, idx, rows, int(num_experts))
    return _unpermute(ys, w, idx, rows, int(num_experts))


def _forward(ys, w, idx, rows, num_experts):
    return jax.ffi.ffi_call("fusedlayers_moe_unpermute_forward",
                            jax.ShapeDtypeStruct((idx.shape[0], ys.shape[1]), ys.dtype))(
        ys, idx, rows, _op.absent(ys.dtype) if w is None else w,
        num_experts=np.int64(num_experts))


def _backward(dout, ys, w, idx, rows, num_experts):
    """(dys, dweights): dweights only where ys is given."""
    results = (jax.ShapeDtypeStruct((rows.shape[0], dout.shape[1]), dout.dtype),
               jax.ShapeDtypeStruct(w.shape if ys is not None else (0,),
                                    w.dtype if w is not None else dout.dtype))
    return jax.ffi.ffi_call("fusedlayers_moe_unpermute_backward", results)(
        dout, _op.absent(dout.dtype) if ys is None else ys, idx, rows,
        _op.absent(dout.dtype) if w is None else w, num_experts=np.int64(num_experts))


_FLOAT0 = jax.dtypes.float0


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _unpermute(ys, w, idx, rows, num_experts):
    return _forward(ys, w, idx, rows, num_experts)


def _unpermute_fwd(ys, w, idx, rows, num_experts):
    return _forward(ys, w, idx, rows, num_experts), (ys, w, idx, rows)


def _unpermute_bwd(num_experts, saved, dout):
    ys, w, idx, rows = saved
    dys, dw = _backward(dout, ys, w, idx, rows, num_experts)
    return dys, dw, np.zeros(idx.shape, _FLOAT0), np.zeros(rows.shape, _FLOAT0)


_unpermute.defvjp(_unpermute_fwd, _unpermute_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _unpermute_unweighted(ys, idx, rows, num_experts):
    return _forward(ys, None, idx, rows, num_experts)


def _unweighted_fwd(ys, idx, rows, num_experts):
    return _forward(ys, None, idx, rows, num_experts), (idx, rows)


def _unweighted_bwd(num_experts, saved, dout):
    idx, rows = saved
    dys, _ = _backward(dout, None, None, idx, rows, num_experts)
    return dys, np.zeros(idx.shape, _FLOAT0), np.zeros(rows.shape, _FLOAT0)


_unpermute_unweighted.defvjp(_unweighted_fwd, _unweighted_bwd)


def reference(ys, top_k_index, row_index, top_k_weights, num_experts: int):
    """The same in jnp: the rows gathered back to token order, weighted, summed over top_k."""
    tokens, k = top_k_index.shape
    acc = jnp.float64 if ys.dtype == jnp.float64 else jnp.float32
    valid = (top_k_index >= 0) & (top_k_index < num_experts)
    rows = ys[row_index].reshape(tokens, k, ys.shape[1]).astype(acc)
    if top_k_weights is not None:
        rows = rows * top_k_weights.astype(acc)[..., None]
    return jnp.where(valid[..., None], rows, 0).sum(1).astype(ys.dtype)


def bench_case(shape, dtype) -> Case:
    """shape (tokens, hidden, num_experts, top_k), against the jnp form (reference) under jit;
    bytes as the torch case."""
    tokens, hidden, experts, top_k = shape
    index, weights = bench_routing(tokens, experts, top_k, dtype)
    x = jax.random.normal(jax.random.key(0), (tokens, hidden), dtype)
    ys, row_index, _ = moe_permute(x, index, experts)
    rows = tokens * hidden * ys.dtype.itemsize
    fwd = top_k * rows + rows
    return Case(lambda ys, w: moe_unpermute(ys, index, row_index, w, experts),
                lambda ys, w: reference(ys, index, row_index, w, experts), [ys, weights],
                {"fwd": fwd, "fwd+bwd": fwd + rows + 2 * top_k * rows})
