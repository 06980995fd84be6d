"""LayerNorm for Keras 3, drop-in for `keras.layers.LayerNormalization`: same arguments, defaults,
weights (`gamma`, `beta`), config (fusedlayers.layer_norm)."""

import keras
from keras import constraints, initializers, ops, regularizers

from ._layer import FusedLayer, framework, normalization_axis, on_trailing_axes

__all__ = ["LayerNorm"]


@keras.saving.register_keras_serializable(package="fusedlayers")
class LayerNorm(FusedLayer):
    fuse_replaces = keras.layers.LayerNormalization

    """Layer normalization over `axis`; replaces `keras.layers.LayerNormalization` with the same
    arguments, `gamma`/`beta` weights (autocast off) and outputs, for trailing and non-trailing
    axes. Computes in float32 at least and returns the compute dtype, as Keras does.
    rms_scaling=True reproduces Keras' (deprecated) variant: x * rsqrt(var(x) + epsilon) * gamma.
    Ba et al. 2016, arXiv:1607.06450.
    """

    def __init__(self, axis=-1, epsilon: float = 1e-3, center: bool = True, scale: bool = True,
                 rms_scaling: bool = False, beta_initializer="zeros", gamma_initializer="ones",
                 beta_regularizer=None, gamma_regularizer=None, beta_constraint=None,
                 gamma_constraint=None, **kwargs):
        super().__init__(**kwargs)
        self.axis = normalization_axis(axis, "LayerNorm")
        self.epsilon, self.center, self.scale = epsilon, center, scale
        self.rms_scaling = rms_scaling
        self.beta_initializer = initializers.get(beta_initializer)
        self.gamma_initializer = initializers.get(gamma_initializer)
        self.beta_regularizer = regularizers.get(beta_regularizer)
        self.gamma_regularizer = regularizers.get(gamma_regularizer)
        self.beta_constraint = constraints.get(beta_constraint)
        self.gamma_constraint = constraints.get(gamma_constraint)
        self.supports_masking = True
        self.autocast = False

    def build(self, input_shape):
        self.axis = sorted(self.axis) if isinstance(self.axis, list) else [self.axis]
        shape = tuple(input_shape[dim] for dim in self.axis)
        self.gamma = (self.add_weight(
            name="gamma", shape=shape, initializer=self.gamma_initializer,
            regularizer=self.gamma_regularizer, constraint=self.gamma_constraint,
            autocast=False) if self.scale or self.rms_scaling else None)
        self.beta = (self.add_weight(
            name="beta", shape=shape, initializer=self.beta_initializer,
            regularizer=self.beta_regularizer, constraint=self.beta_constraint,
            autocast=False) if self.center and not self.rms_scaling else None)

    def call(self, inputs):
        def norm(x, norm_shape):
            # Keras' LayerNormalization computes in float32 at least, so do the parameters.
            dtype = keras.backend.result_type(x.dtype, "float32")
            gamma = ops.cast(self.gamma, dtype) if self.gamma is not None else None
            beta = ops.cast(self.beta, dtype) if self.beta is not None else None
            # gamma/beta dims follow self.axis as Keras sorted it (negatives first, e.g.
            # [-1, 1]); Keras reshapes (not transposes) them onto the normalized dims: so do we.
            gamma = ops.reshape(gamma, norm_shape) if gamma is not None else None
            beta = ops.reshape(beta, norm_shape) if beta is not None else None
            return framework("LayerNorm").layer_norm_trailing(
                x, len(norm_shape), gamma, beta, self.epsilon, rms_scaling=self.rms_scaling)

        return ops.cast(on_trailing_axes(inputs, self.axis, norm), self.compute_dtype)

    def get_config(self):
        return {
            **super().get_config(),
            "axis": self.axis,
            "epsilon": self.epsilon,
            "center": self.center,
            "scale": self.scale,
            "rms_scaling": self.rms_scaling,
            "beta_initializer": initializers.serialize(self.beta_initializer),
            "gamma_initializer": initializers.serialize(self.gamma_initializer),
            "beta_regularizer": regularizers.serialize(self.beta_regularizer),
            "gamma_regularizer": regularizers.serialize(self.gamma_regularizer),
            "beta_constraint": constraints.serialize(self.beta_constraint),
            "gamma_constraint": constraints.serialize(self.gamma_constraint),
        }
