"""A SavedModel using the fused TF ops reloads in a fresh process (which must import
fusedlayers.tensorflow first, to load the op library and register the gradients), gives the same
outputs and differentiates."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
import fusedlayers as fl  # noqa: E402


class Block(tf.Module):
    def __init__(self, rng):
        super().__init__()
        self.w = tf.Variable(rng.standard_normal((16, 12)).astype(np.float32) / 4)
        self.b = tf.Variable(rng.standard_normal(16).astype(np.float32))
        self.g = tf.Variable(1 + rng.standard_normal(16).astype(np.float32) / 10)

    @tf.function(input_signature=[tf.TensorSpec([None, 12], tf.float32)])
    def __call__(self, x):
        h = fl.linear_gelu(x, self.w, self.b)
        return fl.relu_scale(fl.layer_norm(h, 16, self.g), 0.5)


def test_savedmodel_reload_in_fresh_process(tmp_path, seed):
    rng = np.random.default_rng(seed)
    module = Block(rng)
    x = rng.standard_normal((5, 12)).astype(np.float32)
    with tf.GradientTape() as tape:
        xt = tf.constant(x)
        tape.watch(xt)
        y = module(xt)
        loss = tf.reduce_sum(y * y)
    dx = tape.gradient(loss, xt).numpy()
    tf.saved_model.save(module, str(tmp_path / "model"))
    np.save(tmp_path / "x.npy", x)
    script = textwrap.dedent(f"""
        import numpy as np, tensorflow as tf
        import fusedlayers.tensorflow  # loads the op library and registers the gradients
        m = tf.saved_model.load({str(tmp_path / 'model')!r})
        x = tf.constant(np.load({str(tmp_path / 'x.npy')!r}))
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = m(x)
            loss = tf.reduce_sum(y * y)
        np.save({str(tmp_path / 'y.npy')!r}, y.numpy())
        np.save({str(tmp_path / 'dx.npy')!r}, tape.gradient(loss, x).numpy())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={"TF_CPP_MIN_LOG_LEVEL": "3", **__import__("os").environ})
    assert done.returncode == 0, done.stderr[-3000:]
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), y.numpy())
    np.testing.assert_allclose(np.load(tmp_path / "dx.npy"), dx, rtol=1e-6, atol=1e-6)
