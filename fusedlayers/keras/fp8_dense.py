"""Fp8Dense for Keras 3, drop-in for `Dense(units)` (same arguments, defaults, weights `kernel`
(in, units) and `bias`, config) with its GEMMs in FP8: fp8_dense of the backend's fusedlayers
package (fusedlayers.torch, fusedlayers.jax or fusedlayers.tensorflow)."""

import dataclasses

import keras
from keras import activations, constraints, initializers, regularizers

from ..fp8_recipe import Fp8Recipe
from ._layer import FusedLayer, framework

__all__ = ["Fp8Dense"]


@keras.saving.register_keras_serializable(package="fusedlayers")
class Fp8Dense(FusedLayer):
    """activation(x @ kernel + bias) with the forward's GEMM and the backward's dgrad and wgrad
    GEMMs in FP8 as `recipe` says (a fusedlayers.Fp8Recipe or its fields as a dict; default
    blockwise E4M3). The kernel stays a variable of the variable dtype; under a mixed policy
    Keras hands the call its compute-dtype copy, as Dense computes, which is quantized each
    call (its gradient reaches the float32 variable through that cast). Sizes
    off the FP8 GEMMs' rule (in_features or units not multiples of 16) compute as Dense does.
    On TensorFlow the FP8 ops run outside XLA (compile the model with jit_compile=False) and the
    GEMM on the CPU. Input (..., in_features) -> output (..., units)."""

    def __init__(self, units: int, activation=None, use_bias: bool = True,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros",
                 kernel_regularizer=None, bias_regularizer=None, activity_regularizer=None,
                 kernel_constraint=None, bias_constraint=None, recipe=None, **kwargs):
        if not isinstance(units, int) or units <= 0:
            raise ValueError(f"Fp8Dense: units must be a positive integer, got {units!r}")
        super().__init__(activity_regularizer=activity_regularizer, **kwargs)
        self.units, self.use_bias = units, use_bias
        self.activation = activations.get(activation)
        self.recipe = Fp8Recipe(**recipe) if isinstance(recipe, dict) else recipe or Fp8Recipe()
        self.kernel_initializer = initializers.get(kernel_initializer)
        self.bias_initializer = initializers.get(bias_initializer)
        self.kernel_regularizer = regularizers.get(kernel_regularizer)
        self.bias_regularizer = regularizers.get(bias_regularizer)
        self.kernel_constraint = constraints.get(kernel_constraint)
        self.bias_constraint = constraints.get(bias_constraint)
        self.input_spec = keras.layers.InputSpec(min_ndim=2)
        self.supports_masking = True

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
        # .value: the variable in the compute dtype inside call (Keras' autocast)
        kernel, bias = self.kernel.value, None if self.bias is None else self.bias.value
        if self.kernel.shape[0] % 16 or self.units % 16:
            y = keras.ops.matmul(inputs, keras.ops.cast(kernel, self.compute_dtype))
            if bias is not None:
                y = y + keras.ops.cast(bias, self.compute_dtype)
        else:
            y = framework("Fp8Dense").fp8_dense(keras.ops.cast(inputs, self.compute_dtype),
                                                kernel, bias, self.recipe)
        return self.activation(y) if self.activation is not None else y

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], self.units)

    def get_config(self):
        return {
            **super().get_config(),
            "units": self.units,
            "activation": activations.serialize(self.activation),
            "use_bias": self.use_bias,
            "recipe": dataclasses.asdict(self.recipe),
            "kernel_initializer": initializers.serialize(self.kernel_initializer),
            "bias_initializer": initializers.serialize(self.bias_initializer),
            "kernel_regularizer": regularizers.serialize(self.kernel_regularizer),
            "bias_regularizer": regularizers.serialize(self.bias_regularizer),
            "kernel_constraint": constraints.serialize(self.kernel_constraint),
            "bias_constraint": constraints.serialize(self.bias_constraint),
        }
