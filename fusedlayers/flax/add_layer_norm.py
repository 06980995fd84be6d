"""The residual add inside LayerNorm for Flax NNX: `AddLayerNorm`, flax.nnx.LayerNorm (a
subclass: the same constructor and `scale`/`bias` parameters) whose call takes the block's
residual, on fusedlayers.jax.add_layer_norm."""

import jax.numpy as jnp
from flax import nnx

from ..jax import add_layer_norm

__all__ = ["AddLayerNorm"]


class AddLayerNorm(nnx.LayerNorm):
    """__call__(x, residual) -> (y, h): h = x + residual (in the dtype they promote to), y =
    LayerNorm(h) as flax.nnx.LayerNorm computes it; one fused pass when it normalizes the
    trailing axis and every feature, flax's own computation after the add otherwise."""

    def __call__(self, x, residual):
        residual = residual.astype(jnp.result_type(x, residual))
        if (self.axis_name is not None or self.reduction_axes not in (-1, (-1,))
                or self.feature_axes not in (-1, (-1,))):
            h = x + residual
            return super().__call__(h), h
        dtype = self.dtype or jnp.result_type(x, *(p[...] for p in (self.scale, self.bias)
                                                   if p is not None))
        params = jnp.promote_types(jnp.promote_types(x.dtype, dtype), jnp.float32)
        scale = None if self.scale is None else self.scale[...].astype(params)
        bias = None if self.bias is None else self.bias[...].astype(params)
        y, h = add_layer_norm(x, residual, x.shape[-1], scale, bias, self.epsilon)
        return y.astype(dtype), h
