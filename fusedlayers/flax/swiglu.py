"""GatedMLP for Flax NNX: a Llama-style feed-forward block, down(act(gate(x)) * up(x)), with
act(gate) * up as one fused op (fusedlayers.jax.swiglu or geglu). One module for both gated
activations, as fusedlayers.keras.GatedMLP (Flax has no such module of its own)."""

import jax.numpy as jnp
from flax import nnx

from ..jax import geglu, swiglu

__all__ = ["GatedMLP"]

_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


class GatedMLP(nnx.Module):
    """down(act(gate(x)) * up(x)) with three `nnx.Linear` submodules, `gate_proj` and `up_proj`
    (in_features -> hidden_dim) and `down_proj` (hidden_dim -> in_features), as Llama's MLP
    (activation='silu', SwiGLU) or Gemma's ('gelu_tanh', GeGLU; 'gelu' the erf form). Shazeer
    2020, "GLU Variants Improve Transformer", arXiv:2002.05202.

    Input (..., in_features) -> output of the same shape; dtype, param_dtype, kernel_init and
    use_bias are nnx.Linear's, given to all three. Raises ValueError for a non-positive
    in_features or hidden_dim, or another activation."""

    def __init__(self, in_features: int, hidden_dim: int, activation: str = "silu", *,
                 use_bias: bool = False, dtype=None, param_dtype=jnp.float32,
                 kernel_init=nnx.nn.linear.default_kernel_init, rngs: nnx.Rngs):
        for name, value in (("in_features", in_features), ("hidden_dim", hidden_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GatedMLP: {name} must be a positive integer, got {value!r}")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"GatedMLP: activation must be one of {', '.join(_ACTIVATIONS)}, "
                             f"got {activation!r}")
        self.activation = activation
        linear = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                      kernel_init=kernel_init, rngs=rngs)
        self.gate_proj = nnx.Linear(in_features, hidden_dim, **linear)
        self.up_proj = nnx.Linear(in_features, hidden_dim, **linear)
        self.down_proj = nnx.Linear(hidden_dim, in_features, **linear)

    def __call__(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.activation == "silu":
            h = swiglu(gate, up)
        else:
            h = geglu(gate, up, "tanh" if self.activation == "gelu_tanh" else "none")
        return self.down_proj(h)
