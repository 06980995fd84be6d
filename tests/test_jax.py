"""fusedlayers.jax beyond the op table's generated tests (tests/test_ops.py): jit, vmap (forward
and per-example gradients) and the dispatcher on JAX arrays and tracers; Keras layers on the JAX
backend (in a fresh process: Keras picks its backend at import)."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import fusedlayers as fl  # noqa: E402
import fusedlayers.jax as flj  # noqa: E402
from _helpers import rel_err  # noqa: E402


def _ops(rng):
    """(name, fn of x, x) for each op, with fixed random parameters."""
    w, b = jnp.asarray(rng.normal(7) + 1), jnp.asarray(rng.normal(7))
    lw, lb = jnp.asarray(rng.normal((5, 7)) / 3), jnp.asarray(rng.normal(5))
    x = jnp.asarray(rng.normal((4, 3, 7)), jnp.float32)
    return [("relu_scale", lambda x: fl.relu_scale(x, 0.75), x),
            ("layer_norm", lambda x: fl.layer_norm(x, 7, w.astype(x.dtype), b.astype(x.dtype)), x),
            ("rms_norm", lambda x: fl.rms_norm(x, 7, w.astype(x.dtype), 1e-6), x),
            ("linear_gelu", lambda x: fl.linear_gelu(x, lw.astype(x.dtype), lb.astype(x.dtype)),
             x)]


@pytest.mark.parametrize("index", range(4), ids=["relu_scale", "layer_norm", "rms_norm",
                                                 "linear_gelu"])
def test_vmap_forward_and_per_example_grads(index, rng):
    """vmap over a leading axis equals the op on each slice, forward and gradient."""
    name, fn, x = _ops(rng)[index]
    batched = jax.jit(jax.vmap(fn))(x)
    for i in range(x.shape[0]):
        assert rel_err(np.asarray(batched[i]), np.asarray(fn(x[i]))) <= 1e-6, name
    loss = lambda x: (fn(x) ** 2).sum()  # noqa: E731
    per_example = jax.vmap(jax.grad(loss))(x)
    for i in range(x.shape[0]):
        assert rel_err(np.asarray(per_example[i]), np.asarray(jax.grad(loss)(x[i]))) <= 1e-6


@pytest.mark.parametrize("index", range(4), ids=["relu_scale", "layer_norm", "rms_norm",
                                                 "linear_gelu"])
def test_inside_shard_map(index, rng):
    """Inside shard_map each device calls the op on its block of rows, forward and gradient;
    (the sharding of jit's own partitioner: test_ops.test_jax_sharded_rows)."""
    from jax.sharding import PartitionSpec as P
    cpus = jax.devices("cpu")
    if len(cpus) < 2:
        pytest.skip("needs two JAX CPU devices (conftest's XLA_FLAGS)")
    mesh = jax.sharding.Mesh(np.array(cpus[:2]), ("rows",))
    name, fn, x = _ops(rng)[index]
    grad = jax.grad(lambda x: (fn(x) ** 2).sum())
    for f in (fn, grad):
        split = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("rows"), out_specs=P("rows")))
        assert rel_err(np.asarray(split(x)), np.asarray(jax.jit(f)(x))) <= 1e-6, name


def test_parameter_gradient_inside_shard_map(rng):
    """A parameter replicated across shard_map's devices gets the gradient summed over them, as
    jnp's own ops give it."""
    from jax.sharding import PartitionSpec as P
    cpus = jax.devices("cpu")
    if len(cpus) < 2:
        pytest.skip("needs two JAX CPU devices (conftest's XLA_FLAGS)")
    mesh = jax.sharding.Mesh(np.array(cpus[:2]), ("rows",))
    x = jnp.asarray(rng.normal((6, 7)), jnp.float32)
    w, b = jnp.asarray(rng.normal(7), jnp.float32), jnp.asarray(rng.normal(7), jnp.float32)
    grad = jax.grad(lambda x, w, b: (flj.layer_norm(x, 7, w, b) ** 2).sum(), argnums=(1, 2))
    split = jax.jit(jax.shard_map(grad, mesh=mesh, in_specs=(P("rows"), P(), P()),
                                  out_specs=P()))
    for got, want in zip(split(x, w, b), jax.jit(grad)(x, w, b)):
        assert rel_err(np.asarray(got), np.asarray(want)) <= 1e-6


@pytest.mark.parametrize("index", range(4), ids=["relu_scale", "layer_norm", "rms_norm",
                                                 "linear_gelu"])
def test_jax_export_round_trips_with_the_safety_checks_allowed(index, rng):
    """jax.export refuses our custom calls by default; with export_safety_checks() the forward
    and its gradient serialize, and the deserialized artifact gives the same results."""
    _, fn, x = _ops(rng)[index]

    def loss(x):
        return jnp.sum(fn(x) ** 2)
    both = jax.jit(lambda x: (fn(x), jax.grad(loss)(x)))
    with pytest.raises(ValueError, match="custom calls"):
        jax.export.export(both)(x)
    exported = jax.export.export(both, disabled_checks=flj.export_safety_checks())(x)
    back = jax.export.deserialize(exported.serialize())
    for ours, direct in zip(back.call(x), both(x)):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(direct))


def test_vmap_over_parameters(rng):
    """A batch of weights (one per example) is not folded into the rows."""
    x = jnp.asarray(rng.normal((3, 5, 7)), jnp.float32)
    w = jnp.asarray(rng.normal((3, 7)), jnp.float32)
    out = jax.vmap(lambda x, w: flj.layer_norm(x, 7, w))(x, w)
    for i in range(3):
        assert rel_err(np.asarray(out[i]), np.asarray(flj.layer_norm(x[i], 7, w[i]))) <= 1e-7


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dense_gelu_takes_a_keras_kernel(dtype, rng):
    """dense_gelu with W stored (in, out), as Keras' Dense keeps it, equals linear_gelu with W
    (out, in), forward and gradients (on CUDA both layouts run on cuBLASLt, read in place)."""
    x = jnp.asarray(rng.normal((2, 5, 24)), dtype)
    w = jnp.asarray(rng.normal((40, 24)) / 5, dtype)
    b = jnp.asarray(rng.normal(40), dtype)
    grad = lambda f: jax.jit(jax.value_and_grad(  # noqa: E731
        lambda x, w, b: f(x, w, b).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    (y1, (dx1, dk, db1)) = grad(lambda x, k, b: flj.dense_gelu(x, k, b))(x, w.T, b)
    (y2, (dx2, dw, db2)) = grad(lambda x, w, b: flj.linear_gelu(x, w, b))(x, w, b)
    tol = 1e-6 if dtype == "float32" else 1e-2
    for a, ref in ((y1, y2), (dx1, dx2), (dk, dw.T), (db1, db2)):
        assert rel_err(np.asarray(a, np.float64), np.asarray(ref, np.float64)) <= tol


def test_dispatch_on_tracers_and_other_frameworks(rng):
    x = jnp.asarray(rng.normal((2, 7)), jnp.float32)
    assert jax.jit(lambda x: fl.layer_norm(x, 7))(x).shape == (2, 7)  # a tracer dispatches
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"layer_norm: x is a jax.Array, so weight must not be "
                                        r"a torch.Tensor"):
        fl.layer_norm(x, 7, torch.ones(7))
    with pytest.raises(TypeError, match=r"x is a torch.Tensor, so weight must be one too, got "
                                        r"jax"):
        fl.layer_norm(torch.ones(2, 7), 7, x[0])


def test_float16_and_bfloat16_parameters_of_float32(rng):
    """Half x with float32 parameters (mixed precision's layout), as in torch."""
    x = jnp.asarray(rng.normal((3, 7)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(7), jnp.float32)
    y = flj.rms_norm(x, 7, w, 1e-6)
    assert y.dtype == jnp.bfloat16
    dw = jax.grad(lambda w: flj.rms_norm(x, 7, w, 1e-6).astype(jnp.float32).sum())(w)
    assert dw.dtype == jnp.float32


KERAS_SCRIPT = textwrap.dedent("""
    import numpy as np, keras, jax
    import fusedlayers.keras as flk
    jax.config.update("jax_default_matmul_precision", "highest")  # Dense's own dot: no TF32
    assert keras.backend.backend() == "jax"
    rng = np.random.default_rng({seed})
    x = rng.normal(size=(4, 6, 8)).astype("float32")
    pairs = [(keras.layers.LayerNormalization(axis=[1, 2]), flk.LayerNorm(axis=[1, 2])),
             (keras.layers.RMSNormalization(), flk.RMSNorm()),
             (keras.layers.Dense(5, activation="gelu"), flk.FusedLinearGELU(5))]
    for ref, fused in pairs:
        ref.build(x.shape); fused.build(x.shape)
        for rw, fw in zip(ref.weights, fused.weights):
            v = rng.normal(size=rw.shape).astype("float32"); rw.assign(v); fw.assign(v)
        out = fused(x)
        assert isinstance(out, jax.Array), type(out)
        err = np.abs(np.asarray(ref(x)) - np.asarray(out)).max()
        assert err < 1e-5, (type(fused).__name__, err)
    inp = keras.Input((6, 8))
    h = keras.layers.LayerNormalization()(keras.layers.Dense(8, activation="gelu")(inp))
    model = keras.Model(inp, keras.layers.Dense(3)(keras.layers.Flatten()(h)))
    fused = flk.fuse(model)
    assert [type(l).__name__ for l in fused.layers[1:3]] == ["FusedLinearGELU", "LayerNorm"]
    fused.compile(optimizer="sgd", loss="mse", jit_compile=True)
    y = rng.normal(size=(4, 3)).astype("float32")
    losses = fused.fit(x, y, epochs=5, verbose=0).history["loss"]
    assert losses[-1] < losses[0], losses
    lowered = jax.jit(lambda x: fused(x)).lower(x).as_text()
    # linear_gelu: the epilogue after XLA's dot, or on CUDA the whole op on cuBLASLt (_gemm_)
    assert "fusedlayers_layer_norm_forward" in lowered and "fusedlayers_linear_gelu_" in lowered
    print("ok")
""")


def test_keras_layers_on_the_jax_backend(seed):
    pytest.importorskip("keras")
    done = subprocess.run([sys.executable, "-c", KERAS_SCRIPT.format(seed=seed)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "KERAS_BACKEND": "jax"})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def _switchable(rng):
    """(op, fn of the float arrays, arrays) for each op with an XLA formula (fusedlayers.jax._impl):
    odd widths, a zero-centred gain, partial interleaved rotary."""
    x, r = (jnp.asarray(rng.normal((3, 5, 37)), jnp.float32) for _ in range(2))
    w = jnp.asarray(rng.normal(37), jnp.float32)
    q, k = jnp.asarray(rng.normal((2, 5, 4, 12))), jnp.asarray(rng.normal((2, 5, 2, 12)))
    angles = rng.uniform(-10, 10, (1, 5, 8))
    cos, sin = jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)
    return {
        "rms_norm": (lambda x, w: fl.rms_norm(x, 37, w, 1e-5, zero_centered=True), (x, w)),
        "add_rms_norm": (lambda x, r, w: fl.add_rms_norm(x, r, 37, w, 1e-5), (x, r, w)),
        "swiglu": (fl.swiglu, (3 * x, r)),
        "rope": (lambda q, k: fl.rope(q, k, cos, sin, 2, True),
                 (q.astype(jnp.float32), k.astype(jnp.float32))),
    }


@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "swiglu", "rope"])
def test_xla_formula_matches_the_kernel(op, rng):
    """The same results and gradients (float32 rounding) whichever implementation is forced, and
    the forced one is what the program calls."""
    fn, args = _switchable(rng)[op]
    loss = lambda *a: sum(jnp.sum(o * o) for o in jax.tree.leaves(fn(*a)))  # noqa: E731
    runs = {}
    try:
        for impl in ("kernel", "xla"):
            flj.set_implementation(op, impl)
            # fresh functions: jit keeps a function's trace, made under the choice of its time
            text = jax.jit(lambda *a: loss(*a)).lower(*args).as_text()
            assert (f"fusedlayers_{op}_forward" in text) == (impl == "kernel"), impl
            runs[impl] = (jax.jit(lambda *a: fn(*a))(*args),
                          jax.jit(jax.grad(lambda *a: loss(*a), range(len(args))))(*args))
    finally:
        flj.set_implementation(op, None)
    for a, b in zip(jax.tree.leaves(runs["kernel"]), jax.tree.leaves(runs["xla"])):
        assert rel_err(np.asarray(b, np.float64), np.asarray(a, np.float64)) <= 2e-6, op


def test_implementation_switch_errors(monkeypatch):
    with pytest.raises(ValueError, match="op must be one of"):
        flj.set_implementation("relu_scale", "xla")
    with pytest.raises(ValueError, match="implementation must be"):
        flj.set_implementation("rope", "triton")
    monkeypatch.setenv("FUSEDLAYERS_JAX_IMPL", "rope=xla,swiglu=fast")
    with pytest.raises(ValueError, match="FUSEDLAYERS_JAX_IMPL"):
        fl.rope(jnp.ones((1, 2, 1, 4)), jnp.ones((1, 2, 1, 4)), jnp.ones((1, 2, 4)),
                jnp.zeros((1, 2, 4)), 2)
    monkeypatch.setenv("FUSEDLAYERS_JAX_IMPL", "rope=xla")
    text = jax.jit(lambda q: fl.rope(q, q, jnp.ones((1, 2, 4)), jnp.zeros((1, 2, 4)), 2)
                   ).lower(jnp.ones((1, 2, 1, 4))).as_text()
    assert "fusedlayers_rope" not in text
