"""The residual add inside LayerNorm for Keras 3 (fusedlayers.add_layer_norm): `AddLayerNorm`,
a LayerNorm whose call takes the block's residual and returns the norm and the sum."""

import keras
from keras import ops

from ._layer import add_on_trailing_axes, framework
from .layer_norm import LayerNorm

__all__ = ["AddLayerNorm"]


@keras.saving.register_keras_serializable(package="fusedlayers")
class AddLayerNorm(LayerNorm):
    """call(x, residual) -> (y, h): h = x + residual, y = LayerNorm(h) over `axis`, in one pass
    forward and backward (BERT's LayerNorm(hidden + input_tensor)). Same arguments, weights
    (`gamma`, `beta`) and config as LayerNorm, without rms_scaling. y in the compute dtype; h in
    the dtype x + residual promotes to."""

    fuse_replaces = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.rms_scaling:
            raise ValueError("AddLayerNorm: rms_scaling must be False")

    def build(self, x_shape, residual_shape=None):
        super().build(x_shape)

    def call(self, x, residual):
        def add_norm(x, residual, norm_shape):
            dtype = keras.backend.result_type(x.dtype, "float32")
            gamma, beta = (None if p is None else ops.reshape(ops.cast(p, dtype), norm_shape)
                           for p in (self.gamma, self.beta))
            return framework("AddLayerNorm").add_layer_norm(x, residual, norm_shape, gamma, beta,
                                                            self.epsilon)

        y, h = add_on_trailing_axes(x, residual, self.axis, add_norm)
        return ops.cast(y, self.compute_dtype), h

    def compute_output_shape(self, x_shape, residual_shape=None):
        return x_shape, x_shape
