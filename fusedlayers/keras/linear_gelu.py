"""FusedLinearGELU for Keras 3, drop-in for `Dense(units, activation='gelu')`: same arguments,
defaults, weights (`kernel` (in, units), `bias`), config (fusedlayers.linear_gelu)."""

import keras
from keras import ops

from ._layer import DenseWeights, framework

__all__ = ["FusedLinearGELU"]


@keras.saving.register_keras_serializable(package="fusedlayers")
class FusedLinearGELU(DenseWeights):
    """gelu(x @ kernel + bias); replaces `Dense(units, activation='gelu')` (approximate=False,
    erf GELU) or its tanh form (approximate=True), with Dense's `kernel` (in, units) and `bias`.

    Input (..., in_features) -> output (..., units). Under a mixed policy the kernel stays in
    the variable dtype and computes in the compute dtype, as Dense does.
    """

    def __init__(self, units: int, use_bias: bool = True, approximate: bool = False, **kwargs):
        super().__init__(units, use_bias, **kwargs)
        self.approximate = bool(approximate)

    def call(self, inputs):
        kernel = ops.cast(self.kernel, self.compute_dtype)
        bias = ops.cast(self.bias, self.compute_dtype) if self.bias is not None else None
        return framework("FusedLinearGELU").dense_gelu(
            inputs, kernel, bias, "tanh" if self.approximate else "none")

    def get_config(self):
        return {**super().get_config(), "approximate": self.approximate}
