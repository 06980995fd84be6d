"""The residual add inside RMSNorm for Flax NNX: `AddRMSNorm`, flax.nnx.RMSNorm (a subclass: the
same constructor and `scale` parameter) whose call takes the block's residual, on
fusedlayers.jax.add_rms_norm."""

import jax.numpy as jnp
from flax import nnx

from ..jax import add_rms_norm

__all__ = ["AddRMSNorm"]


class AddRMSNorm(nnx.RMSNorm):
    """__call__(x, residual) -> (y, h): h = x + residual (in the dtype they promote to), y =
    RMSNorm(h) as flax.nnx.RMSNorm computes it (float32 at least, `dtype` or the promoted dtype
    out); one fused pass when it normalizes the trailing axis and every feature, flax's own
    computation after the add otherwise."""

    def __call__(self, x, residual):
        residual = residual.astype(jnp.result_type(x, residual))
        if (self.axis_name is not None or self.reduction_axes not in (-1, (-1,))
                or self.feature_axes not in (-1, (-1,))):
            h = x + residual
            return super().__call__(h), h
        dtype = self.dtype or jnp.result_type(x, *(() if self.scale is None
                                                   else (self.scale[...],)))
        params = jnp.promote_types(jnp.promote_types(x.dtype, dtype), jnp.float32)
        scale = None if self.scale is None else self.scale[...].astype(params)
        y, h = add_rms_norm(x, residual, x.shape[-1], scale, self.epsilon)
        return y.astype(dtype), h
