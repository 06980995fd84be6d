"""FusedReLUScale for Keras 3: relu(x) * alpha in one pass (fusedlayers.relu_scale)."""

import keras

from fusedlayers import _args

from ._layer import FusedLayer, framework

__all__ = ["FusedReLUScale"]


@keras.saving.register_keras_serializable(package="fusedlayers")
class FusedReLUScale(FusedLayer):
    """y = max(x, 0) * alpha in one pass; replaces `Activation('relu')` followed by a scale.

    Input: any shape, floating; output: same shape, the layer's compute dtype.
    """

    def __init__(self, alpha: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        self.alpha = _args.real("FusedReLUScale", "alpha", alpha)

    def call(self, inputs):
        return framework("FusedReLUScale").relu_scale(inputs, self.alpha)

    def get_config(self):
        return {**super().get_config(), "alpha": self.alpha}
