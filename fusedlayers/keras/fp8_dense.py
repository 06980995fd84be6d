"""Fp8Dense for Keras 3, drop-in for `Dense(units)` (same arguments, defaults, weights `kernel`
(in, units) and `bias`, config) with its GEMMs in FP8: fp8_dense of the backend's fusedlayers
package (fusedlayers.torch, fusedlayers.jax or fusedlayers.tensorflow)."""

import dataclasses

import keras
from keras import activations
from keras.src.backend.common.symbolic_scope import in_symbolic_scope

from ..fp8_recipe import Fp8Recipe
from ._layer import DenseWeights, framework

__all__ = ["Fp8Dense"]


@keras.saving.register_keras_serializable(package="fusedlayers")
class Fp8Dense(DenseWeights):
    """activation(x @ kernel + bias) with the forward's GEMM and the backward's dgrad and wgrad
    GEMMs in FP8 as `recipe` says (a fusedlayers.Fp8Recipe or its fields as a dict; default
    blockwise E4M3). The kernel stays a variable of the variable dtype; under a mixed policy
    Keras hands the call its compute-dtype copy, as Dense computes, which is quantized each
    call (its gradient reaches the float32 variable through that cast). Sizes
    off the FP8 GEMMs' rule (in_features or units not multiples of 16) compute as Dense does, as
    does Keras' shape inference (its symbolic scope: a functional model's construction, which
    on JAX traces symbolic batch sizes; nothing computed there runs).
    On TensorFlow the FP8 ops run outside XLA (compile the model with jit_compile=False) and the
    GEMM on the CPU. Input (..., in_features) -> output (..., units)."""

    def __init__(self, units: int, activation=None, use_bias: bool = True, recipe=None,
                 **kwargs):
        super().__init__(units, use_bias, **kwargs)
        self.activation = activations.get(activation)
        self.recipe = Fp8Recipe(**recipe) if isinstance(recipe, dict) else recipe or Fp8Recipe()

    def call(self, inputs):
        # .value: the variable in the compute dtype inside call (Keras' autocast)
        kernel, bias = self.kernel.value, None if self.bias is None else self.bias.value
        if self.kernel.shape[0] % 16 or self.units % 16 or in_symbolic_scope():
            y = keras.ops.matmul(inputs, keras.ops.cast(kernel, self.compute_dtype))
            if bias is not None:
                y = y + keras.ops.cast(bias, self.compute_dtype)
        else:
            y = framework("Fp8Dense").fp8_dense(keras.ops.cast(inputs, self.compute_dtype),
                                                kernel, bias, self.recipe)
        return self.activation(y) if self.activation is not None else y

    def get_config(self):
        return {**super().get_config(), "activation": activations.serialize(self.activation),
                "recipe": dataclasses.asdict(self.recipe)}
