"""fusedlayers.keras.Fp8Dense on each Keras backend (a fresh process each: Keras picks its backend
at import): Dense's weights and config, its output the backend's fp8_dense of them (bit for bit)
and near Dense's, the mixed_bfloat16 policy, a config round trip, and
model.fit of a small regression tracking the same model with Dense."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("keras")

SCRIPT = textwrap.dedent("""
    import numpy as np, keras
    import fusedlayers.keras as flk
    from fusedlayers import Fp8Recipe
    backend = keras.backend.backend()
    fl = __import__("fusedlayers." + backend, fromlist=["fp8_dense"])
    rng = np.random.default_rng({seed})
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    x = rng.normal(size=(4, 32, 128)).astype("float32")
    dense, fp8 = keras.layers.Dense(48), flk.Fp8Dense(48, recipe=Fp8Recipe("tensorwise"))
    dense.build(x.shape); fp8.build(x.shape)
    assert [w.path.split("/")[-1] for w in dense.weights] == [w.path.split("/")[-1] for w in fp8.weights]
    for rw, fw in zip(dense.weights, fp8.weights):
        v = rng.normal(size=rw.shape).astype("float32"); rw.assign(v); fw.assign(v)
    assert fp8.kernel.dtype == "float32"
    y = keras.ops.convert_to_numpy(keras.ops.cast(fp8(x), "float32"))
    want = fl.fp8_dense(*(keras.ops.cast(t, "bfloat16") for t in (x, fp8.kernel, fp8.bias)),
                        Fp8Recipe("tensorwise"))  # Keras' autocast of the weights in call
    assert np.array_equal(y, keras.ops.convert_to_numpy(keras.ops.cast(want, "float32")))
    ref = keras.ops.convert_to_numpy(keras.ops.cast(dense(x), "float32"))
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 0.05
    clone = flk.Fp8Dense.from_config(fp8.get_config())
    assert clone.recipe == Fp8Recipe("tensorwise") and clone.units == 48
    keras.mixed_precision.set_global_policy("float32")

    def fit(layer_cls):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), layer_cls(128, activation="relu"),
                                  layer_cls(32)])
        model.compile(keras.optimizers.AdamW(1e-2), "mse", jit_compile=False)
        data = np.random.default_rng(0).normal(size=(256, 64)).astype("float32")
        target = data @ (np.random.default_rng(1).normal(size=(64, 32)) / 8).astype("float32")
        hist = model.fit(data, target, batch_size=64, epochs=8, verbose=0, shuffle=False)
        return hist.history["loss"]
    ref_loss, fp8_loss = fit(keras.layers.Dense), fit(flk.Fp8Dense)
    assert fp8_loss[-1] < fp8_loss[0] / 10, fp8_loss
    worst = max(abs(a - b) for a, b in zip(ref_loss, fp8_loss))
    assert worst <= 0.02 * ref_loss[0], (worst, ref_loss, fp8_loss)
    print("ok", backend)
""")


@pytest.mark.parametrize("backend", ["tensorflow", "torch", "jax"])
def test_fp8_dense_on_every_backend(backend, seed):
    pytest.importorskip(backend)
    env = {**os.environ, "KERAS_BACKEND": backend, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(seed=seed)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and f"ok {backend}" in out.stdout, out.stderr[-3000:]


LLAMA_SCRIPT = textwrap.dedent("""
    import numpy as np, keras
    from fusedlayers import Fp8Recipe
    from fusedlayers.bench import keras_models as km
    config = km.CONFIGS["llama-lm-tiny"]
    rng = np.random.default_rng(0)
    ids = rng.integers(0, config["vocab"], (4, config["seq"]), np.int32)
    labels = np.roll(ids, -1, axis=1)  # a learnable target: the next id
    keras.mixed_precision.set_global_policy("mixed_bfloat16")

    def losses(fp8):
        keras.utils.set_random_seed(0)
        model = km.build_llama(**config, fused=True, lm=True, fp8=fp8)
        model.compile(keras.optimizers.AdamW(3e-3))
        hist = model.fit([ids, labels], None, batch_size=2, epochs=10, verbose=0, shuffle=False)
        return hist.history["loss"]
    bf16, fp8 = losses(None), losses(Fp8Recipe())
    assert fp8[-1] < fp8[0] * 0.95, fp8
    worst = max(abs(a - b) for a, b in zip(fp8, bf16))
    assert worst <= 0.01 * bf16[0], (worst, bf16, fp8)
    print("ok", worst / bf16[0])
""")


def test_keras_llama_trains_in_fp8_beside_bf16():
    """The bench's tiny Keras Llama language model (fused) on the JAX backend with its
    projections as Fp8Dense (GatedMLP(recipe=)), under mixed_bfloat16: the same initial weights
    as the bf16 model, and 20 AdamW steps whose epoch losses follow the bf16 model's within 1% of
    the starting loss (the bench's Keras FP8 rows: test_bench.py)."""
    pytest.importorskip("jax")
    env = {**os.environ, "KERAS_BACKEND": "jax", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", LLAMA_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
