"""SavedModels using the fused ops: a tf.Module saved with tf.saved_model.save and a Keras model
exported with model.export (and saved as a .keras file) are reloaded in a fresh interpreter, which must import
fusedlayers.tensorflow before tf.saved_model.load (it loads the op library and registers the
gradients); the reloaded functions' outputs and GradientTape gradients must equal the original's.

One subprocess serves all checks (TensorFlow takes seconds to import)."""

import json
import os

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import fusedlayers as fl  # noqa: E402

from _helpers import run_python  # noqa: E402

IN, HID = 12, 9


class FusedBlock(tf.Module):
    """layer_norm -> linear_gelu -> relu_scale, with its own variables."""

    def __init__(self, rng):
        super().__init__()
        self.gamma = tf.Variable(rng.normal(IN, loc=1.0, scale=0.3).astype(np.float32))
        self.beta = tf.Variable(rng.normal(IN, scale=0.3).astype(np.float32))
        self.w = tf.Variable(rng.normal((HID, IN), scale=0.3).astype(np.float32))
        self.b = tf.Variable(rng.normal(HID, scale=0.3).astype(np.float32))
        self.alpha = float(rng.uniform(0.5, 2))

    @tf.function(input_signature=[tf.TensorSpec([None, IN], tf.float32)])
    def __call__(self, x):
        h = fl.layer_norm(x, IN, self.gamma, self.beta, 1e-5)
        h = fl.linear_gelu(h, self.w, self.b, "tanh")
        return fl.relu_scale(h - 0.05, self.alpha)


def _keras_model():
    from fusedlayers.keras import FusedLinearGELU, FusedReLUScale, LayerNorm
    inp = keras.Input((IN,))
    h = LayerNorm(axis=-1)(inp)
    h = FusedLinearGELU(HID)(h)
    h = FusedReLUScale(1.7)(h)
    out = LayerNorm(center=False)(h)
    return keras.Model(inp, out)


CHILD = r"""
import json, sys
import numpy as np
import tensorflow as tf

d = {d!r}
out = {{}}

# 1. Without the op library the SavedModel cannot load, and says why.
try:
    tf.saved_model.load(d + "/module")
    out["load_without_import"] = "loaded"
except Exception as e:
    out["load_without_import"] = type(e).__name__ + ": " + str(e)[:2000]

# 2. Import fusedlayers' TF ops first (loads the library, registers the gradients), then load.
import fusedlayers.tensorflow  # noqa: F401

data = np.load(d + "/data.npz")
x, dy_m, dy_k = (tf.constant(data[k]) for k in ("x", "dy_m", "dy_k"))

m = tf.saved_model.load(d + "/module")
with tf.GradientTape() as tape:
    tape.watch(x)
    y = m(x)
    loss = tf.reduce_sum(y * dy_m)
names = ["x", "gamma", "beta", "w", "b"]
gs = tape.gradient(loss, [x, m.gamma, m.beta, m.w, m.b])
out["module_y"] = y.numpy().tolist()
out["module_grads"] = {{n: (None if g is None else tf.convert_to_tensor(g).numpy().tolist())
                       for n, g in zip(names, gs)}}

# and inside a tf.function of the child
@tf.function
def step(x):
    with tf.GradientTape() as t:
        t.watch(x)
        loss = tf.reduce_sum(m(x) * dy_m)
    return t.gradient(loss, x)
out["module_dx_fn"] = step(x).numpy().tolist()

k = tf.saved_model.load(d + "/keras")
with tf.GradientTape() as tape:
    tape.watch(x)
    yk = k.serve(x)
    loss = tf.reduce_sum(yk * dy_k)
out["keras_y"] = yk.numpy().tolist()
out["keras_dx"] = tape.gradient(loss, x).numpy().tolist()

# 3. The .keras file: fusedlayers.keras registers the layers with Keras' serialization.
import keras
import fusedlayers.keras  # noqa: F401
loaded = keras.models.load_model(d + "/model.keras")
out["dot_keras_layers"] = [type(layer).__name__ for layer in loaded.layers]
out["dot_keras_y"] = loaded(x).numpy().tolist()
print("RESULT" + json.dumps(out))
"""


def test_savedmodel_reload_in_fresh_process(rng, tmp_path):
    d = str(tmp_path)
    block = FusedBlock(rng)
    tf.saved_model.save(block, os.path.join(d, "module"))

    model = _keras_model()
    for w in model.weights:  # non-trivial weights everywhere
        w.assign(rng.normal(tuple(w.shape), loc=1.0 if w.name == "gamma" else 0.0,
                            scale=0.3).astype(np.float32))
    model.export(os.path.join(d, "keras"), verbose=False)
    model.save(os.path.join(d, "model.keras"))

    x = rng.normal((5, IN), loc=0.3).astype(np.float32)
    dy_m = rng.normal((5, HID)).astype(np.float32)
    dy_k = rng.normal((5, HID)).astype(np.float32)
    np.savez(os.path.join(d, "data.npz"), x=x, dy_m=dy_m, dy_k=dy_k)

    # the originals, in this process
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        y = block(xt)
        loss = tf.reduce_sum(y * dy_m)
    names = ["x", "gamma", "beta", "w", "b"]
    g = tape.gradient(loss, [xt, block.gamma, block.beta, block.w, block.b])
    want_module = dict(zip(names, g))
    with tf.GradientTape() as tape:
        tape.watch(xt)
        yk = model(xt)
        loss = tf.reduce_sum(yk * dy_k)
    dx_k = tape.gradient(loss, xt)

    stdout = run_python(CHILD.format(d=d))
    line = next(ln for ln in stdout.splitlines() if ln.startswith("RESULT"))
    got = json.loads(line[len("RESULT"):])

    msg = got["load_without_import"]
    assert msg != "loaded", "the SavedModel loaded without the fusedlayers op library"
    assert "Fusedlayers" in msg, msg  # names the missing op (e.g. 'Op type not registered')

    tol = dict(rtol=1e-6, atol=1e-6, err_msg=str(rng))
    np.testing.assert_allclose(np.array(got["module_y"], np.float32), y.numpy(), **tol)
    assert sorted(got["module_grads"]) == sorted(want_module)
    for name, want in want_module.items():
        gv = got["module_grads"][name]
        assert gv is not None, f"no gradient for {name} through the reloaded module"
        np.testing.assert_allclose(np.array(gv, np.float32), tf.convert_to_tensor(want).numpy(),
                                   **tol)
    np.testing.assert_allclose(np.array(got["module_dx_fn"], np.float32), g[0].numpy(), **tol)
    np.testing.assert_allclose(np.array(got["keras_y"], np.float32), yk.numpy(), **tol)
    np.testing.assert_allclose(np.array(got["keras_dx"], np.float32), dx_k.numpy(), **tol)
    assert got["dot_keras_layers"] == [type(layer).__name__ for layer in model.layers]
    np.testing.assert_array_equal(np.array(got["dot_keras_y"], np.float32), yk.numpy())
    # the gradients are not trivially zero
    assert np.abs(g[0].numpy()).max() > 0 and np.abs(dx_k.numpy()).max() > 0
