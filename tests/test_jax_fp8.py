"""fusedlayers.jax's FP8 ops and layer against torch's and float64: fp8_quantize and fp8_gemm give
the torch ops' bits on the CPU (each scaling, format, layout, odd sizes, special values; torch's
are checked against float64 in test_fp8*.py, and here once more directly), fp8_linear and
fp8_dense the torch layer's forward and gradients (each recipe, float32 masters under bfloat16),
under jit too; the argument errors in csrc's words; on CUDA the CPU's bits (quantization) and
the GEMMs' accumulation bound; flax's Fp8Linear as a drop-in nnx.Linear that trains."""

import importlib

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import fusedlayers.jax as flj  # noqa: E402
import fusedlayers.torch as flt  # noqa: E402
from fusedlayers import Fp8Recipe  # noqa: E402
from fusedlayers.torch.fp8 import reference as quantize_reference  # noqa: E402

jax_gemm_module = importlib.import_module("fusedlayers.jax.fp8_gemm")
SCALINGS = ["tensorwise", "1x128", "128x128"]
PAIRS = [("tensorwise", "tensorwise"), ("1x128", "128x128"), ("1x128", "1x128")]
RECIPES = {"blockwise": Fp8Recipe(), "tensorwise": Fp8Recipe("tensorwise"),
           "hybrid": Fp8Recipe("tensorwise", "hybrid"),
           "blockwise-pow2": Fp8Recipe(power_of_2_scales=True),
           "fprop-only": Fp8Recipe(gemms=("fprop",)), "no-fprop": Fp8Recipe(gemms=("dgrad",
                                                                                  "wgrad")),
           "blockwise-kept": Fp8Recipe(recompute_fp8_weights=False),
           "blockwise-wgrad-tiles": Fp8Recipe(wgrad_x_scaling="128x128"),
           "no-fprop-kept": Fp8Recipe(gemms=("dgrad", "wgrad"), recompute_fp8_weights=False)}
TORCH = {jnp.float32: torch.float32, jnp.bfloat16: torch.bfloat16, jnp.float16: torch.float16}
CPU = jax.devices("cpu")[0]


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def on_cpu(a):
    return jax.device_put(jnp.asarray(a), CPU)


def bits(a) -> np.ndarray:
    """An FP8 array's bytes (JAX or torch)."""
    if isinstance(a, torch.Tensor):
        return a.view(torch.uint8).numpy()
    return np.asarray(a).view(np.uint8)


def same_quantization(qj, qt):
    assert np.array_equal(bits(qj.data), bits(qt.data))
    assert np.array_equal(np.asarray(qj.scale_inv), qt.scale_inv.numpy(), equal_nan=True)
    assert (qj.data_t is None) == (qt.data_t is None)
    if qt.data_t is not None:
        assert np.array_equal(bits(qj.data_t), bits(qt.data_t))
        assert np.array_equal(np.asarray(qj.scale_inv_t), qt.scale_inv_t.numpy(), equal_nan=True)


def values(rng, shape, dtype, octaves=(-6, 6)):
    """Rows over a few octaves (their block scales differ)."""
    x = rng.normal(shape) * np.exp2(rng.gen.integers(*octaves, shape[:-1] + (1,)))
    return np.array(jnp.asarray(x, dtype).astype(jnp.float32))


@pytest.mark.parametrize("transpose", [False, True], ids=["rows", "cast-transpose"])
@pytest.mark.parametrize("format", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=str)
@pytest.mark.parametrize("scaling,scaling_t", [(s, None) for s in SCALINGS] +
                         [("1x128", "128x128")], ids=SCALINGS + ["1x128,t128x128"])
def test_quantize_gives_torchs_bits(scaling, scaling_t, dtype, format, transpose, rng):
    power_of_2 = transpose and format == "e4m3"  # power-of-two scales in a quarter of the cases
    x = values(rng, (3, 67, 300), dtype)
    x[0, 5, 7] = 0.0
    x[1, 2, :] = 0.0  # an all-zero row: its 1x128 blocks take scale 1
    qj = flj.fp8_quantize(on_cpu(x).astype(dtype), scaling, format, transpose, power_of_2,
                          scaling_t)
    qt = flt.fp8_quantize(torch.from_numpy(x).to(TORCH[dtype]), scaling, format, transpose,
                          power_of_2, scaling_t)
    same_quantization(qj, qt)
    # and against float64 directly: the values as the reference rounds them, the scales exact
    want, want_scale, _, _ = quantize_reference(torch.from_numpy(x), scaling, format, False,
                                                power_of_2)
    got = np.asarray(qj.data.astype(jnp.float32), np.float64)
    assert np.array_equal(got, want) and np.array_equal(np.asarray(qj.scale_inv), want_scale)


def test_quantize_special_values():
    """NaN and Inf poison their block (NaN values and scale), saturation at the format's max,
    subnormals: torch's bits, under jit too."""
    x = np.linspace(-3, 3, 4 * 256, dtype=np.float32).reshape(4, 256)
    x[0, 3], x[1, 200], x[2, 0] = np.nan, np.inf, 1e-30
    for scaling in SCALINGS:
        for fn in (flj.fp8_quantize, jax.jit(flj.fp8_quantize, static_argnums=(1, 2, 3))):
            qj = fn(on_cpu(x), scaling, "e4m3", True)
            same_quantization(qj, flt.fp8_quantize(torch.from_numpy(x), scaling, "e4m3", True))


@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=str)
@pytest.mark.parametrize("pair", PAIRS, ids="-".join)
def test_gemm_gives_torchs_bits(pair, out_dtype, with_bias, rng):
    if with_bias and out_dtype == jnp.float32:
        pytest.skip("a bias needs a half-precision output (an error, tested below)")
    m, n, k = 48, 176, 400  # partial blocks along k and n
    # octaves whose products stay within float16's range
    a, b = (values(rng, (rows, k), jnp.bfloat16, (-4, 2)) for rows in (m, n))
    bias = rng.normal((n,)).astype(np.float32) if with_bias else None
    qa, qb = flj.fp8_quantize(on_cpu(a), pair[0]), flj.fp8_quantize(on_cpu(b), pair[1])
    d = jax.jit(flj.fp8_gemm, static_argnums=(1, 3, 4))(qa, pair[0], qb, pair[1], out_dtype,
                                                        None if bias is None else on_cpu(bias))
    ta = flt.fp8_quantize(torch.from_numpy(a), pair[0])
    tb = flt.fp8_quantize(torch.from_numpy(b), pair[1])
    want = flt.fp8_gemm(ta, pair[0], tb, pair[1], TORCH[out_dtype],
                        None if bias is None else torch.from_numpy(bias))
    assert d.dtype == out_dtype
    assert np.array_equal(np.asarray(d.astype(jnp.float32)), want.float().numpy())
    # the float64 product of the dequantized operands (and the bias in d's dtype, as the GEMM
    # takes it), within float32 sums and the output's eps
    exact = jax_gemm_module.reference(qa, pair[0], qb, pair[1], None if bias is None else
                                      np.asarray(jnp.asarray(bias, out_dtype), np.float64))
    mag = np.abs(jax_gemm_module.dequantize(qa.data, qa.scale_inv, pair[0])) @ np.abs(
        jax_gemm_module.dequantize(qb.data, qb.scale_inv, pair[1])).T
    if bias is not None:  # its float32 addition
        mag = mag * k + 2 * np.abs(np.asarray(jnp.asarray(bias, out_dtype), np.float64))
    else:
        mag = mag * k
    err = np.abs(np.asarray(d, np.float64) - exact)
    finfo = jnp.finfo(out_dtype)
    assert np.all(err <= mag * 2.0 ** -24 + np.abs(exact) * float(finfo.eps) +
                  float(finfo.smallest_subnormal))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=str)
@pytest.mark.parametrize("recipe", RECIPES, ids=str)
def test_linear_gives_torchs_forward_and_gradients(recipe, dtype, rng):
    """y, dx, dW (and db up to its sum's order) as fusedlayers.torch.fp8_linear's, with float32
    weights (masters) under bfloat16 x; fp8_dense the same with the kernel's layout, under jit.
    The same bits from the FP8 GEMMs; a GEMM the recipe leaves out is each framework's own (XLA's
    and torch's sums differ in order), within its dtype's rounding."""
    r = RECIPES[recipe]
    x, dy = values(rng, (5, 16, 256), dtype), values(rng, (5, 16, 176), dtype)
    w = rng.normal((176, 256)).astype(np.float32) / 16
    b = rng.normal((176,)).astype(np.float32)
    tx = torch.from_numpy(x).to(TORCH[dtype]).requires_grad_()
    tw, tb = torch.from_numpy(w).requires_grad_(), torch.from_numpy(b).requires_grad_()
    flt.fp8_linear(tx, tw, tb, r).backward(torch.from_numpy(dy).to(TORCH[dtype]))
    ty = flt.fp8_linear(tx, tw, tb, r)

    def same(got, want, gemm):
        assert got.dtype == jnp.dtype({torch.float32: jnp.float32,
                                       torch.bfloat16: jnp.bfloat16}[want.dtype])
        got, want = np.asarray(got.astype(jnp.float32)), want.detach().float().numpy()
        if gemm in r.gemms:
            assert np.array_equal(got, want), gemm
        else:
            rel = 2.0 ** -7 if dtype == jnp.bfloat16 else 2.0 ** -20
            assert np.linalg.norm(got - want) <= rel * np.linalg.norm(want), gemm

    for fn, weight, layout in ((flj.fp8_linear, w, lambda t: t), (flj.fp8_dense, w.T, np.transpose)):
        y, vjp = jax.vjp(jax.jit(lambda x, w, b: fn(x, w, b, r)), on_cpu(x).astype(dtype),
                         on_cpu(weight), on_cpu(b))
        dx, dw, db = vjp(on_cpu(dy).astype(dtype))
        same(y, ty, "fprop")
        same(dx, tx.grad, "dgrad")
        same(layout(dw), tw.grad, "wgrad")
        # float32 sums of the same terms in another order
        bound = np.abs(dy.reshape(-1, 176)).sum(0) * 80 * 2.0 ** -24
        assert np.all(np.abs(np.asarray(db) - tb.grad.numpy()) <= bound)


@pytest.mark.parametrize("tokens", [37, 0])
def test_token_counts_off_16_run_as_the_product(tokens, rng):
    x = on_cpu(rng.normal((tokens, 64)).astype(np.float32))
    w = on_cpu(rng.normal((32, 64)).astype(np.float32))
    y = flj.fp8_linear(x, w)
    np.testing.assert_allclose(np.asarray(y), np.asarray(x) @ np.asarray(w).T, rtol=1e-5,
                               atol=1e-5)


def test_argument_errors():
    """csrc's messages for the quantize and GEMM rules (torch's words), the layer's shape rules."""
    x = on_cpu(np.ones((32, 64), np.float32))
    with pytest.raises(ValueError, match="scaling must be 'tensorwise', '1x128' or '128x128'"):
        flj.fp8_quantize(x, "2x128")
    with pytest.raises(ValueError, match="format must be 'e4m3' or 'e5m2'"):
        flj.fp8_quantize(x, "1x128", "e3m4")
    with pytest.raises(ValueError, match="scaling_t must be scaling \\('tensorwise'\\)"):
        flj.fp8_quantize(x, "tensorwise", transpose=True, scaling_t="128x128")
    with pytest.raises(TypeError, match="x must be float32, float16 or bfloat16, got int32"):
        flj.fp8_quantize(jnp.ones((4, 4), jnp.int32))
    q = flj.fp8_quantize(x, "1x128")
    w = flj.fp8_quantize(on_cpu(np.ones((48, 64), np.float32)), "128x128")
    with pytest.raises(ValueError, match="scalings must be tensorwise and tensorwise"):
        flj.fp8_gemm(q, "1x128", w, "tensorwise")
    with pytest.raises(ValueError, match="a bias needs a bfloat16 or float16 output"):
        flj.fp8_gemm(q, "1x128", w, "128x128", jnp.float32, on_cpu(np.ones(48, np.float32)))
    with pytest.raises(ValueError, match=r"bias must have shape \[48\]"):
        flj.fp8_gemm(q, "1x128", w, "128x128", jnp.bfloat16, on_cpu(np.ones(47, np.float32)))
    with pytest.raises(ValueError, match=r"b_scale_inv of b \[48, 64\] scaled 128x128 must have"):
        flj.fp8_gemm(q, "1x128", w._replace(scale_inv=w.scale_inv[:, :0]), "128x128")
    with pytest.raises(TypeError, match="operands must be float8_e4m3fn or float8_e5m2"):
        flj.fp8_gemm(q._replace(data=x), "1x128", w, "128x128")
    odd = flj.fp8_quantize(on_cpu(np.ones((40, 64), np.float32)), "128x128")
    with pytest.raises(ValueError, match="b's rows n .* must be a multiple of 16, got 40"):
        flj.fp8_gemm(q, "1x128", odd, "128x128")
    with pytest.raises(ValueError, match="in_features and out_features must be multiples of 16"):
        flj.fp8_linear(x, on_cpu(np.ones((40, 64), np.float32)))
    with pytest.raises(ValueError, match="x's last dimension must be the weight's in_features"):
        flj.fp8_dense(x, on_cpu(np.ones((48, 32), np.float32)))


@pytest.mark.cuda
@pytest.mark.skipif(not _has_gpu(), reason="needs a JAX GPU")
@pytest.mark.parametrize("pair", PAIRS, ids="-".join)
def test_cuda_quantizes_as_the_cpu_and_multiplies_within_the_accumulation_bound(pair, rng):
    gpu = jax.devices("gpu")[0]
    major, minor = (int(v) for v in gpu.compute_capability.split("."))
    if (major, minor) != (9, 0):
        pytest.skip("block-scaled FP8 GEMMs need an sm_90 GPU")
    m, n, k = 256, 176, 384
    a, b = values(rng, (m, k), jnp.bfloat16), values(rng, (n, k), jnp.bfloat16)
    for x, scaling in ((a, pair[0]), (b, pair[1])):
        qg = flj.fp8_quantize(jax.device_put(x, gpu), scaling, "e4m3", True)
        qc = flj.fp8_quantize(on_cpu(x), scaling, "e4m3", True)
        for g, c in zip(qg, qc):
            assert np.array_equal(np.asarray(g).view(np.uint8) if g.dtype.itemsize == 1 else
                                  np.asarray(g), np.asarray(c).view(np.uint8)
                                  if c.dtype.itemsize == 1 else np.asarray(c))
    qa = flj.fp8_quantize(jax.device_put(a, gpu), pair[0])
    qb = flj.fp8_quantize(jax.device_put(b, gpu), pair[1])
    d = jax.jit(flj.fp8_gemm, static_argnums=(1, 3, 4))(qa, pair[0], qb, pair[1], jnp.float32)
    assert d.devices() == {gpu}
    exact = jax_gemm_module.reference(qa, pair[0], qb, pair[1])
    mag = np.abs(jax_gemm_module.dequantize(qa.data, qa.scale_inv, pair[0])) @ np.abs(
        jax_gemm_module.dequantize(qb.data, qb.scale_inv, pair[1])).T
    # the tensor cores' FP8 accumulation, promoted to float32 every 128 of k (test_fp8_gemm.py)
    assert np.all(np.abs(np.asarray(d, np.float64) - exact) <= mag * 2.0 ** -12 + 1e-30)


nnx = pytest.importorskip("flax.nnx")
import fusedlayers.flax as flf  # noqa: E402


def test_flax_fp8_linear_is_a_drop_in_linear(rng):
    """Same parameters as nnx.Linear; its output fp8_dense's of them (float32 masters, bfloat16
    compute), near nnx.Linear's within FP8's rounding; sizes off the rule run flax's own."""
    ref = nnx.Linear(256, 176, rngs=nnx.Rngs(3), dtype=jnp.bfloat16)
    fp8 = flf.Fp8Linear(256, 176, rngs=nnx.Rngs(3), dtype=jnp.bfloat16)
    assert nnx.state(ref, nnx.Param).keys() == nnx.state(fp8, nnx.Param).keys()
    for name in ("kernel", "bias"):
        assert np.array_equal(np.asarray(getattr(ref, name)[...]),
                              np.asarray(getattr(fp8, name)[...]))
    x = on_cpu(values(rng, (4, 32, 256), jnp.float32))
    y = fp8(x)
    assert y.dtype == jnp.bfloat16
    want = flj.fp8_dense(x.astype(jnp.bfloat16), fp8.kernel[...], fp8.bias[...])
    assert np.array_equal(np.asarray(y.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
    y_ref = np.asarray(ref(x), np.float64)
    assert np.linalg.norm(np.asarray(y, np.float64) - y_ref) / np.linalg.norm(y_ref) < 0.05
    odd = flf.Fp8Linear(250, 176, rngs=nnx.Rngs(3))
    plain = nnx.Linear(250, 176, rngs=nnx.Rngs(3))
    x_odd = on_cpu(rng.normal((32, 250)).astype(np.float32))
    assert np.array_equal(np.asarray(odd(x_odd)), np.asarray(plain(x_odd)))


def test_flax_fp8_linear_trains_as_the_bf16_linear(rng):
    """A two-layer MLP fitting a random linear map, 60 AdamW steps: the FP8 (blockwise) loss
    follows the bfloat16 model's within 1% of the starting loss at every step (FP8's noise
    keeps it ~0.3% above by the end) and falls 50x."""
    import optax

    x = on_cpu(rng.normal((256, 128)).astype(np.float32))
    target = x @ on_cpu(rng.normal((128, 64)).astype(np.float32) / 12)

    class Mlp(nnx.Module):
        def __init__(self, linear, rngs):
            self.up = linear(128, 256, rngs=rngs, dtype=jnp.bfloat16)
            self.down = linear(256, 64, rngs=rngs, dtype=jnp.bfloat16)

        def __call__(self, x):
            return self.down(jax.nn.relu(self.up(x)))

    def train(linear):
        model = Mlp(linear, nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)

        @nnx.jit
        def step(model, opt):
            loss, grads = nnx.value_and_grad(
                lambda m: jnp.mean((m(x).astype(jnp.float32) - target) ** 2))(model)
            opt.update(model, grads)
            return loss
        return [float(step(model, opt)) for _ in range(60)]
    bf16, fp8 = train(nnx.Linear), train(flf.Fp8Linear)
    assert fp8[-1] < fp8[0] / 50
    worst = max(abs(a - b) for a, b in zip(fp8, bf16))
    assert worst <= 0.01 * bf16[0], (worst, bf16[0])


def test_flax_llama_trains_in_fp8_beside_bf16():
    """The bench's tiny Flax Llama (fused) with its projections as Fp8Linear: the same initial
    parameters as the bf16 model, and 30 AdamW steps whose losses follow the bf16 model's
    within 1% of the starting loss (the bench's FP8 rows: test_bench.py)."""
    from fusedlayers.bench import flax_models as fm

    config = fm.CONFIGS["tiny"]
    rng = np.random.default_rng(0)
    ids = rng.integers(0, config["vocab"], (2, config["seq"]), np.int32)
    labels = np.roll(ids, -1, axis=1)  # a learnable target: the next id

    def losses(fp8):
        model = fm.build(**config, fused=True, fp8=fp8)
        step, state = fm._train_step(model)
        out = []
        for _ in range(30):
            state, loss = step(state, ids, labels)
            out.append(float(loss))
        return out
    bf16, fp8 = losses(None), losses(Fp8Recipe())
    assert fp8[-1] < fp8[0] * 0.95, fp8
    worst = max(abs(a - b) for a, b in zip(fp8, bf16))
    assert worst <= 0.01 * bf16[0], (worst, bf16, fp8)
