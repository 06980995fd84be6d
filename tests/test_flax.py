"""fusedlayers.flax's NNX modules against flax.nnx's, where flax imports: same parameters, same
outputs and gradients (float32 and bfloat16), and flax's own path for axes the kernel does not
take."""

import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import fusedlayers.flax as flf  # noqa: E402
from _helpers import keras_hub_rotary, rel_err  # noqa: E402


@pytest.mark.parametrize("name", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_matches_flax(name, dtype, tol, rng):
    ref = getattr(nnx, name)(37, rngs=nnx.Rngs(0), dtype=dtype)
    fused = getattr(flf, name)(37, rngs=nnx.Rngs(0), dtype=dtype)
    assert nnx.state(ref, nnx.Param).keys() == nnx.state(fused, nnx.Param).keys()
    scale, bias = (jnp.asarray(rng.normal(37) + loc, jnp.float32) for loc in (1, 0))
    for module in (ref, fused):  # the same non-trivial parameters in both
        module.scale[...] = scale
        if getattr(module, "bias", None) is not None:
            module.bias[...] = bias
    x = jnp.asarray(rng.normal((5, 9, 37), loc=1.0), dtype)
    y, y_ref = fused(x), ref(x)
    assert y.dtype == y_ref.dtype
    assert rel_err(np.asarray(y, np.float32), np.asarray(y_ref, np.float32)) <= tol

    def loss(module, x):
        return (module(x).astype(jnp.float32) ** 2).sum()

    g, g_ref = nnx.grad(loss)(fused, x), nnx.grad(loss)(ref, x)
    assert rel_err(np.asarray(g.scale[...]), np.asarray(g_ref.scale[...])) <= tol * 10


def test_other_axes_use_flax(rng):
    x = jnp.asarray(rng.normal((4, 6, 8)), jnp.float32)
    ref = nnx.LayerNorm(6, reduction_axes=-2, feature_axes=-2, rngs=nnx.Rngs(0))
    fused = flf.LayerNorm(6, reduction_axes=-2, feature_axes=-2, rngs=nnx.Rngs(0))
    assert rel_err(np.asarray(fused(x)), np.asarray(ref(x))) <= 1e-6


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_gated_mlp_matches_its_unfused_formula(activation, dtype, tol, rng):
    mlp = flf.GatedMLP(24, 40, activation, dtype=dtype, rngs=nnx.Rngs(0))
    assert set(nnx.state(mlp, nnx.Param).keys()) == {"gate_proj", "up_proj", "down_proj"}
    act = {"silu": jax.nn.silu, "gelu": lambda g: jax.nn.gelu(g, approximate=False),
           "gelu_tanh": lambda g: jax.nn.gelu(g, approximate=True)}[activation]

    def unfused(module, x):
        gate, up = module.gate_proj(x), module.up_proj(x)
        h = (act(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(gate.dtype)
        return module.down_proj(h)

    x = jnp.asarray(rng.normal((3, 7, 24)), dtype)
    y, y_ref = mlp(x), unfused(mlp, x)
    assert y.shape == x.shape and y.dtype == y_ref.dtype
    assert rel_err(np.asarray(y, np.float32), np.asarray(y_ref, np.float32)) <= tol

    def loss(call):
        return lambda module, x: (call(module, x).astype(jnp.float32) ** 2).sum()

    g = nnx.grad(loss(lambda m, x: m(x)))(mlp, x)
    g_ref = nnx.grad(loss(unfused))(mlp, x)
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert rel_err(np.asarray(getattr(g, name).kernel[...], np.float32),
                       np.asarray(getattr(g_ref, name).kernel[...], np.float32)) <= tol * 10


def test_gated_mlp_rejects_bad_arguments():
    with pytest.raises(ValueError, match="hidden_dim must be a positive integer, got 0"):
        flf.GatedMLP(8, 0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="activation must be one of silu, gelu, gelu_tanh, "
                                         "got 'relu'"):
        flf.GatedMLP(8, 16, "relu", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("shape", [(2, 9, 16), (2, 9, 3, 8)])
def test_rotary_embedding_matches_keras_hub(shape, rng):
    layer = flf.RotaryEmbedding(max_wavelength=500, scaling_factor=2.0)
    x = jnp.asarray(rng.normal(shape), jnp.float32)
    y = layer(x)
    want = keras_hub_rotary(jnp, x, 500, 2.0)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_err(np.asarray(y), np.asarray(want)) <= 1e-5
    dy = jnp.asarray(rng.normal(shape), jnp.float32)
    dx = jax.grad(lambda x: (layer(x) * dy).sum())(x)
    dx_ref = jax.grad(lambda x: (keras_hub_rotary(jnp, x, 500, 2.0) * dy).sum())(x)
    assert rel_err(np.asarray(dx), np.asarray(dx_ref)) <= 1e-5


def test_rotary_embedding_other_axes_and_positions(rng):
    x = jnp.asarray(rng.normal((2, 8, 5, 9)), jnp.float32)  # (batch, dim, seq, heads)
    layer = flf.RotaryEmbedding(sequence_axis=2, feature_axis=1)
    y = layer(x, start_index=3)
    moved = jnp.moveaxis(x, (1, 2), (-1, 1))  # (batch, seq, heads, dim)
    shifted = flf.RotaryEmbedding()(moved, positions=jnp.arange(3, 8))
    assert rel_err(np.asarray(jnp.moveaxis(y, (1, 2), (-1, 1))), np.asarray(shifted)) <= 1e-6
    assert rel_err(np.asarray(y), np.asarray(x)) > 0.1  # positions 3.. rotate every pair


@pytest.mark.parametrize("tied", [False, True])
def test_linear_cross_entropy_module(tied, rng):
    v, h = 29, 12
    embed = nnx.Embed(v, h, rngs=nnx.Rngs(1))
    head = flf.LinearCrossEntropy(h, v, use_bias=not tied, z_loss=1e-3, rngs=nnx.Rngs(0),
                                  embedding=embed.embedding if tied else None)
    if not tied:
        head.bias[...] = jnp.asarray(rng.normal(v), jnp.float32)
    assert head.kernel.shape == (v, h)
    x = jnp.asarray(rng.normal((3, 7, h)), jnp.float32)
    t = jnp.asarray(rng.gen.integers(0, v, (3, 7)), jnp.int32).at[0, 0].set(-100)

    def formula(kernel, bias, x):  # the unfused head and loss
        z = x @ kernel.T + (0 if bias is None else bias)
        lse = jax.nn.logsumexp(z, -1)
        kept = t != -100
        picked = jnp.take_along_axis(z, jnp.where(kept, t, 0)[..., None], -1)[..., 0]
        return jnp.where(kept, lse - picked + 1e-3 * lse ** 2, 0).sum() / kept.sum()
    bias = None if tied else head.bias[...]
    loss, grad = nnx.value_and_grad(lambda m: m(x, t))(head)
    want, grad_want = jax.value_and_grad(formula)(head.kernel[...], bias, x)
    assert rel_err(np.asarray(loss), np.asarray(want)) <= 1e-5
    assert rel_err(np.asarray(grad["kernel"][...]), np.asarray(grad_want)) <= 1e-5
    with pytest.raises(ValueError, match="reduction must be one of"):
        flf.LinearCrossEntropy(h, v, reduction="avg", rngs=nnx.Rngs(0))
    # in bfloat16 the loss is float32, not rounded through bfloat16 (21 rows: not all bf16 values)
    half = flf.LinearCrossEntropy(h, v, reduction="none", dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    rows = half(x, t)
    assert rows.dtype == jnp.float32 and half(x, t).shape == t.shape
    assert not np.array_equal(np.asarray(rows), np.asarray(rows.astype(jnp.bfloat16), np.float32))
