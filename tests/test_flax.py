"""fusedlayers.flax's NNX modules against flax.nnx's, where flax imports: same parameters, same
outputs and gradients (float32 and bfloat16), and flax's own path for axes the kernel does not
take."""

import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import fusedlayers.flax as flf  # noqa: E402
from _helpers import rel_err  # noqa: E402


@pytest.mark.parametrize("name", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_matches_flax(name, dtype, tol, rng):
    ref = getattr(nnx, name)(37, rngs=nnx.Rngs(0), dtype=dtype)
    fused = getattr(flf, name)(37, rngs=nnx.Rngs(0), dtype=dtype)
    assert nnx.state(ref, nnx.Param).keys() == nnx.state(fused, nnx.Param).keys()
    for module in (ref, fused):  # the same non-trivial parameters in both
        module.scale.value = jnp.asarray(rng.normal(37) + 1, jnp.float32)
        if getattr(module, "bias", None) is not None:
            module.bias.value = jnp.asarray(rng.normal(37), jnp.float32)
    x = jnp.asarray(rng.normal((5, 9, 37), loc=1.0), dtype)
    y, y_ref = fused(x), ref(x)
    assert y.dtype == y_ref.dtype
    assert rel_err(np.asarray(y, np.float32), np.asarray(y_ref, np.float32)) <= tol

    def loss(module, x):
        return (module(x).astype(jnp.float32) ** 2).sum()

    g, g_ref = nnx.grad(loss)(fused, x), nnx.grad(loss)(ref, x)
    assert rel_err(np.asarray(g.scale.value), np.asarray(g_ref.scale.value)) <= tol * 10


def test_other_axes_use_flax(rng):
    x = jnp.asarray(rng.normal((4, 6, 8)), jnp.float32)
    ref = nnx.LayerNorm(6, reduction_axes=-2, feature_axes=-2, rngs=nnx.Rngs(0))
    fused = flf.LayerNorm(6, reduction_axes=-2, feature_axes=-2, rngs=nnx.Rngs(0))
    assert rel_err(np.asarray(fused(x)), np.asarray(ref(x))) <= 1e-6
