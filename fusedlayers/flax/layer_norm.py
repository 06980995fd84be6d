"""LayerNorm for Flax NNX, drop-in for `flax.nnx.LayerNorm` (a subclass: the same constructor,
defaults and `scale`/`bias` parameters) on fusedlayers.jax.layer_norm."""

import jax.numpy as jnp
from flax import nnx

from ..jax import layer_norm_trailing

__all__ = ["LayerNorm"]


class LayerNorm(nnx.LayerNorm):
    """flax.nnx.LayerNorm with the fused kernel when it normalizes the trailing axis and every
    feature (reduction_axes and feature_axes -1, no axis_name); flax's own computation otherwise.
    Computes in float32 at least, returns `dtype` or the promoted input dtype, as flax's."""

    def __call__(self, x, *, mask=None):
        if (mask is not None or self.axis_name is not None
                or self.reduction_axes not in (-1, (-1,)) or self.feature_axes not in (-1, (-1,))):
            return super().__call__(x, mask=mask)
        dtype = self.dtype or jnp.result_type(x, *(p[...] for p in (self.scale, self.bias)
                                                   if p is not None))
        compute = jnp.promote_types(x.dtype, dtype)
        params = jnp.promote_types(compute, jnp.float32)
        scale = None if self.scale is None else self.scale[...].astype(params)
        bias = None if self.bias is None else self.bias[...].astype(params)
        return layer_norm_trailing(x.astype(compute), 1, scale, bias, self.epsilon).astype(dtype)
