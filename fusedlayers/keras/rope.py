"""RotaryEmbedding for Keras 3: KerasHub's `keras_hub.layers.RotaryEmbedding` (same constructor,
call and config; KerasHub not needed) with the rotation as one fused op (fusedlayers.rope) on
every backend."""

import keras
from keras import ops

from ._layer import FusedLayer, framework

__all__ = ["RotaryEmbedding"]


@keras.saving.register_keras_serializable(package="fusedlayers")
class RotaryEmbedding(FusedLayer):
    """Rotary position embedding (Su et al. 2021, RoFormer, arXiv:2104.09864) of one tensor, as
    KerasHub's layer: `call(inputs, start_index=0, positions=None)` rotates `inputs` along
    `feature_axis` by angles position / max_wavelength^(2i / dim) / scaling_factor, positions
    counted along `sequence_axis` from start_index (or given: (seq,) or (batch, seq)), in the
    rotate_half layout. Input of any rank >= 3 with batch first; output of its shape and dtype.
    cos and sin are computed in float32 and cast to the compute dtype, as KerasHub does."""

    def __init__(self, max_wavelength=10000, scaling_factor=1.0, sequence_axis=1,
                 feature_axis=-1, **kwargs):
        super().__init__(**kwargs)
        self.max_wavelength = max_wavelength
        self.scaling_factor = scaling_factor
        self.sequence_axis = sequence_axis
        self.feature_axis = feature_axis
        self.built = True

    def call(self, inputs, start_index=0, positions=None):
        x = ops.moveaxis(inputs, (self.feature_axis, self.sequence_axis), (-1, 1))
        shape = ops.shape(x)
        dim = shape[-1]
        heads = 1
        for d in shape[2:-1]:
            heads *= d
        x = ops.reshape(x, (shape[0], shape[1], heads, dim))
        cos, sin = self._cos_sin(shape[1], dim, start_index, positions)
        no_heads = x[:, :, :0]  # the op rotates q and k: here k has no heads
        y = framework("RotaryEmbedding").rope(x, no_heads, cos, sin, 2)[0]
        y = ops.reshape(y, shape)
        return ops.moveaxis(y, (-1, 1), (self.feature_axis, self.sequence_axis))

    def _cos_sin(self, seq, dim, start_index, positions):
        inverse_freq = 1.0 / ops.power(
            ops.cast(self.max_wavelength, "float32"),
            ops.arange(0, dim, 2, dtype="float32") / ops.cast(dim, "float32"))
        if positions is None:
            positions = ops.arange(seq, dtype="float32") + ops.cast(start_index, "float32")
        positions = ops.cast(positions, "float32") / ops.cast(self.scaling_factor, "float32")
        if len(positions.shape) == 1:
            positions = positions[None]
        freq = positions[..., None] * inverse_freq  # (batch or 1, seq, dim / 2)
        angles = ops.concatenate([freq, freq], axis=-1)
        return (ops.cast(ops.cos(angles), self.compute_dtype),
                ops.cast(ops.sin(angles), self.compute_dtype))

    def get_config(self):
        return {**super().get_config(), "max_wavelength": self.max_wavelength,
                "scaling_factor": self.scaling_factor, "sequence_axis": self.sequence_axis,
                "feature_axis": self.feature_axis}
