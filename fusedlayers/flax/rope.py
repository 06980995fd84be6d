"""RotaryEmbedding for Flax NNX: the rotation of fusedlayers.keras.RotaryEmbedding (KerasHub's
constructor and call) as an NNX module on fusedlayers.jax.rope. Flax has no rotary module of its
own; the function fusedlayers.jax.rope takes precomputed cos/sin (Hugging Face's signature)."""

import jax.numpy as jnp
from flax import nnx

from ..jax import rope

__all__ = ["RotaryEmbedding"]


class RotaryEmbedding(nnx.Module):
    """Rotary position embedding (Su et al. 2021, RoFormer, arXiv:2104.09864) of one tensor:
    `__call__(inputs, start_index=0, positions=None)` rotates `inputs` along `feature_axis` by
    angles position / max_wavelength^(2i / dim) / scaling_factor, positions counted along
    `sequence_axis` from start_index (or given: (seq,) or (batch, seq)), in the rotate_half
    layout. Input of any rank >= 3 with batch first, an even feature size; output of its shape
    and dtype. cos and sin are computed in float32 and cast to the input's dtype. No parameters.
    Raises what fusedlayers.jax.rope raises (while tracing)."""

    def __init__(self, max_wavelength=10000, scaling_factor=1.0, sequence_axis=1,
                 feature_axis=-1):
        self.max_wavelength = max_wavelength
        self.scaling_factor = scaling_factor
        self.sequence_axis = sequence_axis
        self.feature_axis = feature_axis

    def __call__(self, inputs, start_index=0, positions=None):
        x = jnp.moveaxis(inputs, (self.feature_axis, self.sequence_axis), (-1, 1))
        shape = x.shape
        x = x.reshape(shape[0], shape[1], -1, shape[-1])  # (batch, seq, heads, dim)
        dim = shape[-1]
        inverse_freq = 1.0 / jnp.float32(self.max_wavelength) ** (
            jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
        if positions is None:
            positions = jnp.arange(shape[1], dtype=jnp.float32) + start_index
        positions = jnp.asarray(positions, jnp.float32) / self.scaling_factor
        positions = positions.reshape(-1, shape[1])  # (batch or 1, seq)
        freq = positions[..., None] * inverse_freq
        angles = jnp.concatenate([freq, freq], axis=-1)
        cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
        y = rope(x, x[:, :, :0], cos, sin, 2)[0]  # rope rotates q and k: here k has no heads
        return jnp.moveaxis(y.reshape(shape), (-1, 1), (self.feature_axis, self.sequence_axis))
