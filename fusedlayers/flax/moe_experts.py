"""MoEExperts for Flax NNX: the routed experts of a mixture-of-experts block, run by
fusedlayers.jax.moe_experts (moe_permute, the grouped GEMMs: fusedlayers' grouped_gemm on CUDA's
Hopper kernels, else jax.lax.ragged_dot; swiglu / geglu, moe_unpermute)."""

import jax
import jax.numpy as jnp
from flax import nnx

from ..jax import moe_experts

__all__ = ["MoEExperts"]

_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


class MoEExperts(nnx.Module):
    """The experts of a mixture-of-experts block (Shazeer et al. 2017, arXiv:1701.06538):
    out[t] = sum_j top_k_weights[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)),
    e = top_k_index[t, j], with parameters `gate_up_proj` (num_experts, 2 * ffn_dim,
    in_features), the gate's rows first, and `down_proj` (num_experts, in_features, ffn_dim):
    transformers' layout. The router is the caller's.

    __call__(hidden_states (tokens, in_features), top_k_index (tokens, top_k) int32/int64,
    top_k_weights (tokens, top_k)) -> (tokens, in_features). dtype: the computation's (default
    the parameters'); param_dtype the parameters'; gemm: the grouped GEMMs
    (fusedlayers.jax.moe_experts' gemm: None picks). Raises ValueError for a non-positive size
    or another activation."""

    def __init__(self, in_features: int, ffn_dim: int, num_experts: int,
                 activation: str = "silu", *, dtype=None, param_dtype=jnp.float32, gemm=None,
                 kernel_init=nnx.initializers.lecun_normal(in_axis=-1, out_axis=-2,
                                                            batch_axis=(0,)),
                 rngs: nnx.Rngs):
        for name, value in (("in_features", in_features), ("ffn_dim", ffn_dim),
                            ("num_experts", num_experts)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"MoEExperts: {name} must be a positive integer, got {value!r}")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"MoEExperts: activation must be one of {', '.join(_ACTIVATIONS)}, "
                             f"got {activation!r}")
        self.activation, self.dtype, self.gemm = activation, dtype, gemm
        key = rngs.params()
        k1, k2 = jax.random.split(key)
        self.gate_up_proj = nnx.Param(kernel_init(k1, (num_experts, 2 * ffn_dim, in_features),
                                                  param_dtype))
        self.down_proj = nnx.Param(kernel_init(k2, (num_experts, in_features, ffn_dim),
                                               param_dtype))

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        dtype = self.dtype or self.gate_up_proj.value.dtype
        return moe_experts(jnp.asarray(hidden_states, dtype), top_k_index, top_k_weights,
                           self.gate_up_proj.value.astype(dtype),
                           self.down_proj.value.astype(dtype), activation=self.activation,
                           gemm=self.gemm)
