"""The same fusedlayers.keras classes on Keras' torch backend: they must run the torch extension
(not fall back to anything) and match the Keras layers they replace. Keras picks its backend at
import, so this runs in a fresh process with KERAS_BACKEND=torch."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("keras")

SCRIPT = textwrap.dedent("""
    import numpy as np, keras, torch
    import fusedlayers.keras as flk
    import fusedlayers.torch as backend
    calls = []
    for name in ("layer_norm_trailing", "dense_gelu", "relu_scale"):
        def spy(*a, _f=getattr(backend, name), _n=name, **k):
            calls.append(_n)
            return _f(*a, **k)
        setattr(backend, name, spy)
    rng = np.random.default_rng({seed})
    x = rng.normal(size=(4, 6, 8)).astype("float32")
    pairs = [(keras.layers.LayerNormalization(axis=[1, 2]), flk.LayerNorm(axis=[1, 2])),
             (keras.layers.LayerNormalization(rms_scaling=True), flk.LayerNorm(rms_scaling=True)),
             (keras.layers.Dense(5, activation="gelu"), flk.FusedLinearGELU(5))]
    for ref, fused in pairs:
        ref.build(x.shape); fused.build(x.shape)
        for rw, fw in zip(ref.weights, fused.weights):
            v = rng.normal(size=rw.shape).astype("float32"); rw.assign(v); fw.assign(v)
        out = fused(x)
        assert isinstance(out, torch.Tensor), type(out)
        err = np.abs(keras.ops.convert_to_numpy(ref(x)) - out.detach().cpu().numpy()).max()
        assert err < 1e-5, (type(fused).__name__, err)
    y = flk.FusedReLUScale(2.0)(np.array([-1.0, 3.0], "float32"))
    assert y.detach().cpu().numpy().tolist() == [0.0, 6.0]
    assert calls == ["layer_norm_trailing", "layer_norm_trailing", "dense_gelu", "relu_scale"], calls
    inp = keras.Input((6, 8))
    model = keras.Model(inp, keras.layers.LayerNormalization()(
        keras.layers.Dense(8, activation="gelu")(inp)))
    fused = flk.fuse(model)
    assert [type(l).__name__ for l in fused.layers[1:]] == ["FusedLinearGELU", "LayerNorm"]
    err = np.abs(keras.ops.convert_to_numpy(fused(x)) - keras.ops.convert_to_numpy(model(x))).max()
    assert err < 1e-5, err
    print("ok")
""")


def test_keras_layers_on_torch_backend(seed):
    env = {**os.environ, "KERAS_BACKEND": "torch", "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(seed=seed)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
