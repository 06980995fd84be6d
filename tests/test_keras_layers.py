"""fusedlayers.keras layers (TensorFlow backend) as drop-in replacements of the Keras layers:
same weights (names, shapes, dtypes), same outputs and gradients within calibrated tolerances,
config round trips, training, .keras save/load, mixed precision, and no XLA.

Outputs are compared with a float64 reference; our error may be at most ~2x the error of the
Keras layer we replace (same weights, same policy) plus two ulps of the compute dtype."""

import math
import os
import warnings

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

if keras.backend.backend() != "tensorflow":  # KERAS_BACKEND=torch: see test_keras_torch_backend
    pytest.skip("these tests need KERAS_BACKEND=tensorflow", allow_module_level=True)

from fusedlayers.keras import FusedLinearGELU, FusedReLUScale, LayerNorm  # noqa: E402

from _helpers import (EPS, assert_calibrated, gelu64, ln_grad_scales, np64,  # noqa: E402
                      rel_err, tf_device)

# Keras warns that LayerNormalization(rms_scaling=True) is deprecated, at construction and in
# ops.layer_normalization at each call; the comparison with it is intended.
pytestmark = pytest.mark.filterwarnings("ignore:You passed `rms_scaling=True`:UserWarning")


def quiet_layernorm(**kw):
    """keras.layers.LayerNormalization; rms_scaling=True warns that it is deprecated."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*rms_scaling.*")
        return keras.layers.LayerNormalization(**kw)


def set_weights_by_name(rng, layers, scale=0.5, loc=None):
    """Assigns the same random values to the weights of each layer, matched by name."""
    names = [w.name for w in layers[0].weights]
    for other in layers[1:]:
        assert sorted(w.name for w in other.weights) == sorted(names), (
            [w.name for w in other.weights], names)
    for name in names:
        ws = [next(w for w in layer.weights if w.name == name) for layer in layers]
        center = loc if loc is not None else (1.0 if name == "gamma" else 0.0)
        value = rng.normal(tuple(ws[0].shape), scale=scale, loc=center)
        for w in ws:
            w.assign(tf.cast(value, w.dtype))


def forward_and_grads(layer, x, dy):
    """Output and gradients of sum(layer(x) * dy) wrt x and every trainable weight (by name)."""
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x)
        loss = tf.reduce_sum(tf.cast(y, tf.float64) * tf.cast(dy, tf.float64))
    ws = layer.trainable_weights
    g = tape.gradient(loss, [x, *ws])
    return y, {"x": g[0], **{w.name: gw for w, gw in zip(ws, g[1:])}}


@pytest.fixture
def policy():
    """Sets a global dtype policy for one test and always restores float32."""
    def set_policy(name):
        keras.mixed_precision.set_global_policy(name)
    try:
        yield set_policy
    finally:
        keras.mixed_precision.set_global_policy("float32")


# --------------------------------------------------------------------------------------------
# LayerNorm vs keras.layers.LayerNormalization

AXES = [-1, 1, [1, 2], [2, 3], [1, 3], [-1, -2], [3, 1], [1, 2, 3], [-1, 1]]
FLAGS = [(c, s, r) for c in (True, False) for s in (True, False) for r in (False, True)]


@pytest.mark.parametrize("axis", AXES, ids=str)
@pytest.mark.parametrize("center,scale,rms", FLAGS,
                         ids=lambda v: str(v))
def test_layer_norm_matches_keras(rng, axis, center, scale, rms):
    shape = (3, 4, 5, 6)
    kw = dict(axis=axis, epsilon=float(10 ** rng.uniform(-5, -2)), center=center, scale=scale,
              rms_scaling=rms)
    ours, theirs = LayerNorm(**kw), quiet_layernorm(**kw)
    ref = quiet_layernorm(**kw, dtype="float64")
    x64 = rng.normal(shape, loc=rng.uniform(-2, 2), scale=rng.uniform(0.5, 2))
    if rms:
        # rms_scaling's dx error grows with |mean| / std of each normalized row (bug pinned by
        # test_tf_ops.py::test_layer_norm_grads_offset_rows[rms]); with 4-element rows a random
        # row can have a tiny std. Here every row's |mean| <= std / 2, so that this test checks
        # the layer's wiring, not that weakness.
        red = tuple(a % len(shape) for a in ([axis] if isinstance(axis, int) else axis))
        dev = x64 - x64.mean(red, keepdims=True)
        x64 = dev + rng.uniform(-0.5, 0.5, dev.mean(red, keepdims=True).shape) * dev.std(
            red, keepdims=True)
    x = tf.constant(x64, tf.float32)
    x64 = np64(x)
    dy = tf.constant(rng.normal(shape), tf.float32)
    for layer in (ours, theirs):
        layer(x)
    ref(tf.constant(x64))
    assert [(w.name, tuple(w.shape), w.dtype) for w in ours.weights] == \
           [(w.name, tuple(w.shape), w.dtype) for w in theirs.weights]
    assert len(ours.weights) == (scale or rms) + (center and not rms)
    set_weights_by_name(rng, [ours, theirs, ref])

    y, g = forward_and_grads(ours, x, dy)
    yk, gk = forward_and_grads(theirs, x, dy)
    yr, gr = forward_and_grads(ref, tf.constant(x64), tf.cast(dy, tf.float64))
    assert y.dtype == tf.float32 and y.shape == x.shape
    n = int(np.prod(shape))
    what = f"LayerNorm(axis={axis}, center={center}, scale={scale}, rms_scaling={rms})"
    assert_calibrated(rel_err(y, yr), rel_err(yk, yr), what, dtype="float32", numel=n, rng=rng,
                      floor=2 * EPS["float32"])
    assert sorted(g) == sorted(gr)
    # dx is judged against the magnitudes of the terms its formula sums (a row's dx can cancel)
    axes = sorted(a % len(shape) for a in ours.axis)
    perm = [d for d in range(len(shape)) if d not in axes] + axes
    gam = np64(ref.gamma).reshape([shape[a] for a in axes]) if ref.gamma is not None else None
    sc, sc_gamma, sc_beta = ln_grad_scales(x64.transpose(perm), gam, np64(dy).transpose(perm),
                                           len(axes), kw["epsilon"], rms_scaling=rms)
    # dgamma and dbeta too: sums over the rows, judged against the terms summed (they cancel)
    scales = {"x": sc.transpose(np.argsort(perm)), "gamma": sc_gamma, "beta": sc_beta}
    for name in gr:
        assert g[name] is not None, f"{what}: no gradient for {name}"
        assert g[name].dtype == gk[name].dtype and g[name].shape == gr[name].shape
        sc = scales[name].reshape(gr[name].shape) if name in scales else None
        assert_calibrated(rel_err(g[name], gr[name], sc), rel_err(gk[name], gr[name], sc),
                          f"{what} d{name}", dtype="float32", numel=int(np.prod(gr[name].shape)),
                          rng=rng, floor=2 * EPS["float32"])


def test_layer_norm_defaults_match_keras():
    ours, theirs = LayerNorm(), keras.layers.LayerNormalization()
    for attr in ("axis", "epsilon", "center", "scale", "rms_scaling"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    ours.build((2, 5))
    theirs.build((2, 5))
    assert [(w.name, tuple(w.shape)) for w in ours.weights] == [("gamma", (5,)), ("beta", (5,))]
    assert [(w.name, tuple(w.shape)) for w in theirs.weights] == [("gamma", (5,)), ("beta", (5,))]
    np.testing.assert_array_equal(ours.gamma.numpy(), np.ones(5))
    np.testing.assert_array_equal(ours.beta.numpy(), np.zeros(5))


# --------------------------------------------------------------------------------------------
# FusedLinearGELU vs Dense(units, activation=gelu)

@pytest.mark.parametrize("approximate", [False, True])
@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("shape", [(9, 7), (2, 3, 7), (1, 1)], ids=str)
def test_linear_gelu_matches_dense(rng, approximate, use_bias, shape):
    units = int(rng.gen.integers(1, 40))
    act = (lambda t: keras.activations.gelu(t, approximate=True)) if approximate else "gelu"
    ours = FusedLinearGELU(units, use_bias=use_bias, approximate=approximate)
    theirs = keras.layers.Dense(units, activation=act, use_bias=use_bias)
    x = tf.constant(rng.normal(shape), tf.float32)
    dy = tf.constant(rng.normal((*shape[:-1], units)), tf.float32)
    ours(x)
    theirs(x)
    assert [(w.name, tuple(w.shape), w.dtype) for w in ours.weights] == \
           [(w.name, tuple(w.shape), w.dtype) for w in theirs.weights]
    assert [w.name for w in ours.weights] == (["kernel", "bias"] if use_bias else ["kernel"])
    set_weights_by_name(rng, [ours, theirs], scale=1.5 / math.sqrt(shape[-1]))

    y, g = forward_and_grads(ours, x, dy)
    yk, gk = forward_and_grads(theirs, x, dy)
    # float64 reference with an accurate GELU (tf.nn.gelu loses ~1e-6 in float64's tails)
    xs, k = tf.constant(np64(x)), tf.constant(np64(ours.kernel))
    b = tf.constant(np64(ours.bias)) if use_bias else None
    with tf.GradientTape() as tape:
        tape.watch([xs, k] + ([b] if use_bias else []))
        h = tf.tensordot(xs, k, 1) + (b if use_bias else 0.0)
        yr = gelu64(h, approximate)
        loss = tf.reduce_sum(yr * tf.cast(dy, tf.float64))
    grs = tape.gradient(loss, [xs, k] + ([b] if use_bias else []))
    gr = dict(zip(["x", "kernel", "bias"], grs))

    assert y.dtype == tf.float32 and tuple(y.shape) == (*shape[:-1], units)
    what = f"FusedLinearGELU({units}, use_bias={use_bias}, approximate={approximate}){shape}"
    n = int(np.prod(y.shape))
    assert_calibrated(rel_err(y, yr), rel_err(yk, yr), what, dtype="float32", numel=n, rng=rng,
                      floor=2 * EPS["float32"])
    assert sorted(g) == sorted(gr)
    # gradient terms through gelu' are ill-conditioned near its zero (pre ~ -0.75): judge them
    # against |dy| * (|gelu'| + |pre|) summed, like test_tf_ops does
    with tf.GradientTape() as tape:
        tape.watch(h)
        act64 = gelu64(h, approximate)
    s = np.abs(np64(dy)) * (np.abs(tape.gradient(act64, h).numpy()) + np.abs(h.numpy()))
    s2 = s.reshape(-1, units)
    x2 = np.abs(np64(x)).reshape(-1, shape[-1])
    scales = {"x": (s2 @ np.abs(np64(ours.kernel)).T).reshape(shape), "kernel": x2.T @ s2,
              "bias": s2.sum(0)}
    for name in gr:
        assert g[name] is not None, f"{what}: no gradient for {name}"
        assert_calibrated(rel_err(g[name], gr[name], scales[name]),
                          rel_err(gk[name], gr[name], scales[name]), f"{what} d{name}",
                          dtype="float32", numel=int(np.prod(gr[name].shape)), rng=rng,
                          floor=2 * EPS["float32"])


def test_linear_gelu_defaults_match_dense():
    ours, theirs = FusedLinearGELU(3), keras.layers.Dense(3, activation="gelu")
    assert ours.use_bias is theirs.use_bias is True
    assert ours.approximate is False
    for attr in ("kernel_initializer", "bias_initializer"):
        assert type(getattr(ours, attr)) is type(getattr(theirs, attr)), attr
    with pytest.raises(ValueError, match="units must be a positive integer"):
        FusedLinearGELU(0)


# --------------------------------------------------------------------------------------------
# FusedReLUScale

def test_relu_scale_layer(rng):
    alpha = float(rng.uniform(-3, 3))
    layer = FusedReLUScale(alpha)
    x = tf.constant(rng.normal((4, 5, 6)), tf.float32)
    dy = tf.constant(rng.normal((4, 5, 6)), tf.float32)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = layer(x)
        want = keras.activations.relu(x) * alpha
        l1, l2 = tf.reduce_sum(y * dy), tf.reduce_sum(want * dy)
    np.testing.assert_array_equal(y.numpy(), want.numpy(), err_msg=str(rng))
    np.testing.assert_array_equal(tape.gradient(l1, x).numpy(), tape.gradient(l2, x).numpy(),
                                  err_msg=str(rng))
    assert layer.weights == []
    assert FusedReLUScale().alpha == 1.0


def test_supports_jit():
    """The ops have XLA kernels: a fused layer keeps XLA on for its model."""
    for layer in (LayerNorm(), FusedLinearGELU(2), FusedReLUScale(2.0)):
        assert layer.supports_jit is True


# --------------------------------------------------------------------------------------------
# config round trips

def _roundtrip(layer, x=None):
    cfg = layer.get_config()
    clone = type(layer).from_config(cfg)
    assert clone.get_config() == cfg
    # and through Keras' own (de)serialization, by registered name
    ser = keras.layers.serialize(layer)
    back = keras.layers.deserialize(ser)
    assert type(back) is type(layer) and back.get_config() == cfg
    return clone, cfg


def test_layer_norm_config_roundtrip():
    layer = LayerNorm(axis=[1, 2], epsilon=3e-4, center=False, scale=True, rms_scaling=True,
                      beta_initializer="ones",
                      gamma_initializer=keras.initializers.RandomNormal(0.5, 0.1, seed=3),
                      beta_regularizer=keras.regularizers.L2(0.02),
                      gamma_regularizer=keras.regularizers.L1(0.01),
                      beta_constraint=keras.constraints.NonNeg(),
                      gamma_constraint=keras.constraints.MaxNorm(2.5),
                      name="my_ln", dtype="float64", trainable=False)
    clone, cfg = _roundtrip(layer)
    assert clone.axis == [1, 2] and clone.epsilon == 3e-4
    assert (clone.center, clone.scale, clone.rms_scaling) == (False, True, True)
    assert isinstance(clone.beta_initializer, keras.initializers.Ones)
    gi = clone.gamma_initializer
    assert isinstance(gi, keras.initializers.RandomNormal)
    assert (gi.mean, gi.stddev, gi.seed) == (0.5, 0.1, 3)
    assert isinstance(clone.beta_regularizer, keras.regularizers.L2)
    assert math.isclose(clone.beta_regularizer.l2, 0.02, rel_tol=1e-6)
    assert isinstance(clone.gamma_regularizer, keras.regularizers.L1)
    assert math.isclose(clone.gamma_regularizer.l1, 0.01, rel_tol=1e-6)
    assert isinstance(clone.beta_constraint, keras.constraints.NonNeg)
    assert isinstance(clone.gamma_constraint, keras.constraints.MaxNorm)
    assert clone.gamma_constraint.max_value == 2.5
    assert clone.name == "my_ln" and clone.dtype == "float64" and clone.trainable is False
    # after build (axis is normalized to a sorted list) the config still round trips
    layer.build((2, 3, 4))
    _roundtrip(layer)
    one = LayerNorm(axis=2)
    _roundtrip(one)
    assert LayerNorm.from_config(one.get_config()).axis == 2


def test_linear_gelu_config_roundtrip():
    layer = FusedLinearGELU(
        7, use_bias=False, approximate=True,
        kernel_initializer=keras.initializers.HeNormal(seed=5), bias_initializer="ones",
        kernel_regularizer=keras.regularizers.L1L2(0.1, 0.2),
        bias_regularizer=keras.regularizers.L2(0.3),
        activity_regularizer=keras.regularizers.L1(0.4),
        kernel_constraint=keras.constraints.UnitNorm(axis=1),
        bias_constraint=keras.constraints.NonNeg(), name="my_lg", dtype="float64")
    clone, cfg = _roundtrip(layer)
    assert (clone.units, clone.use_bias, clone.approximate) == (7, False, True)
    assert isinstance(clone.kernel_initializer, keras.initializers.HeNormal)
    assert clone.kernel_initializer.seed == 5
    assert isinstance(clone.bias_initializer, keras.initializers.Ones)
    kr = clone.kernel_regularizer
    assert isinstance(kr, keras.regularizers.L1L2)
    assert math.isclose(kr.l1, 0.1, rel_tol=1e-6) and math.isclose(kr.l2, 0.2, rel_tol=1e-6)
    assert isinstance(clone.bias_regularizer, keras.regularizers.L2)
    assert isinstance(clone.activity_regularizer, keras.regularizers.L1)
    assert math.isclose(clone.activity_regularizer.l1, 0.4, rel_tol=1e-6)
    assert isinstance(clone.kernel_constraint, keras.constraints.UnitNorm)
    assert clone.kernel_constraint.axis == 1
    assert isinstance(clone.bias_constraint, keras.constraints.NonNeg)
    assert clone.name == "my_lg" and clone.dtype == "float64"
    layer.build((2, 4))
    _roundtrip(layer)


def test_relu_scale_config_roundtrip(rng):
    alpha = float(rng.uniform(0.1, 5))
    layer = FusedReLUScale(alpha, name="rs", dtype="float64")
    clone, cfg = _roundtrip(layer)
    assert clone.alpha == alpha and clone.name == "rs" and clone.dtype == "float64"


# --------------------------------------------------------------------------------------------
# a model: fit, save, load

def _model(in_features):
    inp = keras.Input((in_features,))
    h = FusedLinearGELU(16, name="lg")(inp)
    h = LayerNorm(name="ln")(h)
    h = FusedReLUScale(0.7, name="rs")(h)
    out = keras.layers.Dense(1, name="head")(h)
    return keras.Model(inp, out)


def _data(rng, n=256, d=6):
    x = rng.normal((n, d)).astype(np.float32)
    w = rng.normal((d, 1))
    y = (np.tanh(x @ w) + 0.05 * rng.normal((n, 1))).astype(np.float32)
    return x, y


def test_model_fit_save_load(rng, tmp_path):
    keras.utils.set_random_seed(rng.seed % 2 ** 31)
    x, y = _data(rng)
    model = _model(x.shape[1])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    assert model.jit_compile is False  # 'auto' must not pick XLA with our layers
    before = {w.path: w.numpy().copy() for w in model.weights}
    hist = model.fit(x, y, epochs=2, batch_size=32, verbose=0)
    losses = hist.history["loss"]
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0], f"loss did not decrease: {losses} ({rng})"
    changed = {p for p, v in before.items()
               if not np.array_equal(v, next(w for w in model.weights if w.path == p).numpy())}
    for p in ("lg/kernel", "lg/bias", "ln/gamma", "ln/beta"):
        assert p in changed, f"{p} was not trained (changed: {sorted(changed)})"

    path = os.path.join(tmp_path, "x.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert [type(layer).__name__ for layer in loaded.layers] == \
           [type(layer).__name__ for layer in model.layers]
    xt = rng.normal((17, x.shape[1])).astype(np.float32)
    np.testing.assert_array_equal(loaded.predict(xt, verbose=0), model.predict(xt, verbose=0))
    np.testing.assert_array_equal(loaded(xt).numpy(), model(xt).numpy())
    # the loaded model trains on
    loaded.compile(optimizer="adam", loss="mse")
    assert math.isfinite(loaded.fit(x, y, epochs=1, verbose=0).history["loss"][0])


def test_sequential_model_all_layers(rng):
    x, y = _data(rng, n=64, d=5)
    model = keras.Sequential([keras.Input((5,)), FusedLinearGELU(8, approximate=True),
                              LayerNorm(center=False), FusedReLUScale(2.0),
                              keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    loss = model.fit(x, y, epochs=2, verbose=0).history["loss"]
    assert all(math.isfinite(v) for v in loss), loss


# --------------------------------------------------------------------------------------------
# XLA: models of fused layers compile with jit_compile=True, our kernels inside XLA

def test_model_jit_compile_true(rng):
    """compile(jit_compile=True) keeps XLA for a model of fused layers, which trains, and its
    compiled train step calls our custom calls."""
    x, y = _data(rng, n=64, d=6)
    model = _model(6)
    model.compile(optimizer="adam", loss="mse", jit_compile=True)
    loss = model.fit(x, y, epochs=2, verbose=0).history["loss"]
    assert model.jit_compile is True
    assert all(math.isfinite(v) for v in loss) and loss[-1] < loss[0], loss
    hlo = tf.function(lambda t: model(t, training=True), jit_compile=True
                      ).experimental_get_compiler_ir(tf.constant(x[:4]))(stage="optimized_hlo")
    assert "fusedlayers_layer_norm_forward" in hlo and "fusedlayers_linear_gelu_forward" in hlo


@pytest.mark.cuda
@pytest.mark.parametrize("jit_compile", [False, True])
def test_model_trains_on_gpu_as_on_cpu(rng, jit_compile):
    """A model of fused layers trained on TensorFlow's GPU (the CUDA kernels; under
    jit_compile=True their XLA custom calls) from the same weights, on the same batches, follows
    the CPU's losses and ends at its weights, its variables on the GPU."""
    tf_device("cuda")  # skips where TensorFlow sees no GPU
    x, y = _data(rng, n=128, d=6)
    init = _model(6).get_weights()
    runs = {}
    for device in ("/CPU:0", "/GPU:0"):
        with tf.device(device):
            model = _model(6)
            model.set_weights(init)
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse",
                          jit_compile=jit_compile)
            hist = model.fit(x, y, epochs=3, batch_size=32, shuffle=False, verbose=0)
            runs[device] = (hist.history["loss"], model.get_weights(),
                            {w.path: w.value.device for w in model.weights})
    (cpu_losses, cpu_weights, _), (losses, weights, placed) = runs["/CPU:0"], runs["/GPU:0"]
    assert model.jit_compile is jit_compile
    assert all(d.endswith("GPU:0") for d in placed.values()), placed
    assert losses[-1] < losses[0], f"loss did not decrease: {losses} ({rng})"
    np.testing.assert_allclose(losses, cpu_losses, rtol=1e-4, err_msg=str(rng))
    for w, c in zip(weights, cpu_weights):
        np.testing.assert_allclose(w, c, rtol=1e-4, atol=1e-5, err_msg=str(rng))


class OpsModel(keras.Model):
    """A subclassed model calling the functional ops directly (no fused layers to opt out)."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(6)

    def call(self, x):
        import fusedlayers
        return fusedlayers.relu_scale(fusedlayers.layer_norm(self.dense(x), 6), 0.5)


def test_functional_ops_in_xla_model(rng):
    x, y = _data(rng, n=32, d=6)
    model = OpsModel()
    model.compile(optimizer="adam", loss="mse", jit_compile=True)
    loss = model.fit(x, np.repeat(y, 6, axis=1), epochs=1, verbose=0).history["loss"]
    assert math.isfinite(loss[0])


# --------------------------------------------------------------------------------------------
# mixed precision

@pytest.mark.parametrize("name", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision(rng, policy, name):
    policy(name)
    half = name.split("_")[1]
    shape = (6, 5, 24)
    x = tf.constant(rng.normal(shape, loc=0.5), tf.float32)
    pairs = {
        "ln": (LayerNorm(), keras.layers.LayerNormalization()),
        "ln_axes": (LayerNorm(axis=[1, 2]), keras.layers.LayerNormalization(axis=[1, 2])),
        "ln_rms": (LayerNorm(rms_scaling=True), quiet_layernorm(rms_scaling=True)),
        "lg": (FusedLinearGELU(13), keras.layers.Dense(13, activation="gelu")),
        "lg_tanh": (FusedLinearGELU(13, approximate=True),
                    keras.layers.Dense(13, activation=lambda t: keras.activations.gelu(
                        t, approximate=True))),
    }
    for key, (ours, theirs) in pairs.items():
        assert ours.compute_dtype == half and ours.variable_dtype == "float32"
        for xin in (x, tf.cast(x, half)):
            ours(xin)
            theirs(xin)
            for w in ours.weights:
                assert w.dtype == "float32", (key, w.name, w.dtype)
            set_weights_by_name(rng, [ours, theirs],
                                scale=0.3 if key.startswith("ln") else 1.5 / math.sqrt(24))
            # float64 reference: the same layer type, float64 policy, same weights
            if key.startswith("ln"):
                ref = quiet_layernorm(axis=ours.axis, epsilon=ours.epsilon, center=ours.center,
                                      scale=ours.scale, rms_scaling=ours.rms_scaling,
                                      dtype="float64")
            else:
                ref = keras.layers.Dense(13, activation=lambda t: gelu64(t, ours.approximate),
                                         dtype="float64")
            ref(tf.cast(xin, tf.float64))
            for w in ref.weights:
                w.assign(tf.cast(next(o for o in ours.weights if o.name == w.name), tf.float64))
            # Random dy, rounded to the compute dtype as it would arrive from the next layer.
            dy = tf.cast(rng.normal(ours.compute_output_shape(x.shape)), half)
            y, g = forward_and_grads(ours, xin, dy)
            yk, gk = forward_and_grads(theirs, xin, dy)
            yr, gr = forward_and_grads(ref, tf.cast(xin, tf.float64), tf.cast(dy, tf.float64))
            assert y.dtype == half, (key, y.dtype)
            assert yk.dtype == half
            what = f"{name} {key} input {xin.dtype.name}"
            assert_calibrated(rel_err(y, yr), rel_err(yk, yr), what, dtype=half,
                              numel=int(np.prod(y.shape)), rng=rng, floor=2 * EPS[half])
            assert g.keys() == gr.keys(), (what, g.keys(), gr.keys())
            for wname, gw in g.items():
                assert gw is not None, (what, wname)
                assert gw.dtype == (xin.dtype if wname == "x" else tf.float32), (
                    what, wname, gw.dtype)
                # Each gradient against float64, bounded by Keras' own error on the same
                # inputs plus a few ulps of the gradient's own dtype: float32 weight gradients
                # of LayerNorm are float32-exact (~1e-7), those of a half GEMM are not: theirs
                # sum half products (dbias of 13 elements: seed 1510949 was 4.4e-4 against
                # Keras' 2.1e-4), so their few-element noise is an ulp of the compute dtype.
                assert_calibrated(rel_err(gw, gr[wname]), rel_err(gk[wname], gr[wname]),
                                  f"{what} d{wname}",
                                  dtype=half if key.startswith("lg") else gw.dtype.name,
                                  numel=int(np.prod(gw.shape)), rng=rng,
                                  floor=4 * EPS[gw.dtype.name])


def test_mixed_float16_layer_norm_large_gamma(rng, policy):
    """gamma = 1000: Keras computes in float32 and casts; y ~ 1000 * xhat must not be computed
    or stored through float16 intermediates that lose it (or overflow)."""
    policy("mixed_float16")
    shape = (8, 64)
    x = tf.constant(rng.normal(shape, loc=3.0, scale=2.0), tf.float32)
    for kw in ({}, {"rms_scaling": True}):
        ours, theirs = LayerNorm(**kw), quiet_layernorm(**kw)
        ours(x)
        theirs(x)
        for w in (*ours.weights, *theirs.weights):
            w.assign(tf.fill(w.shape, 1000.0) if w.name == "gamma" else
                     tf.constant(rng.normal(tuple(w.shape)), tf.float32))
        for w in theirs.weights:
            if w.name == "beta":
                w.assign(ours.beta)
        ref = quiet_layernorm(dtype="float64", **kw)
        ref(tf.cast(x, tf.float64))
        for w in ref.weights:
            w.assign(tf.cast(next(o for o in ours.weights if o.name == w.name), tf.float64))
        for xin in (x, tf.cast(x, tf.float16)):
            y, yk, yr = ours(xin), theirs(xin), ref(tf.cast(xin, tf.float64))
            assert y.dtype == tf.float16
            assert np.all(np.isfinite(np64(y))), str(rng)
            assert_calibrated(rel_err(y, yr), rel_err(yk, yr), f"gamma=1000 {kw}",
                              dtype="float16", numel=int(np.prod(shape)), rng=rng,
                              floor=2 * EPS["float16"])


def test_mixed_policy_model_fit(rng, policy):
    policy("mixed_bfloat16")
    x, y = _data(rng, n=64, d=6)
    model = _model(6)
    model.compile(optimizer="adam", loss="mse")
    loss = model.fit(x, y, epochs=2, verbose=0).history["loss"]
    assert all(math.isfinite(v) for v in loss), loss
    assert model.get_layer("ln").gamma.dtype == "float32"
    assert model.get_layer("lg").kernel.dtype == "float32"
    assert model.get_layer("ln").compute_dtype == "bfloat16"
