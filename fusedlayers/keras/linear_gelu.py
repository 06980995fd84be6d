"""FusedLinearGELU for Keras 3, drop-in for `Dense(units, activation='gelu')`: same arguments,
defaults, weights (`kernel` (in, units), `bias`), config (fusedlayers.linear_gelu)."""

import keras
from keras import constraints, initializers, ops, regularizers

from ._layer import FusedLayer, framework

__all__ = ["FusedLinearGELU"]


@keras.saving.register_keras_serializable(package="fusedlayers")
class FusedLinearGELU(FusedLayer):
    """gelu(x @ kernel + bias); replaces `Dense(units, activation='gelu')` (approximate=False,
    erf GELU) or its tanh form (approximate=True), with Dense's `kernel` (in, units) and `bias`.

    Input (..., in_features) -> output (..., units). Under a mixed policy the kernel stays in
    the variable dtype and computes in the compute dtype, as Dense does.
    """

    def __init__(self, units: int, use_bias: bool = True, approximate: bool = False,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros",
                 kernel_regularizer=None, bias_regularizer=None, activity_regularizer=None,
                 kernel_constraint=None, bias_constraint=None, **kwargs):
        if not isinstance(units, int) or units <= 0:
            raise ValueError(f"FusedLinearGELU: units must be a positive integer, got {units!r}")
        super().__init__(activity_regularizer=activity_regularizer, **kwargs)
        self.units, self.use_bias, self.approximate = units, use_bias, bool(approximate)
        self.kernel_initializer = initializers.get(kernel_initializer)
        self.bias_initializer = initializers.get(bias_initializer)
        self.kernel_regularizer = regularizers.get(kernel_regularizer)
        self.bias_regularizer = regularizers.get(bias_regularizer)
        self.kernel_constraint = constraints.get(kernel_constraint)
        self.bias_constraint = constraints.get(bias_constraint)
        self.input_spec = keras.layers.InputSpec(min_ndim=2)
        self.supports_masking = True  # as Dense: the mask passes through unchanged

    def build(self, input_shape):
        in_features = input_shape[-1]
        self.kernel = self.add_weight(
            name="kernel", shape=(in_features, self.units), initializer=self.kernel_initializer,
            regularizer=self.kernel_regularizer, constraint=self.kernel_constraint)
        self.bias = (self.add_weight(
            name="bias", shape=(self.units,), initializer=self.bias_initializer,
            regularizer=self.bias_regularizer, constraint=self.bias_constraint)
            if self.use_bias else None)
        self.input_spec = keras.layers.InputSpec(min_ndim=2, axes={-1: in_features})

    def call(self, inputs):
        kernel = ops.cast(self.kernel, self.compute_dtype)
        bias = ops.cast(self.bias, self.compute_dtype) if self.bias is not None else None
        return framework("FusedLinearGELU").dense_gelu(
            inputs, kernel, bias, "tanh" if self.approximate else "none")

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], self.units)

    def get_config(self):
        return {
            **super().get_config(),
            "units": self.units,
            "use_bias": self.use_bias,
            "approximate": self.approximate,
            "kernel_initializer": initializers.serialize(self.kernel_initializer),
            "bias_initializer": initializers.serialize(self.bias_initializer),
            "kernel_regularizer": regularizers.serialize(self.kernel_regularizer),
            "bias_regularizer": regularizers.serialize(self.bias_regularizer),
            "kernel_constraint": constraints.serialize(self.kernel_constraint),
            "bias_constraint": constraints.serialize(self.bias_constraint),
        }
