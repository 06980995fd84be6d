"""RMSNorm for Flax NNX, drop-in for `flax.nnx.RMSNorm` (a subclass: the same constructor,
defaults and `scale` parameter) on fusedlayers.jax.rms_norm."""

import jax.numpy as jnp
from flax import nnx

from ..jax import rms_norm

__all__ = ["RMSNorm"]


class RMSNorm(nnx.RMSNorm):
    """flax.nnx.RMSNorm with the fused kernel when it normalizes the trailing axis and every
    feature (reduction_axes and feature_axes -1, no axis_name); flax's own computation otherwise.
    Computes in float32 at least, returns `dtype` or the promoted input dtype, as flax's."""

    def __call__(self, x, mask=None):
        if (mask is not None or self.axis_name is not None
                or self.reduction_axes not in (-1, (-1,)) or self.feature_axes not in (-1, (-1,))):
            return super().__call__(x, mask=mask)
        dtype = self.dtype or jnp.result_type(x, *(() if self.scale is None
                                                   else (self.scale[...],)))
        compute = jnp.promote_types(x.dtype, dtype)
        params = jnp.promote_types(compute, jnp.float32)
        scale = None if self.scale is None else self.scale[...].astype(params)
        return rms_norm(x.astype(compute), x.shape[-1], scale, self.epsilon).astype(dtype)
