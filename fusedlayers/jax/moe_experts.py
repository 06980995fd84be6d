"""The experts of a mixture-of-experts layer on JAX arrays: moe_permute, a grouped GEMM
(fusedlayers' grouped_gemm on CUDA where its Hopper kernels run, else XLA's
jax.lax.ragged_dot), the gated activation (fusedlayers' swiglu / geglu), a grouped GEMM and
moe_unpermute. Same contract as fusedlayers.torch.moe_experts."""

import jax
import jax.numpy as jnp

from ..bench.case import Case
from .geglu import geglu
from .grouped_gemm import grouped_linear
from .moe_permute import bench_routing, moe_permute
from .moe_unpermute import moe_unpermute
from .swiglu import swiglu

__all__ = ["moe_experts"]

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


def moe_experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *,
                gate_up_proj_bias=None, down_proj_bias=None, transposed: bool = False,
                activation: str = "silu", gate=None, gemm: str | None = None) -> jax.Array:
    """The routed experts of a mixture-of-experts layer (Shazeer et al. 2017, arXiv:1701.06538)
    with transformers' experts arguments, as fusedlayers.torch.moe_experts:
    hidden_states (tokens, hidden); top_k_index (tokens, top_k) int32/int64; top_k_weights
    (tokens, top_k); gate_up_proj (num_experts, 2 * ffn, hidden) with the gate's rows first
    ((num_experts, hidden, 2 * ffn) transposed), down_proj (num_experts, hidden, ffn)
    ((num_experts, ffn, hidden) transposed); biases (num_experts, 2 * ffn), (num_experts,
    hidden); activation 'silu', 'gelu' or 'gelu_tanh', or `gate`, a function of the
    up-projection's (tokens * top_k, 2 * ffn) output. The GEMMs over the experts' row groups
    (gemm): None picks fusedlayers' grouped_gemm on CUDA where its Hopper kernels take them
    (sm90, bfloat16, widths multiples of 8), else jax.lax.ragged_dot; "fusedlayers" or
    "framework" forces one. Returns (tokens, hidden) in hidden_states' dtype. Raises ValueError
    for an unknown activation or gemm and what moe_permute, the GEMMs and moe_unpermute
    raise."""
    if gate is None and activation not in ACTIVATIONS:
        raise ValueError(f"fusedlayers.moe_experts: activation must be one of "
                         f"{', '.join(ACTIVATIONS)}, got {activation!r}")
    hidden_states = jnp.asarray(hidden_states)
    num_experts = gate_up_proj.shape[0]
    xs, row_index, offsets = moe_permute(hidden_states, top_k_index, num_experts)
    expert = None
    if gate_up_proj_bias is not None or down_proj_bias is not None:
        rows = jnp.arange(xs.shape[0], dtype=jnp.int32)
        expert = jnp.minimum(jnp.searchsorted(offsets, rows, side="right"), num_experts - 1)
    h = grouped_linear(xs.astype(gate_up_proj.dtype), gate_up_proj, offsets, transposed, gemm)
    if gate_up_proj_bias is not None:
        h = h + gate_up_proj_bias[expert]
    if gate is not None:
        a = gate(h)
    else:
        ffn = h.shape[-1] // 2
        g, u = h[:, :ffn], h[:, ffn:]
        a = swiglu(g, u) if activation == "silu" else \
            geglu(g, u, "tanh" if activation == "gelu_tanh" else "none")
    y = grouped_linear(a.astype(down_proj.dtype), down_proj, offsets, transposed, gemm)
    if down_proj_bias is not None:
        y = y + down_proj_bias[expert]
    weights = jnp.asarray(top_k_weights)
    if weights.dtype not in (y.dtype, jnp.float32):
        weights = weights.astype(y.dtype)
    out = moe_unpermute(y, top_k_index, row_index, weights, num_experts)
    return out.astype(hidden_states.dtype)


def reference(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *,
              gate_up_proj_bias=None, down_proj_bias=None, transposed=False,
              activation="silu", gate=None):
    """The same block in jnp (the bench's XLA row): a stable argsort by expert, the gather,
    ragged_dot, the activation, ragged_dot, the inverse permutation and a weighted sum over
    the top-k."""
    acts = {"silu": jax.nn.silu, "gelu": lambda v: jax.nn.gelu(v, approximate=False),
            "gelu_tanh": lambda v: jax.nn.gelu(v, approximate=True)}
    tokens, k = top_k_index.shape
    num_experts = gate_up_proj.shape[0]
    flat = top_k_index.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    expert = flat[order]
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    w1 = gate_up_proj if transposed else jnp.swapaxes(gate_up_proj, 1, 2)
    w2 = down_proj if transposed else jnp.swapaxes(down_proj, 1, 2)
    h = jax.lax.ragged_dot(hidden_states[order // k], w1, group_sizes)
    if gate_up_proj_bias is not None:
        h = h + gate_up_proj_bias[expert]
    if gate is not None:
        a = gate(h)
    else:
        g, u = jnp.split(h, 2, axis=-1)
        a = acts[activation](g) * u
    y = jax.lax.ragged_dot(a, w2, group_sizes)
    if down_proj_bias is not None:
        y = y + down_proj_bias[expert]
    y = y * top_k_weights.reshape(-1)[order, None].astype(y.dtype)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
    return y[inverse].reshape(tokens, k, -1).sum(1).astype(hidden_states.dtype)


def bench_case(shape, dtype) -> Case:
    """shape (tokens, hidden, ffn, num_experts, top_k), against the jnp block (reference) under
    jit; "gemm": the two ragged dots alone (the floor); work: the GEMMs' flops (forward
    6 * tokens * top_k * hidden * ffn, backward twice)."""
    tokens, hidden, ffn, experts, top_k = shape
    key = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(key[0], (tokens, hidden), dtype)
    w1 = (jax.random.normal(key[1], (experts, 2 * ffn, hidden)) / hidden ** 0.5).astype(dtype)
    w2 = (jax.random.normal(key[2], (experts, hidden, ffn)) / ffn ** 0.5).astype(dtype)
    index, weights = bench_routing(tokens, experts, top_k, dtype)
    flops = 6 * tokens * top_k * hidden * ffn
    xs, _, offsets = moe_permute(x, index, experts)
    sizes = jnp.diff(offsets, prepend=0)

    def gemm(x, w, w1, w2):
        h = jax.lax.ragged_dot(xs, jnp.swapaxes(w1, 1, 2), sizes)
        return jax.lax.ragged_dot(h[:, :ffn], jnp.swapaxes(w2, 1, 2), sizes)
    return Case(lambda x, w, w1, w2: moe_experts(x, index, w, w1, w2),
                lambda x, w, w1, w2: reference(x, index, w, w1, w2), [x, weights, w1, w2],
                {"fwd": flops, "fwd+bwd": 3 * flops}, variants={"gemm": gemm})
