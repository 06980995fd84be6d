"""The same numpy inputs through the torch extension and the TensorFlow op library.

relu_scale and layer_norm run the same csrc kernels in both (whose results do not depend on how
the framework's thread pool splits the work), so forward and backward must be bit-identical.
linear_gelu's GEMMs are each framework's own matmul (different BLAS libraries, different
summation orders); only the bias + GELU epilogue is shared: it agrees to float32 rounding of the
GEMM, not bitwise.
"""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")

import fusedlayers as fl  # noqa: E402
from fusedlayers.tensorflow import layer_norm_trailing as tf_trailing  # noqa: E402
from fusedlayers.torch import layer_norm_trailing as torch_trailing  # noqa: E402

from _helpers import rel_err, tf_grads  # noqa: E402

TORCH_DT = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
            "bfloat16": torch.bfloat16}


def to_both(a, dtype, requires_grad=True):
    """numpy (float64) -> (torch tensor, tf tensor), both rounded to dtype the same way."""
    t = torch.from_numpy(np.asarray(a, np.float64)).to(TORCH_DT[dtype])
    tt = tf.cast(tf.constant(np.asarray(a, np.float64)), dtype)
    # rounding float64 -> half in torch and TF must agree, or the comparison is meaningless
    assert np.array_equal(t.float().numpy(), tf.cast(tt, tf.float32).numpy(), equal_nan=True)
    return t.detach().requires_grad_(requires_grad), tt


def same(a_torch, b_tf, what, rng):
    a = a_torch.detach().float().numpy() if a_torch.dtype != torch.float64 else \
        a_torch.detach().numpy()
    b = tf.cast(b_tf, tf.float64 if b_tf.dtype == tf.float64 else tf.float32).numpy()
    assert a.shape == b.shape, (what, a.shape, b.shape)
    if np.array_equal(a, b, equal_nan=True):
        return
    diff = ~((a == b) | (np.isnan(a) & np.isnan(b)))
    assert False, (
        f"{what}: torch and TF differ at {int(diff.sum())} of {a.size} elements, e.g. "
        f"{a[diff][:3]} vs {b[diff][:3]} ({rng})")


def torch_grads(fn, inputs, dy):
    """As tf_grads: y and the gradients wrt the non-None inputs, None for None."""
    live = [t for t in inputs if t is not None]
    y = fn(*inputs)
    gs = iter(torch.autograd.grad(y, live, dy))
    return y, [None if t is None else next(gs) for t in inputs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (33, 1000), (3, 4097)], ids=str)
def test_relu_scale_bitwise(rng, dtype, shape):
    x = rng.normal(shape).ravel()
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0])
    idx = rng.gen.choice(x.size, min(x.size, special.size), replace=False)
    x[idx] = special[: idx.size]
    x = x.reshape(shape)
    alpha = float(np.float32(rng.uniform(-3, 3)))
    xt, xf = to_both(x, dtype)
    dyt, dyf = to_both(rng.normal(shape), dtype, requires_grad=False)
    yt, (dxt,) = torch_grads(lambda a: fl.relu_scale(a, alpha), [xt], dyt)
    yf, (dxf,) = tf_grads(lambda a: fl.relu_scale(a, alpha), [xf], dyf)
    same(yt, yf, "relu_scale y", rng)
    same(dxt, dxf, "relu_scale dx", rng)


LN_CASES = [((0, 7), [7]), ((1, 1), [1]), ((33, 7), [7]), ((130, 1000), [1000]),
            ((3, 4097), [4097]), ((2, 3, 5, 7), [5, 7]), ((2, 3, 33), [33])]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
@pytest.mark.parametrize("shape,nshape", LN_CASES, ids=str)
def test_layer_norm_bitwise(rng, dtype, shape, nshape):
    # float32 parameters for half x (the Keras / autocast layout); the x dtype otherwise
    pdt = "float32" if dtype in ("bfloat16", "float16") else dtype
    # eps as a float32 value: the TF attribute is float32 (test_tf_ops pins that for float64)
    eps = float(np.float32(10 ** rng.uniform(-6, -2)))
    x = rng.normal(shape, loc=rng.uniform(-2, 2), scale=rng.uniform(0.5, 2))
    g, b = rng.normal(nshape, loc=1.0, scale=0.5), rng.normal(nshape)
    dy = rng.normal(shape)
    for has_g, has_b in ((True, True), (True, False), (False, True), (False, False)):
        xt, xf = to_both(x, dtype)
        gt, gf = to_both(g, pdt) if has_g else (None, None)
        bt, bf = to_both(b, pdt) if has_b else (None, None)
        dyt, dyf = to_both(dy, dtype, requires_grad=False)
        what = f"layer_norm {dtype} {shape} over {nshape} gamma={has_g} beta={has_b}"
        yt, gts = torch_grads(lambda a, c, d: fl.layer_norm(a, nshape, c, d, eps), [xt, gt, bt],
                              dyt)
        yf, gfs = tf_grads(lambda a, c, d: fl.layer_norm(a, nshape, c, d, eps), [xf, gf, bf],
                           dyf)
        same(yt, yf, what + " y", rng)
        absent = [False, not has_g, not has_b]
        assert [a is None for a in gts] == [c is None for c in gfs] == absent
        for name, a, c in zip(("dx", "dgamma", "dbeta"), gts, gfs):
            if a is not None:
                same(a, c, f"{what} {name}", rng)


@pytest.mark.parametrize("shape,k", [((40, 33), 1), ((3, 4, 1000), 2)], ids=str)
def test_layer_norm_rms_bitwise(rng, shape, k):
    x, dy = rng.normal(shape, loc=0.5), rng.normal(shape)
    g = rng.normal(shape[-k:], loc=1.0)
    xt, xf = to_both(x, "float32")
    gt, gf = to_both(g, "float32")
    dyt, dyf = to_both(dy, "float32", requires_grad=False)
    yt, gts = torch_grads(lambda a, c: torch_trailing(a, k, c, None, 1e-3, rms_scaling=True),
                          [xt, gt], dyt)
    yf, gfs = tf_grads(lambda a, c: tf_trailing(a, k, c, None, 1e-3, rms_scaling=True),
                       [xf, gf], dyf)
    same(yt, yf, "rms y", rng)
    for name, a, c in zip(("dx", "dgamma"), gts, gfs):
        same(a, c, f"rms {name}", rng)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape,out", [((33, 7), 5), ((4, 3, 1000), 17), ((2, 4097), 3),
                                       ((0, 7), 4)], ids=str)
def test_linear_gelu_float32_tolerance(rng, approximate, shape, out):
    """Not bitwise: torch's and TF's float32 GEMMs (x @ W^T, and dx / dW in the backward) sum
    in different orders; the shared epilogue then sees inputs that differ in the last bits."""
    x = rng.normal(shape)
    w = rng.normal((out, shape[-1]), scale=1.5 / np.sqrt(shape[-1]))
    b = rng.normal(out, scale=0.5)
    dy = rng.normal((*shape[:-1], out))
    xt, xf = to_both(x, "float32")
    wt, wf = to_both(w, "float32")
    bt, bf = to_both(b, "float32")
    dyt, dyf = to_both(dy, "float32", requires_grad=False)
    yt, gts = torch_grads(lambda a, c, d: fl.linear_gelu(a, c, d, approximate), [xt, wt, bt], dyt)
    yf, gfs = tf_grads(lambda a, c, d: fl.linear_gelu(a, c, d, approximate), [xf, wf, bf], dyf)
    tol = 1e-6 * max(1.0, np.sqrt(shape[-1] / 64))  # GEMM rounding grows ~sqrt(in_features)
    # dbias sums dy * gelu'(pre) over rows (|gelu'| < 1.13): a sum that cancels is judged against
    # the size of its terms, as everywhere else.
    scales = {"dbias": 1.13 * np.abs(dy).reshape(-1, out).sum(0)}
    for name, a, c in zip(("y", "dx", "dweight", "dbias"), (yt, *gts), (yf, *gfs)):
        a = a.detach().numpy()
        c = c.numpy()
        assert a.shape == c.shape, name
        err = rel_err(a, c, scales.get(name))
        assert err <= tol, f"linear_gelu {name}: torch vs TF relative difference {err:.2e} > " \
                           f"{tol:.1e} ({rng})"
