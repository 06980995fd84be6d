"""RMSNorm for Keras 3, drop-in for `keras.layers.RMSNormalization`: same arguments, defaults,
weight (`scale`, ones, of the normalized dims), config; on the TensorFlow or the torch backend
(fusedlayers.rms_norm)."""

import keras
from keras import ops

from fusedlayers import _args

from ._layer import FusedLayer, framework, normalization_axis, on_trailing_axes

__all__ = ["RMSNorm"]


@keras.saving.register_keras_serializable(package="fusedlayers")
class RMSNorm(FusedLayer):
    """y = x / sqrt(mean(x^2) + epsilon) * scale over `axis` (an int or a list of ints);
    zero_centered=True (not in Keras) applies the gain as 1 + scale, initialised to zeros, as
    Gemma's. Input: any shape with the axes known; output: same shape, the compute dtype.
    Zhang & Sennrich 2019, arXiv:1910.07467."""

    fuse_replaces = keras.layers.RMSNormalization

    def __init__(self, axis=-1, epsilon: float = 1e-6, zero_centered: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.axis = normalization_axis(axis, "RMSNorm")
        self.epsilon = _args.real("RMSNorm", "epsilon", epsilon)
        self.zero_centered = bool(zero_centered)

    def build(self, input_shape):
        self.axis = sorted(self.axis) if isinstance(self.axis, list) else [self.axis]
        shape = tuple(input_shape[a] for a in self.axis)
        self.scale = self.add_weight(name="scale", shape=shape,
                                     initializer="zeros" if self.zero_centered else "ones")

    def call(self, inputs):
        def norm(x, norm_shape):
            # Keras' RMSNormalization computes in float32 at least, so does its scale.
            dtype = keras.backend.result_type(x.dtype, "float32")
            scale = ops.reshape(ops.cast(self.scale, dtype), norm_shape)
            return framework("RMSNorm").rms_norm(x, norm_shape, scale, self.epsilon,
                                                 zero_centered=self.zero_centered)

        return ops.cast(on_trailing_axes(inputs, self.axis, norm), self.compute_dtype)

    def get_config(self):
        return {**super().get_config(), "axis": self.axis, "epsilon": self.epsilon,
                "zero_centered": self.zero_centered}
