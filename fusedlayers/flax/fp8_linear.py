"""An FP8 Linear for Flax NNX, drop-in for `flax.nnx.Linear` (a subclass: the same constructor,
defaults, `kernel` and `bias` parameters) on fusedlayers.jax.fp8_dense."""

import jax.numpy as jnp
from flax import nnx

from ..fp8_recipe import Fp8Recipe
from ..jax.fp8_linear import fp8_dense, supports

__all__ = ["Fp8Linear"]


class Fp8Linear(nnx.Linear):
    """flax.nnx.Linear with its GEMMs in FP8 (fusedlayers.jax.fp8_dense) as `recipe` says
    (default Fp8Recipe(): blockwise E4M3, forward, dgrad and wgrad in FP8). The parameters stay
    in param_dtype (float32 masters are quantized directly, each call); the inputs are cast to
    `dtype` (or the promoted dtype, as flax's), which the output takes. Sizes off the FP8
    GEMMs' rule (in_features or out_features not multiples of 16), a preferred_element_type or
    an out_sharding run flax's own computation. Input (..., in_features) -> output
    (..., out_features)."""

    def __init__(self, in_features: int, out_features: int, *, recipe: Fp8Recipe | None = None,
                 **kwargs):
        super().__init__(in_features, out_features, **kwargs)
        self.recipe = recipe or Fp8Recipe()

    def __call__(self, inputs, out_sharding=None):
        if (out_sharding is not None or self.preferred_element_type is not None
                or not supports(self.in_features, self.out_features)):
            return super().__call__(inputs, out_sharding=out_sharding)
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        dtype = self.dtype or jnp.result_type(inputs, kernel, *(() if bias is None else (bias,)))
        return fp8_dense(inputs.astype(dtype), kernel, bias, self.recipe)
