"""fusedlayers.tensorflow's FP8 ops and layer against torch's: fp8_quantize and fp8_gemm give the
torch ops' bits (each scaling, format, layout, odd sizes, special values; torch's are checked
against float64 in test_fp8*.py), fp8_linear and fp8_dense the torch layer's forward and
gradients under tf.GradientTape (each recipe, float32 masters under bfloat16), in tf.function
too; the argument errors in csrc's words."""

import numpy as np
import pytest
import torch

tf = pytest.importorskip("tensorflow")

import fusedlayers.tensorflow as fltf  # noqa: E402
import fusedlayers.torch as flt  # noqa: E402
from fusedlayers import Fp8Recipe  # noqa: E402

SCALINGS = ["tensorwise", "1x128", "128x128"]
PAIRS = [("tensorwise", "tensorwise"), ("1x128", "128x128"), ("1x128", "1x128")]
RECIPES = {"blockwise": Fp8Recipe(), "tensorwise": Fp8Recipe("tensorwise"),
           "hybrid": Fp8Recipe("tensorwise", "hybrid"),
           "blockwise-pow2": Fp8Recipe(power_of_2_scales=True),
           "fprop-only": Fp8Recipe(gemms=("fprop",)),
           "blockwise-kept": Fp8Recipe(recompute_fp8_weights=False),
           "blockwise-wgrad-tiles": Fp8Recipe(wgrad_x_scaling="128x128")}
TORCH = {tf.float32: torch.float32, tf.bfloat16: torch.bfloat16, tf.float16: torch.float16}


def bits(t) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        return t.view(torch.uint8).numpy()
    return t.numpy().view(np.uint8)


def as_float(t) -> np.ndarray:
    return tf.cast(t, tf.float32).numpy()


def values(rng, shape, octaves=(-6, 6)):
    """bfloat16-exact values, rows over a few octaves (their block scales differ)."""
    x = rng.normal(shape) * np.exp2(rng.gen.integers(*octaves, shape[:-1] + (1,)))
    return torch.from_numpy(x).to(torch.bfloat16).float().numpy()


@pytest.mark.parametrize("transpose", [False, True], ids=["rows", "cast-transpose"])
@pytest.mark.parametrize("format", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16, tf.float16], ids=str)
@pytest.mark.parametrize("scaling,scaling_t", [(s, None) for s in SCALINGS] +
                         [("1x128", "128x128")], ids=SCALINGS + ["1x128,t128x128"])
def test_quantize_gives_torchs_bits(scaling, scaling_t, dtype, format, transpose, rng):
    x = values(rng, (3, 67, 300))
    x[1, 2, :] = 0.0
    x[2, 5, 9], x[0, 1, 1] = np.nan, 1e-30
    q = fltf.fp8_quantize(tf.cast(x, dtype), scaling, format, transpose, scaling == "1x128",
                          scaling_t)
    want = flt.fp8_quantize(torch.from_numpy(x).to(TORCH[dtype]), scaling, format, transpose,
                            scaling == "1x128", scaling_t)
    assert np.array_equal(bits(q.data), bits(want.data))
    assert np.array_equal(q.scale_inv.numpy(), want.scale_inv.numpy(), equal_nan=True)
    if transpose:
        assert np.array_equal(bits(q.data_t), bits(want.data_t))
        assert np.array_equal(q.scale_inv_t.numpy(), want.scale_inv_t.numpy(), equal_nan=True)


@pytest.mark.parametrize("out_dtype", [tf.float32, tf.bfloat16], ids=str)
@pytest.mark.parametrize("pair", PAIRS, ids="-".join)
def test_gemm_gives_torchs_bits(pair, out_dtype, rng):
    a, b = values(rng, (48, 400), (-4, 2)), values(rng, (176, 400), (-4, 2))
    bias = None if out_dtype == tf.float32 else rng.normal((176,)).astype(np.float32)
    d = fltf.fp8_gemm(fltf.fp8_quantize(a, pair[0]), pair[0], fltf.fp8_quantize(b, pair[1]),
                      pair[1], out_dtype, bias)
    want = flt.fp8_gemm(flt.fp8_quantize(torch.from_numpy(a), pair[0]), pair[0],
                        flt.fp8_quantize(torch.from_numpy(b), pair[1]), pair[1],
                        TORCH[out_dtype], None if bias is None else torch.from_numpy(bias))
    assert d.dtype == out_dtype
    assert np.array_equal(as_float(d), want.float().numpy())


@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16], ids=str)
@pytest.mark.parametrize("recipe", RECIPES, ids=str)
def test_linear_gives_torchs_forward_and_gradients(recipe, dtype, rng):
    """y, dx, dW as fusedlayers.torch.fp8_linear's where the recipe runs the GEMM in FP8 (a GEMM
    left out is each framework's own, within its dtype's rounding), db up to its sum's order;
    float32 weights under bfloat16 x; fp8_dense with the kernel's layout, in tf.function."""
    r = RECIPES[recipe]
    x, dy = values(rng, (5, 16, 256)), values(rng, (5, 16, 176))
    w = (rng.normal((176, 256)) / 16).astype(np.float32)
    b = rng.normal((176,)).astype(np.float32)
    tx = torch.from_numpy(x).to(TORCH[dtype]).requires_grad_()
    tw, tb = torch.from_numpy(w).requires_grad_(), torch.from_numpy(b).requires_grad_()
    ty = flt.fp8_linear(tx, tw, tb, r)
    ty.backward(torch.from_numpy(dy).to(TORCH[dtype]))

    def same(got, want, gemm):
        got, want = as_float(got), want.detach().float().numpy()
        if gemm in r.gemms:
            assert np.array_equal(got, want), gemm
        else:
            rel = 2.0 ** -7 if dtype == tf.bfloat16 else 2.0 ** -20
            assert np.linalg.norm(got - want) <= rel * np.linalg.norm(want), gemm

    for fn, weight, layout in ((fltf.fp8_linear, w, lambda t: t),
                               (tf.function(fltf.fp8_dense), w.T, np.transpose)):
        xv, wv, bv = tf.cast(x, dtype), tf.Variable(weight), tf.Variable(b)
        with tf.GradientTape() as tape:
            tape.watch(xv)
            y = fn(xv, wv, bv, r)
        dx, dw, db = tape.gradient(y, [xv, wv, bv], output_gradients=tf.cast(dy, dtype))
        assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == tf.float32
        same(y, ty, "fprop")
        same(dx, tx.grad, "dgrad")
        same(layout(dw.numpy()), tw.grad, "wgrad")
        bound = np.abs(dy.reshape(-1, 176)).sum(0) * 80 * 2.0 ** -24
        assert np.all(np.abs(db.numpy() - tb.grad.numpy()) <= bound)


def test_argument_errors():
    x = tf.ones((32, 64))
    invalid = tf.errors.InvalidArgumentError
    with pytest.raises(invalid, match="scaling must be 'tensorwise', '1x128' or '128x128'"):
        fltf.fp8_quantize(x, "2x128")
    with pytest.raises(invalid, match="format must be 'e4m3' or 'e5m2'"):
        fltf.fp8_quantize(x, "1x128", "e3m4")
    with pytest.raises(invalid, match="scaling_t must be scaling \\('128x128'\\)"):
        fltf.fp8_quantize(x, "128x128", transpose=True, scaling_t="1x128")
    unknown_rows = tf.function(lambda x: fltf.fp8_quantize(x, "1x128", "e4m3", True, False,
                                                           "128x128").data_t,
                               input_signature=[tf.TensorSpec([None, 64], tf.float32)])
    with pytest.raises(invalid, match="x\\^T by 128x128 tiles needs x's leading sizes known"):
        unknown_rows(x)
    with pytest.raises(invalid, match="x must be float32, float16 or bfloat16, got float64"):
        fltf.fp8_quantize(tf.ones((4, 4), tf.float64))
    q = fltf.fp8_quantize(x, "1x128")
    w = fltf.fp8_quantize(tf.ones((48, 64)), "128x128")
    with pytest.raises(invalid, match="scalings must be tensorwise and tensorwise"):
        fltf.fp8_gemm(q, "1x128", w, "tensorwise")
    with pytest.raises(invalid, match=r"bias must have shape \[48\]"):
        fltf.fp8_gemm(q, "1x128", w, "128x128", tf.bfloat16, tf.ones(47))
    with pytest.raises(invalid, match="b_scale_inv of b \\[48, 64\\] scaled 128x128 must have"):
        fltf.fp8_gemm(q, "1x128", w._replace(scale_inv=w.scale_inv[:, :0]), "128x128")
    with pytest.raises(invalid, match="in_features and out_features must be multiples of 16"):
        fltf.fp8_linear(x, tf.ones((40, 64)))


def test_unknown_token_count_in_a_tf_function_runs_fp8(rng):
    """A tf.function traced with an unknown batch (as Keras' relaxed retraces are) decides the
    FP8 GEMMs' rule at run time: the eager FP8 bits and gradients for 32 tokens, the plain
    product for 37."""
    kernel = tf.Variable((rng.normal((64, 32)) / 8).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, 64], tf.float32)])
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fltf.fp8_dense(x, kernel)
        return (y, *tape.gradient(y, [x, kernel]))

    for tokens in (32, 37):
        x = tf.constant(values(rng, (tokens, 64)))
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fltf.fp8_dense(x, kernel)
        want = (y, *tape.gradient(y, [x, kernel]))
        for got, exp in zip(step(x), want):
            assert np.array_equal(got.numpy(), exp.numpy())
    plain = tf.constant(values(rng, (37, 64)))
    assert np.array_equal(step(plain)[0].numpy(), (plain @ kernel).numpy())
