"""The experts of a mixture-of-experts layer on TensorFlow tensors: moe_permute, a grouped GEMM
(fusedlayers' grouped_gemm on a GPU where its Hopper kernels run, else a matmul per expert over
its rows: TensorFlow has no grouped GEMM), the gated activation (fusedlayers' swiglu / geglu) and
moe_unpermute. Same contract as fusedlayers.torch.moe_experts."""

import tensorflow as tf

from ..bench.case import Case
from . import _op
from .geglu import geglu
from .grouped_gemm import grouped_gemm, hopper
from .grouped_gemm import reference as grouped_matmul
from .moe_permute import bench_routing, moe_permute
from .moe_unpermute import moe_unpermute
from .swiglu import swiglu

__all__ = ["moe_experts"]

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
GEMMS = ("fusedlayers", "framework")


def moe_experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *,
                gate_up_proj_bias=None, down_proj_bias=None, transposed: bool = False,
                activation: str = "silu", gate=None, gemm: str | None = None) -> tf.Tensor:
    """The routed experts with transformers' experts arguments, as
    fusedlayers.torch.moe_experts (shapes, layouts, activation, gate): moe_permute, the grouped
    GEMMs, the gated activation and moe_unpermute. gemm: "fusedlayers" (grouped_gemm),
    "framework" (each expert's matmul over its row range, tf.split by the offsets) or None:
    grouped_gemm where a visible GPU runs it on its Hopper kernels (csrc's rule), else the
    matmuls. Returns (tokens, hidden) in hidden_states' dtype. Raises ValueError for an
    unknown activation or gemm and what the ops raise (InvalidArgumentError)."""
    if gate is None and activation not in ACTIVATIONS:
        raise ValueError(f"fusedlayers.moe_experts: activation must be one of "
                         f"{', '.join(ACTIVATIONS)}, got {activation!r}")
    if gemm is not None and gemm not in GEMMS:
        raise ValueError(f"fusedlayers.moe_experts: gemm must be one of {', '.join(GEMMS)} or "
                         f"None, got {gemm!r}")
    hidden_states = tf.convert_to_tensor(hidden_states)
    num_experts = int(gate_up_proj.shape[0])
    xs, row_index, offsets = moe_permute(hidden_states, top_k_index, num_experts)
    expert = None
    if gate_up_proj_bias is not None or down_proj_bias is not None:
        rows = tf.range(tf.shape(xs)[0], dtype=tf.int32)
        expert = tf.minimum(tf.searchsorted(offsets, rows, side="right"), num_experts - 1)
    h = grouped_linear(tf.cast(xs, gate_up_proj.dtype), gate_up_proj, offsets, transposed, gemm)
    if gate_up_proj_bias is not None:
        h = h + tf.gather(gate_up_proj_bias, expert)
    if gate is not None:
        a = gate(h)
    else:
        ffn = h.shape[-1] // 2
        g, u = h[:, :ffn], h[:, ffn:]
        a = swiglu(g, u) if activation == "silu" else \
            geglu(g, u, "tanh" if activation == "gelu_tanh" else "none")
    y = grouped_linear(a, down_proj, offsets, transposed, gemm)
    if down_proj_bias is not None:
        y = y + tf.gather(down_proj_bias, expert)
    weights = tf.convert_to_tensor(top_k_weights)
    if weights.dtype not in (y.dtype, tf.float32):
        weights = tf.cast(weights, y.dtype)
    return tf.cast(moe_unpermute(y, top_k_index, row_index, weights, num_experts),
                   hidden_states.dtype)


def grouped_linear(x, weight, offsets, transposed: bool, gemm: str | None):
    """The experts' GEMM (moe_experts' gemm): grouped_gemm, or a matmul per expert over its
    rows (grouped_gemm's unfused form, its `reference`)."""
    if gemm is None:
        n = weight.shape[2] if transposed else weight.shape[1]
        gemm = "fusedlayers" if x.dtype == weight.dtype and hopper(x, n, weight.shape[0]) \
            else "framework"
    if gemm == "fusedlayers":
        return grouped_gemm(x, weight, offsets, transposed=transposed)
    return grouped_matmul(x, weight, offsets, transposed)


def reference(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
              transposed=False):
    """The unfused computation, expert by expert in TF ops (SwiGLU); the experts' weights by
    tf.unstack (as grouped_gemm's reference)."""
    out = tf.zeros_like(hidden_states)
    experts = int(gate_up_proj.shape[0])
    w1, w2 = tf.unstack(gate_up_proj, num=experts), tf.unstack(down_proj, num=experts)
    for e in range(experts):
        where = tf.where(tf.equal(top_k_index, e))
        token = where[:, 0]
        h = tf.matmul(tf.gather(hidden_states, token), w1[e], transpose_b=not transposed)
        g, u = tf.split(h, 2, axis=-1)
        y = tf.matmul(tf.nn.silu(g) * u, w2[e], transpose_b=not transposed)
        w = tf.cast(tf.gather_nd(top_k_weights, where), y.dtype)[:, None]
        out = tf.tensor_scatter_nd_add(out, token[:, None], y * w)
    return out


def bench_case(shape, dtype: tf.DType) -> Case:
    """shape (tokens, hidden, ffn, num_experts, top_k), against the expert-by-expert form;
    "gemm": the two per-expert matmul sets alone (the floor); work: the GEMMs' flops."""
    tokens, hidden, ffn, experts, top_k = shape
    x = _op.random((tokens, hidden), dtype)
    w1 = _op.random((experts, 2 * ffn, hidden), dtype, seed=1, scale=hidden ** -0.5)
    w2 = _op.random((experts, hidden, ffn), dtype, seed=2, scale=ffn ** -0.5)
    index, weights = bench_routing(tokens, experts, top_k, dtype)
    flops = 6 * tokens * top_k * hidden * ffn
    xs, _, offsets = moe_permute(x, index, experts)

    def gemm(x, w, w1, w2):
        return grouped_matmul(grouped_matmul(xs, w1, offsets, False)[:, :ffn], w2, offsets, False)
    return Case(lambda x, w, w1, w2: moe_experts(x, index, w, w1, w2),
                lambda x, w, w1, w2: reference(x, index, w, w1, w2), [x, weights, w1, w2],
                {"fwd": flops, "fwd+bwd": 3 * flops}, variants={"gemm": gemm})
