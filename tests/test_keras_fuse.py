"""fusedlayers.keras.fuse (TensorFlow backend): a clone of Sequential and functional models with
LayerNormalization, RMSNormalization and Dense(GELU) swapped, weights copied, the same outputs and gradients, what
it leaves and why, mixed precision, and .keras round trips."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

if keras.backend.backend() != "tensorflow":
    pytest.skip("these tests need KERAS_BACKEND=tensorflow", allow_module_level=True)

from fusedlayers.keras import FusedLinearGELU, LayerNorm, RMSNorm, fuse  # noqa: E402

from _helpers import rel_err  # noqa: E402


@keras.saving.register_keras_serializable(package="tests")
def gelu_tanh(x):
    return keras.activations.gelu(x, approximate=True)


def functional_model(dtype=None):
    inp = keras.Input((7, 16))
    h = keras.layers.Dense(48, activation="gelu", name="fc1", dtype=dtype)(inp)
    h = keras.layers.Dense(16, name="fc2", dtype=dtype)(h)
    h = keras.layers.LayerNormalization(epsilon=1e-5, name="ln1", dtype=dtype)(h + inp)
    h = keras.layers.Dense(24, activation=gelu_tanh, name="fc3", dtype=dtype)(h)
    h = keras.layers.Dense(8, activation="relu", name="head", dtype=dtype)(h)
    h = keras.layers.RMSNormalization(epsilon=1e-5, name="rms", dtype=dtype)(h)
    return keras.Model(inp, keras.layers.LayerNormalization(axis=[1, 2], name="ln2",
                                                            dtype=dtype)(h))


def random_weights(model, seed):
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(scale=0.3, size=w.shape).astype("float32")
                       for w in model.get_weights()])


def outputs_and_grads(model, x):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = model(x)
        loss = tf.reduce_sum(tf.cast(y, tf.float32) ** 2)
    return y, tape.gradient(loss, [x, *model.trainable_weights])


def test_functional_model_fused_same_outputs_and_grads(seed):
    model = functional_model()
    random_weights(model, seed)
    fused = fuse(model)
    assert [type(layer).__name__ for layer in model.layers].count("Dense") == 4  # unchanged
    kinds = {layer.name: type(layer) for layer in fused.layers}
    assert kinds["fc1"] is FusedLinearGELU and kinds["fc3"] is FusedLinearGELU
    assert kinds["ln1"] is LayerNorm and kinds["ln2"] is LayerNorm and kinds["rms"] is RMSNorm
    assert kinds["fc2"] is keras.layers.Dense and kinds["head"] is keras.layers.Dense
    assert not fused.get_layer("fc1").approximate and fused.get_layer("fc3").approximate
    assert [w.path for w in fused.weights] == [w.path for w in model.weights]
    for a, b in zip(fused.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    report = fused.fusedlayers_report
    assert sorted(name for name, _, _ in report.swapped) == ["fc1", "fc3", "ln1", "ln2", "rms"]
    assert ("ln1", "keras.layers.LayerNormalization",
            "fusedlayers.keras.LayerNorm") in report.swapped
    assert report.left == []

    x = tf.constant(np.random.default_rng(seed).normal(size=(3, 7, 16)).astype("float32"))
    y, grads = outputs_and_grads(fused, x)
    y_ref, grads_ref = outputs_and_grads(model, x)
    assert rel_err(y, y_ref) <= 1e-5
    for g, r in zip(grads, grads_ref):
        assert rel_err(g, r) <= 1e-5


def test_sequential_and_switches():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="gelu"),
                              keras.layers.LayerNormalization(), keras.layers.Dense(3),
                              keras.layers.RMSNormalization()])
    names = lambda m: [type(layer).__name__ for layer in m.layers]  # noqa: E731
    assert names(fuse(model, linear_gelu=False, rms_norm=False)) == [
        "Dense", "LayerNorm", "Dense", "RMSNormalization"]
    assert names(fuse(model, layer_norm=False)) == [
        "FusedLinearGELU", "LayerNormalization", "Dense", "RMSNorm"]
    every = fuse(model)
    assert names(every) == ["FusedLinearGELU", "LayerNorm", "Dense", "RMSNorm"]
    x = np.random.default_rng(0).normal(size=(5, 8)).astype("float32")
    assert rel_err(every(x), model(x)) <= 1e-5


def test_separate_gelu_activation_is_left_with_a_reason():
    inp = keras.Input((6,))
    out = keras.layers.Activation("gelu", name="act")(keras.layers.Dense(6, name="fc")(inp))
    fused = fuse(keras.Model(inp, out))
    assert isinstance(fused.get_layer("fc"), keras.layers.Dense)
    ((name, what, why),) = fused.fusedlayers_report.left
    assert name == "act" and "activation='gelu'" in why


def test_mixed_precision_policy_kept():
    model = functional_model(dtype="mixed_bfloat16")
    random_weights(model, 0)
    fused = fuse(model)
    layer = fused.get_layer("fc1")
    assert isinstance(layer, FusedLinearGELU)
    assert layer.compute_dtype == "bfloat16" and layer.variable_dtype == "float32"
    x = np.random.default_rng(1).normal(size=(2, 7, 16)).astype("float32")
    assert rel_err(fused(x), model(x)) <= 3e-2


def test_subclassed_model_rejected():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.fc = keras.layers.Dense(4, activation="gelu")

        def call(self, x):
            return self.fc(x)

    net = Net()
    net(np.zeros((1, 4), "float32"))
    with pytest.raises(TypeError, match="Sequential or functional"):
        fuse(net)


def test_not_a_model_rejected():
    with pytest.raises(TypeError, match="must be a keras.Model"):
        fuse(keras.layers.Dense(3))


def test_fused_clone_saves_and_loads(tmp_path):
    fused = fuse(functional_model())
    path = tmp_path / "fused.keras"
    fused.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.get_layer("fc1"), FusedLinearGELU)
    x = np.random.default_rng(2).normal(size=(2, 7, 16)).astype("float32")
    np.testing.assert_allclose(loaded(x), fused(x), rtol=0, atol=0)
