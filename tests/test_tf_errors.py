"""Bad inputs to the TensorFlow ops raise tf.errors.InvalidArgumentError whose message names the
argument and the expected and received values (docs/DESIGN.md, "Bad input"), eagerly and in
tf.function; the raw op's C++ OP_REQUIRES checks hold when the Python checks are bypassed."""

import math
import re

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import fusedlayers as fl  # noqa: E402
from fusedlayers.tensorflow import _op, layer_norm_trailing  # noqa: E402

from _helpers import assert_survives_subprocess, concurrent_mismatches  # noqa: E402

keras = pytest.importorskip("keras")
from fusedlayers.keras import FusedLinearGELU, FusedReLUScale, LayerNorm  # noqa: E402

IAE = tf.errors.InvalidArgumentError


@pytest.fixture
def data(rng):
    return dict(
        x=tf.constant(rng.normal((3, 7)), tf.float32),
        w=tf.constant(rng.normal((5, 7)), tf.float32),
        b=tf.constant(rng.normal(5), tf.float32),
        g=tf.constant(rng.normal(7), tf.float32),
        beta=tf.constant(rng.normal(7), tf.float32),
    )


def _both_modes(fn):
    """Runs fn eagerly and traced in a tf.function; both must raise the same way."""
    yield "eager", fn
    yield "tf.function", tf.function(fn)


# --------------------------------------------------------------------------------------------
# shapes

def test_layer_norm_wrong_trailing_dims_multi(rng):
    x = tf.constant(rng.normal((2, 3, 4)), tf.float32)
    with pytest.raises(IAE, match=r"last 2 dimension\(s\).*normalized_shape \[3, 5\].*\[2, 3, 4\]"):
        fl.layer_norm(x, [3, 5])
    with pytest.raises(IAE, match=r"normalized_shape \[2, 3, 4, 1\]"):
        fl.layer_norm(x, [2, 3, 4, 1])  # more dims than x has


def test_linear_gelu_weight_not_2d(data):
    with pytest.raises(IAE, match=r"weight must be 2-D.*got shape \[5, 7, 1\]"):
        fl.linear_gelu(data["x"], tf.ones([5, 7, 1]))


def test_linear_gelu_scalar_x(data):
    with pytest.raises(IAE, match=r"in_features = 7.*shape \[\]"):
        fl.linear_gelu(tf.constant(1.0), data["w"])


def test_layer_norm_multi_dim_gamma_shape(rng):
    x = tf.constant(rng.normal((2, 3, 4)), tf.float32)
    with pytest.raises(IAE, match=r"weight must have shape normalized_shape \[3, 4\], got \[12\]"):
        fl.layer_norm(x, [3, 4], tf.ones([12]))


# --------------------------------------------------------------------------------------------
# dtypes

@pytest.mark.parametrize("op", ["relu_scale", "linear_gelu", "layer_norm"])
@pytest.mark.parametrize("dtype", [tf.int32, tf.int64, tf.bool])
def test_non_float_x(data, op, dtype):
    x = tf.cast(data["x"] * 10, dtype)
    call = {"relu_scale": lambda: fl.relu_scale(x, 2.0),
            "linear_gelu": lambda: fl.linear_gelu(x, data["w"]),
            "layer_norm": lambda: fl.layer_norm(x, 7)}[op]
    with pytest.raises(IAE, match=rf"fusedlayers\.{op}: x must be float32, float64, float16 or "
                                  rf"bfloat16, got {dtype.name}"):
        call()


def test_linear_gelu_int_weight(data):
    with pytest.raises(IAE, match=r"weight must be float32.*got int32"):
        fl.linear_gelu(data["x"], tf.cast(data["w"], tf.int32))


@pytest.mark.parametrize("half", [tf.float16, tf.bfloat16])
def test_layer_norm_param_dtype_for_half_x(data, half):
    """Half x takes parameters in its own dtype or float32, nothing else."""
    x = tf.cast(data["x"], half)
    fl.layer_norm(x, 7, data["g"], data["beta"])  # float32 params: fine
    fl.layer_norm(x, 7, tf.cast(data["g"], half), tf.cast(data["beta"], half))  # fine
    with pytest.raises(IAE, match=rf"weight must have x's dtype {half.name} or float32, got float64"):
        fl.layer_norm(x, 7, tf.cast(data["g"], tf.float64))


@pytest.mark.parametrize("which", ["weight", "bias"])
def test_layer_norm_weight_and_bias_dtypes_differ(data, which):
    """Both parameters given, one float64, for float32 x: the error must name the argument and
    the dtypes, like every other mismatch -- not TF's generic 'cannot compute
    FusedlayersLayerNorm as input #2(zero-based) was expected to be a float tensor but is a
    double tensor'."""
    args = {"weight": data["g"], "bias": data["beta"]}
    args[which] = tf.cast(args[which], tf.float64)
    with pytest.raises(IAE) as info:
        fl.layer_norm(data["x"], 7, args["weight"], args["bias"])
    msg = str(info.value)
    assert "float64" in msg, msg
    names = {"weight": ("weight", "gamma"), "bias": ("bias", "beta")}[which]
    assert any(n in msg for n in names), f"the message does not name {which}: {msg!r}"


# --------------------------------------------------------------------------------------------
# scalars and options

@pytest.mark.parametrize("eps", [math.nan, math.inf, -math.inf, -1e-5, 1e300])
def test_layer_norm_bad_eps(data, eps):
    for mode, f in _both_modes(lambda: fl.layer_norm(data["x"], 7, eps=eps)):
        with pytest.raises(IAE, match=rf"eps must be finite and >= 0 as a float32 \(the op "
                                      rf"attribute's type\), got {re.escape(str(eps))}"):
            f()
    with pytest.raises(IAE, match=r"eps must be finite"):
        layer_norm_trailing(data["x"], 1, eps=eps, rms_scaling=True)


def test_relu_scale_alpha_overflowing_float32(data):
    """alpha = 1e39 is a finite double but not a finite float32 (the op attribute): whatever
    the op does, it must not silently return inf * x or NaN where relu(x) * alpha is finite in
    float64, nor crash: either an InvalidArgumentError about alpha, or the float64 result."""
    x64 = tf.cast(data["x"], tf.float64)
    try:
        y = fl.relu_scale(x64, 1e39)
    except IAE as e:
        assert "alpha" in str(e), str(e)
        return
    np.testing.assert_allclose(y.numpy(), (tf.nn.relu(x64) * 1e39).numpy(), rtol=1e-12)


@pytest.mark.parametrize("approximate", ["foo", "erf", "TANH", "", None])
def test_linear_gelu_bad_approximate(data, approximate):
    with pytest.raises(IAE, match=rf"approximate must be 'none' or 'tanh', got {approximate!r}"):
        fl.linear_gelu(data["x"], data["w"], data["b"], approximate)


def test_dispatch_rejects_non_tensors():
    with pytest.raises(TypeError, match=r"relu_scale: x must be a torch.Tensor, tf.Tensor, "
                                        r"tf.Variable or jax.Array, got numpy.ndarray"):
        fl.relu_scale(np.ones(3, np.float32), 1.0)
    with pytest.raises(TypeError, match=r"layer_norm: .*got builtins.list"):
        fl.layer_norm([1.0, 2.0], 2)


# --------------------------------------------------------------------------------------------
# the raw ops: C++ OP_REQUIRES (the Python wrappers' checks bypassed)

def test_raw_layer_norm_wrong_weight_shape(data):
    lib = _op.lib

    def raw():
        return lib.fusedlayers_layer_norm(
            data["x"], tf.ones([6]), tf.zeros([0]), normalized_shape=[7], eps=1e-5, has_weight=True,
            has_bias=False, U=tf.float32)

    msg = r"fusedlayers\.layer_norm: weight must have shape normalized_shape \[7\], got \[6\]"
    for mode, f in _both_modes(raw):
        with pytest.raises(IAE, match=msg):
            f()


def test_raw_layer_norm_wrong_bias_shape_and_rank(data):
    lib = _op.lib
    with pytest.raises(IAE, match=r"bias must have shape normalized_shape \[7\], got \[7, 1\]"):
        lib.fusedlayers_layer_norm(data["x"], tf.zeros([0]), tf.ones([7, 1]), normalized_shape=[7],
                                   eps=1e-5, has_weight=False, has_bias=True, U=tf.float32)
    with pytest.raises(IAE, match=r"the last 3 dimension\(s\) of x must equal normalized_shape "
                                   r"\[2, 3, 7\], got x of shape \[3, 7\]"):
        lib.fusedlayers_layer_norm(data["x"], tf.zeros([0]), tf.zeros([0]),
                                   normalized_shape=[2, 3, 7],
                                   eps=1e-5, has_weight=False, has_bias=False, U=tf.float32)


def test_raw_layer_norm_stat_dtype(data):
    with pytest.raises(IAE, match=r"U \(the statistics dtype\) must be float32 for x of float32"):
        _op.lib.fusedlayers_layer_norm(data["x"], tf.zeros([0]), tf.zeros([0]), normalized_shape=[7],
                                        eps=1e-5, has_weight=False, has_bias=False,
                                        U=tf.float64)


def test_raw_layer_norm_nan_eps(data):
    with pytest.raises(IAE, match=r"eps must be finite"):
        _op.lib.fusedlayers_layer_norm(data["x"], tf.zeros([0]), tf.zeros([0]), normalized_shape=[7],
                                        eps=math.nan, has_weight=False, has_bias=False,
                                        U=tf.float32)


def test_raw_relu_scale_alpha_and_grad_shape(data):
    with pytest.raises(IAE, match=r"alpha must be finite, got nan"):
        _op.lib.fusedlayers_relu_scale(data["x"], alpha=math.nan)
    _, mask = _op.lib.fusedlayers_relu_scale(data["x"], alpha=1.0)
    with pytest.raises(IAE, match=r"mask must have shape \[2\] for dy of 40 elements, "
                                   r"got \[1\]"):
        _op.lib.fusedlayers_relu_scale_grad(tf.ones([5, 8]), mask, alpha=1.0)


def test_raw_linear_gelu_epilogue_bias_shape_and_grad_shape(data):
    with pytest.raises(IAE, match=r"bias must have shape \[7\] \(out_features\), got \[5\]"):
        _op.lib.fusedlayers_linear_gelu_epilogue(data["x"], data["b"], has_bias=True)
    with pytest.raises(IAE, match=r"dy must match pre \(\[3, 7\], float32\), "
                                   r"got \[7, 3\], float32"):
        _op.lib.fusedlayers_linear_gelu_epilogue_grad(tf.ones([7, 3]), data["x"], has_bias=False)
    with pytest.raises(IAE, match=r"at least 1-D"):
        _op.lib.fusedlayers_linear_gelu_epilogue(tf.constant(1.0), tf.zeros([0]), has_bias=False)


def test_raw_layer_norm_grad_shapes(data):
    x = data["x"]
    y, mean, rstd = _op.lib.fusedlayers_layer_norm(
        x, data["g"], data["beta"], normalized_shape=[7], eps=1e-5, has_weight=True, has_bias=True,
        U=tf.float32)
    with pytest.raises(IAE, match=r"dy must match saved \(\[3, 7\], float32\), got \[3, 6\]"):
        _op.lib.fusedlayers_layer_norm_grad(tf.ones([3, 6]), x, mean, rstd, data["g"],
                                             data["beta"], normalized_shape=[7], has_weight=True,
                                             has_bias=True)
    with pytest.raises(IAE, match=r"mean/rstd must hold 3 float32 values, got 2 float32"):
        _op.lib.fusedlayers_layer_norm_grad(tf.ones([3, 7]), x, mean[:2], rstd[:2], data["g"],
                                             data["beta"], normalized_shape=[7], has_weight=True,
                                             has_bias=True)


# --------------------------------------------------------------------------------------------
# argument types and frameworks

@pytest.mark.parametrize("call,match", [
    (lambda d: fl.relu_scale(d["x"], "2"), r"relu_scale: alpha must be a real number, got str"),
    (lambda d: fl.layer_norm(d["x"], 7, eps="1e-5"), r"layer_norm: eps must be a real number"),
    (lambda d: fl.layer_norm(d["x"], 7.0), r"layer_norm: normalized_shape must be an int or a "
                                           r"sequence of ints, got float 7.0"),
    (lambda d: FusedReLUScale(alpha="2"), r"FusedReLUScale: alpha must be a real number"),
], ids=("alpha-str", "eps-str", "shape-float", "layer-alpha-str"))
def test_argument_types(data, call, match):
    with pytest.raises(TypeError, match=match):
        call(data)


def test_tensor_of_another_framework(data):
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"linear_gelu: x is a TensorFlow tensor, so weight must "
                                        r"not be a torch.Tensor"):
        fl.linear_gelu(data["x"], torch.ones(5, 7))
    with pytest.raises(TypeError, match=r"layer_norm: x is a TensorFlow tensor, so bias must not"):
        fl.layer_norm(data["x"], 7, data["g"], torch.zeros(7))
    with pytest.raises(TypeError, match=r"x is a torch.Tensor, so weight must be one too, got "
                                        r"tensorflow"):
        fl.layer_norm(torch.ones(3, 7), 7, data["g"])


def test_layer_norm_zero_size_normalized_shape(data):
    with pytest.raises(IAE, match=r"normalized_shape must have positive sizes, got \[0\]"):
        fl.layer_norm(tf.zeros((3, 0)), 0)


# --------------------------------------------------------------------------------------------
# odd but valid inputs: each equals TF's unfused ops (forward and gradients, NaN where NaN);
# the cases that could crash the interpreter run in a subprocess

NONFINITE = [math.nan, math.inf, -math.inf, 0.0, -0.0]


def odd_case(name: str):
    """(inputs, fused, unfused): both map the inputs (tf constants) to an output."""
    op, what = name.split(":")
    gen = np.random.default_rng(abs(hash(name)) % 2**32)
    rows = 0 if what == "empty" else 5
    cols = 1 if what == "one-element-rows" else 6
    if op == "linear_gelu":
        cols = {"in-features-0": 0}.get(what, cols)
    x = gen.standard_normal((rows, cols)).astype(np.float32)
    if what == "nonfinite":
        x.reshape(-1)[:len(NONFINITE)] = NONFINITE
    x = tf.constant(x)
    if op in ("relu_scale", "FusedReLUScale"):
        alpha = {"alpha-0": 0.0, "alpha-negative": -1.5}.get(what, 0.7)
        fused = (lambda t: fl.relu_scale(t, alpha)) if op == "relu_scale" else FusedReLUScale(alpha)
        # NaN's gradient is dy * alpha (torch's convention, documented; tf.nn.relu's is 0)
        return [x], fused, lambda t: tf.where(tf.math.is_nan(t), t, tf.nn.relu(t)) * alpha
    if op in ("layer_norm", "LayerNorm"):
        eps = {"eps-huge": 1e10, "eps-tiny": 1e-30, "eps-0": 0.0}.get(what, 1e-3)
        g, b = (tf.constant(gen.standard_normal(cols), tf.float32) for _ in range(2))
        ref = keras.layers.LayerNormalization(epsilon=eps)
        ref.build(x.shape)
        ref.set_weights([g.numpy(), b.numpy()])
        if op == "LayerNorm":
            layer = LayerNorm(epsilon=eps)
            layer.build(x.shape)
            layer.set_weights([g.numpy(), b.numpy()])
            return [x], layer, ref
        return [x, g, b], lambda t, gg, bb: fl.layer_norm(t, cols, gg, bb, eps), \
            lambda t, gg, bb: tf_layer_norm(t, gg, bb, eps)
    out_f = {"out-features-0": 0}.get(what, 4)
    w, b = (tf.constant(gen.standard_normal(s), tf.float32) for s in ((out_f, cols), out_f))
    if op == "linear_gelu":
        return [x, w, b], lambda t, ww, bb: fl.linear_gelu(t, ww, bb, "tanh"), \
            lambda t, ww, bb: tf.nn.gelu(tf.matmul(t, ww, transpose_b=True) + bb, approximate=True)
    layer = FusedLinearGELU(out_f, approximate=True)
    layer.build(x.shape)
    layer.set_weights([tf.transpose(w).numpy(), b.numpy()])
    return [x], layer, lambda t: tf.nn.gelu(tf.matmul(t, w, transpose_b=True) + b,
                                            approximate=True)


def tf_layer_norm(x, g, b, eps):
    mean, var = tf.nn.moments(x, [-1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(var + eps) * g + b


ODD_CASES = ([f"{op}:{w}" for op in ("relu_scale", "layer_norm", "linear_gelu", "FusedReLUScale",
                                     "LayerNorm", "FusedLinearGELU")
              for w in ("empty", "one-element-rows", "nonfinite")]
             + ["relu_scale:alpha-0", "relu_scale:alpha-negative", "layer_norm:eps-huge",
                "layer_norm:eps-tiny", "layer_norm:eps-0", "linear_gelu:in-features-0",
                "linear_gelu:out-features-0"])
RISKY = ("empty", "in-features-0", "out-features-0")


def check_odd_case(name: str) -> None:
    inputs, fused, unfused = odd_case(name)
    got, want = (tf_grads_all(f, inputs) for f in (fused, unfused))
    for i, (a, r) in enumerate(zip(got, want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-5, atol=1e-5,
                                   err_msg=f"{name}: {'output' if i == 0 else f'gradient {i}'}")


def tf_grads_all(fn, inputs):
    """fn's output and the gradients of sum(output * dy) wrt the inputs and fn's weights (zeros
    where the gradient is None), dy fixed by the output's shape."""
    with tf.GradientTape() as tape:
        tape.watch(inputs)
        y = fn(*inputs)
    weights = list(getattr(fn, "trainable_weights", []))
    dy = tf.reshape(tf.range(tf.size(y), dtype=y.dtype) % 3 - 1, tf.shape(y))
    gs = tape.gradient(y, inputs + weights, output_gradients=dy)
    return [y] + [tf.zeros_like(v) if g is None else g for v, g in zip(inputs + weights, gs)]


@pytest.mark.parametrize("name", [c for c in ODD_CASES if c.split(":")[1] not in RISKY])
def test_odd_input(name):
    if name[0].isupper() and keras.backend.backend() != "tensorflow":
        pytest.skip("the Keras layers take TF tensors under KERAS_BACKEND=tensorflow")
    check_odd_case(name)


def test_odd_input_risky_in_subprocess():
    risky = [c for c in ODD_CASES if c.split(":")[1] in RISKY
             and (c[0].islower() or keras.backend.backend() == "tensorflow")]
    assert_survives_subprocess("test_tf_errors", "check_odd_case", risky,
                               {"TF_CPP_MIN_LOG_LEVEL": "2"})


@pytest.mark.parametrize("op", ("relu_scale", "layer_norm", "linear_gelu"))
def test_two_threads_same_op(op, rng):
    """Two Python threads running the same op (forward and gradient) at once, on inputs of
    different shapes, get bitwise what one thread gets."""
    def run(x, w):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            if op == "relu_scale":
                y = fl.relu_scale(x, 0.5)
            elif op == "layer_norm":
                y = fl.layer_norm(x, x.shape[-1], w)
            else:
                y = fl.linear_gelu(x, w)
        return [y.numpy()] + [g.numpy() for g in tape.gradient(y, [x, w],
                                                                unconnected_gradients="zero")]

    cases = []
    for rows, cols in ((257, 96), (64, 1024)):
        x = tf.constant(rng.normal((rows, cols)), tf.float32)
        w = tf.constant(rng.normal((cols,) if op == "layer_norm" else (cols // 2, cols)),
                        tf.float32)
        cases.append(((x, w), run(x, w)))
    failures = concurrent_mismatches(
        run, cases,
        lambda got, want: all(np.array_equal(g, r, equal_nan=True) for g, r in zip(got, want)))
    assert not failures, [tuple(args[0].shape) for args in failures]
