"""The residual add inside RMSNorm for Keras 3 (fusedlayers.add_rms_norm): `AddRMSNorm`, an
RMSNorm whose call takes the block's residual and returns the norm and the sum."""

import keras
from keras import ops

from ._layer import add_on_trailing_axes, framework
from .rms_norm import RMSNorm

__all__ = ["AddRMSNorm"]


@keras.saving.register_keras_serializable(package="fusedlayers")
class AddRMSNorm(RMSNorm):
    """call(x, residual) -> (y, h): h = x + residual, y = RMSNorm(h) over `axis`, in one pass
    forward and backward. Same arguments, weight (`scale`) and config as RMSNorm. y in the
    compute dtype; h in the dtype x + residual promotes to (a float32 residual stream under a
    half compute dtype stays float32)."""

    fuse_replaces = None

    def build(self, x_shape, residual_shape=None):
        super().build(x_shape)

    def call(self, x, residual):
        def add_norm(x, residual, norm_shape):
            dtype = keras.backend.result_type(x.dtype, "float32")
            scale = ops.reshape(ops.cast(self.scale, dtype), norm_shape)
            return framework("AddRMSNorm").add_rms_norm(
                x, residual, norm_shape, scale, self.epsilon, zero_centered=self.zero_centered)

        y, h = add_on_trailing_axes(x, residual, self.axis, add_norm)
        return ops.cast(y, self.compute_dtype), h

    def compute_output_shape(self, x_shape, residual_shape=None):
        return x_shape, x_shape
