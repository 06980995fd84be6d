"""linear_gelu: y = gelu(x @ W^T + b) against F.gelu(F.linear(x, W, b)) on float64 copies, for
both GELU forms, with and without bias, 1-D/2-D/3-D inputs, 0/1/many rows, odd feature counts,
strided x and weight; float32/bfloat16/float16 at most twice torch's own unfused error against
the same float64 reference; gradients of x, W, b; gradcheck, opcheck, determinism of dbias."""

import math

import pytest
import torch
import torch.nn.functional as F

import fusedlayers
import fusedlayers.torch  # noqa: F401  (loads the extension into torch.ops)
from fusedlayers import reference
from _helpers import as_layout, assert_bitwise, assert_calibrated, f64, grads, leaf_shape, rel_err

APPROX = ("none", "tanh")
# Calibration floors beyond 2x torch's error. float32: 2e-6 (~17 ulps); the tanh form's gradient
# s + 2u s (1 - s) dz forms 1 - s by cancellation and loses up to ~16 ulps for u in 3..6, while
# torch's loses ~5. Half dtypes: a fraction of one ulp.
FLOOR = {torch.float32: 2e-6, torch.bfloat16: 1e-4, torch.float16: 1e-5}


def stable_linear_gelu64(x, w, b, approximate):
    """gelu(F.linear(x, w, b)) in float64, written without the cancellation of 1 + erf(u) and
    1 + tanh(z) for negative u that torch's own F.gelu has (it returns 0 below about u = -8 even
    in float64): the accuracy reference. Equal to reference.linear_gelu elsewhere."""
    u = F.linear(x, w, b)
    if approximate == "none":
        return u * 0.5 * torch.special.erfc(-u / math.sqrt(2))
    return u * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (u + 0.044715 * u**3))


def check_linear_gelu(lead, in_f, out_f, dtype, approximate, with_bias, *,
                      x_layout="contiguous", w_layout="contiguous"):
    shape = (*lead, in_f)
    x = torch.randn(leaf_shape(shape, x_layout), dtype=torch.float64).to(dtype).requires_grad_()
    x_view = lambda t: as_layout(t, shape, x_layout)  # noqa: E731
    # Weight scaled so the pre-activations spread over GELU's curved region and both tails.
    w = (torch.randn(leaf_shape((out_f, in_f), w_layout), dtype=torch.float64) * 2
         / math.sqrt(max(in_f, 1))).to(dtype).requires_grad_()
    w_view = lambda t: as_layout(t, (out_f, in_f), w_layout)  # noqa: E731
    b = torch.randn(out_f, dtype=torch.float64).to(dtype).requires_grad_() if with_bias else None
    g = torch.randn((*lead, out_f), dtype=torch.float64).to(dtype)

    # Gradients are taken at the (strided) views the op receives: what the op computes, without
    # the extra summation of an expanded input's backward.
    xv, wv = x_view(x), w_view(w)
    y = fusedlayers.linear_gelu(xv, wv, b, approximate)
    assert y.shape == (*lead, out_f) and y.dtype == dtype and y.is_contiguous()
    ours = [y, *grads(y, [xv, wv, b], g)]

    x64, w64, b64 = f64(x), f64(w), f64(b)
    x64v, w64v = x_view(x64), w_view(w64)
    y64 = stable_linear_gelu64(x64v, w64v, b64, approximate)
    ref = [y64, *grads(y64, [x64v, w64v, b64], g.double())]

    native = None
    if dtype != torch.float64:
        xn, wn, bn = (None if t is None else t.detach().clone().requires_grad_() for t in (x, w, b))
        xnv, wnv = x_view(xn), w_view(wn)
        yn = reference.linear_gelu(xnv, wnv, bn, approximate)
        native = [yn, *grads(yn, [xnv, wnv, bn], g)]

    # Magnitudes of the terms each result sums (see rel_err): the GEMM's |x| @ |W|^T + |b| for
    # y (GELU is 1.13-Lipschitz), and |dy| in place of |dpre| (|gelu'| <= 1.13) for the grads.
    ax, aw, ag = x64v.detach().abs(), w64v.detach().abs(), g.double().abs()
    scales = {"y": F.linear(ax, aw, None if b64 is None else b64.detach().abs()),
              "dx": ag @ aw,
              "dweight": ag.reshape(-1, out_f).t() @ ax.reshape(-1, in_f),
              "dbias": ag.reshape(-1, out_f).sum(0)}
    for i, name in enumerate(("y", "dx", "dweight", "dbias")):
        if ref[i] is None:
            assert ours[i] is None
            continue
        assert ours[i].dtype == dtype and ours[i].shape == ref[i].shape, name
        err = rel_err(ours[i], ref[i], scales[name])
        if dtype == torch.float64:
            assert err <= 1e-12, f"{name}: relative error {err:.3e}"
        else:
            # Every gradient is built from dpre, rounded once per output element: they carry at
            # most g.numel() independent roundings (one for all 33 dweights of a 1 x 1 output).
            independent = ref[i].numel() if name == "y" else min(ref[i].numel(), g.numel())
            assert_calibrated(err, rel_err(native[i], ref[i], scales[name]), name, dtype=dtype,
                              numel=independent, factor=2.0, floor=FLOOR[dtype])


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("with_bias", (True, False), ids=("bias", "nobias"))
@pytest.mark.parametrize("lead", [(0,), (1,), (33,), (2, 5), ()], ids=str)
@pytest.mark.parametrize("in_f,out_f", [(1, 7), (7, 33), (33, 1), (100, 100)], ids=str)
def test_float64(in_f, out_f, lead, with_bias, approximate):
    check_linear_gelu(lead, in_f, out_f, torch.float64, approximate, with_bias)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("with_bias", (True, False), ids=("bias", "nobias"))
@pytest.mark.parametrize("lead,in_f,out_f", [((33,), 7, 33), ((4, 33), 100, 77), ((1,), 33, 1)],
                         ids=str)
def test_lower_precision(lead, in_f, out_f, with_bias, approximate, dtype):
    check_linear_gelu(lead, in_f, out_f, dtype, approximate, with_bias)


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32, torch.bfloat16))
@pytest.mark.parametrize("x_layout,w_layout", [
    ("transposed", "contiguous"), ("sliced", "contiguous"), ("expanded", "contiguous"),
    ("contiguous", "transposed"), ("contiguous", "sliced"), ("transposed", "transposed"),
])
def test_non_contiguous(x_layout, w_layout, dtype):
    if x_layout != "contiguous":
        assert not as_layout(torch.empty(leaf_shape((3, 33, 9), x_layout)), (3, 33, 9),
                             x_layout).is_contiguous()
    check_linear_gelu((3, 33), 9, 17, dtype, "none", True, x_layout=x_layout, w_layout=w_layout)
    check_linear_gelu((33,), 9, 17, dtype, "tanh", False, x_layout=x_layout, w_layout=w_layout)


@pytest.mark.parametrize("approximate", APPROX)
def test_matches_unfused_float64(approximate):
    x = torch.randn(2, 64, 100, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 100, dtype=torch.float64, requires_grad=True)
    b = torch.randn(50, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 64, 50, dtype=torch.float64)
    y = fusedlayers.linear_gelu(x, w, b, approximate)
    y_ref = reference.linear_gelu(x, w, b, approximate)
    assert rel_err(y, y_ref) <= 1e-12
    for a, r in zip(grads(y, [x, w, b], g), grads(y_ref, [x, w, b], g)):
        assert rel_err(a, r) <= 1e-12
    # and the accuracy reference used by the other tests agrees with the unfused op here
    assert rel_err(stable_linear_gelu64(x, w, b, approximate), y_ref) <= 1e-13


def test_dense_gelu_takes_a_keras_kernel():
    # fusedlayers.torch.dense_gelu: the Keras Dense layout, kernel (in, out).
    import fusedlayers.torch as ops
    x = torch.randn(6, 5, dtype=torch.float64)
    kernel, b = torch.randn(5, 3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    assert rel_err(ops.dense_gelu(x, kernel, b, "tanh"),
                   reference.linear_gelu(x, kernel.t(), b, "tanh")) <= 1e-12


def test_transposed_parameter():
    # A weight kept as an (in, out) Parameter and passed as .t() gets its gradient transposed.
    x = torch.randn(8, 5, dtype=torch.float64)
    kernel = torch.nn.Parameter(torch.randn(5, 3, dtype=torch.float64))
    fusedlayers.linear_gelu(x, kernel.t()).sum().backward()
    want = torch.nn.Parameter(kernel.detach().clone())
    reference.linear_gelu(x, want.t()).sum().backward()
    assert rel_err(kernel.grad, want.grad) <= 1e-12


# Non-finite values are compared with the float64 unfused result: torch's own float32/bfloat16
# erf GELU returns nan for a +inf input on its vectorized path (inf on its scalar path and in
# float64), so its low-precision output is no specification for +inf.
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_nan_inf_propagate_like_unfused(approximate, dtype):
    x = torch.randn(10, 16).to(dtype)
    x[1, 3] = math.nan
    x[4, 0] = math.inf
    x[6, :] = -math.inf
    w, b = torch.randn(8, 16).to(dtype), torch.randn(8).to(dtype)
    w[5, 2] = math.nan
    w[0, 0], w[1, 0] = 0.5, -0.5  # row 4: pre[0] = +inf -> +inf, pre[1] = -inf -> nan
    ours = fusedlayers.linear_gelu(x, w, b, approximate)
    ref = reference.linear_gelu(x.double(), w.double(), b.double(), approximate)
    assert ref.isnan().any() and ref.isinf().any() and ref.isfinite().any()
    assert torch.equal(ours.isnan(), ref.isnan())
    assert torch.equal(ours.isinf(), ref.isinf())
    assert torch.equal(ours.isinf() & (ours > 0), ref.isinf() & (ref > 0))
    finite = ref.isfinite()
    unfused = reference.linear_gelu(x, w, b, approximate)
    assert rel_err(ours[finite], unfused[finite]) <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, torch.bfloat16))
@pytest.mark.parametrize("approximate", APPROX)
def test_gelu_of_extreme_pre_activations(approximate, dtype):
    # gelu(+inf) = +inf, gelu(-inf) = -inf * 0 = nan, gelu(+-huge) = huge / -0, as the float64
    # unfused op computes them.
    x = torch.tensor([[math.inf], [-math.inf], [1e30], [-1e30], [0.0], [-0.0], [3e38]],
                     dtype=dtype)
    w = torch.ones(1, 1, dtype=dtype)
    want = reference.linear_gelu(x.double(), w.double(), None, approximate).to(dtype)
    assert_bitwise(fusedlayers.linear_gelu(x, w, None, approximate), want)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
@pytest.mark.parametrize("approximate", APPROX)
def test_negative_tail_relative_accuracy(approximate, dtype):
    # The epilogue computes Phi(u) from erfc(|u|/sqrt 2) (and the tanh form as a sigmoid), so
    # gelu(u) keeps its relative accuracy where 1 + erf(u) would cancel (torch's own doesn't).
    u = torch.linspace(-9, -3, 6001, dtype=dtype)
    y = fusedlayers.linear_gelu(u[:, None], torch.ones(1, 1, dtype=dtype), None, approximate)
    v = u.double()
    if approximate == "none":
        exact = v * 0.5 * torch.special.erfc(-v / math.sqrt(2))
    else:
        exact = v * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (v + 0.044715 * v**3))
    worst = ((y[:, 0].double() - exact).abs() / exact.abs()).max().item()
    assert worst <= (2e-5 if dtype == torch.float32 else 1e-13), worst


def test_one_dim_input():
    x = torch.randn(7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 7, dtype=torch.float64)
    y = fusedlayers.linear_gelu(x, w)
    assert y.shape == (3,)
    assert rel_err(y, reference.linear_gelu(x, w)) <= 1e-12


@pytest.mark.parametrize("shape_x,shape_w", [((5, 0), (3, 0)), ((5, 4), (0, 4))], ids=str)
def test_zero_features(shape_x, shape_w):
    x = torch.randn(shape_x, dtype=torch.float64, requires_grad=True)
    w = torch.randn(shape_w, dtype=torch.float64, requires_grad=True)
    b = torch.randn(shape_w[0], dtype=torch.float64, requires_grad=True)
    y = fusedlayers.linear_gelu(x, w, b)
    y_ref = reference.linear_gelu(x, w, b)
    assert rel_err(y, y_ref) <= 1e-12
    g = torch.randn_like(y)
    for a, r in zip(grads(y, [x, w, b], g), grads(y_ref, [x, w, b], g)):
        assert rel_err(a, r) <= 1e-12


def test_does_not_modify_inputs():
    x, w, b = torch.randn(6, 5), torch.randn(4, 5), torch.randn(4)
    copies = [t.clone() for t in (x, w, b)]
    fusedlayers.linear_gelu(x, w, b)
    for t, c in zip((x, w, b), copies):
        assert torch.equal(t, c)


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("with_bias", (True, False), ids=("bias", "nobias"))
def test_gradcheck(approximate, with_bias):
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    inputs = (x, w)
    if with_bias:
        inputs += (torch.randn(5, dtype=torch.float64, requires_grad=True),)
    fn = lambda *a: fusedlayers.linear_gelu(*a, **({} if with_bias else {"bias": None}),  # noqa
                                            approximate=approximate)
    assert torch.autograd.gradcheck(fn, inputs)


def test_gradcheck_strided():
    x = torch.randn(4, 6, dtype=torch.float64).t().requires_grad_()       # (6, 4), transposed
    w = torch.randn(4, 3, dtype=torch.float64).t().requires_grad_()       # (3, 4), transposed
    b = torch.randn(6, dtype=torch.float64)[::2].requires_grad_()          # (3,), stride 2
    assert torch.autograd.gradcheck(lambda *a: fusedlayers.linear_gelu(*a, approximate="tanh"),
                                    (x, w, b))


def _t(*shape, dtype=torch.float32):
    return torch.randn(shape, dtype=dtype, requires_grad=True)


@pytest.mark.parametrize("args", [
    pytest.param(lambda: (_t(4, 7), _t(5, 7), _t(5), "none"), id="bias-none"),
    pytest.param(lambda: (_t(4, 7), _t(5, 7), None, "tanh"), id="nobias-tanh"),
    pytest.param(lambda: (_t(2, 3, 7), _t(5, 7), _t(5), "tanh"), id="3d"),
    pytest.param(lambda: (_t(7, 4).t(), _t(7, 5).t(), _t(5), "none"), id="strided"),
    pytest.param(lambda: (_t(4, 7, dtype=torch.bfloat16), _t(5, 7, dtype=torch.bfloat16),
                          _t(5, dtype=torch.bfloat16), "none"), id="bf16"),
])
@pytest.mark.parametrize("op", ("linear_gelu", "linear_gelu_with_pre"))
def test_opcheck(args, op):
    # linear_gelu_with_pre is the forward that autograd runs below itself: no grad of its own.
    differentiable = op == "linear_gelu"
    args = tuple(a.detach().requires_grad_(differentiable) if isinstance(a, torch.Tensor) else a
                 for a in args())
    torch.library.opcheck(getattr(torch.ops.fusedlayers, op).default, args)


@pytest.mark.parametrize("in_out", (False, True), ids=("weight-out-in", "weight-in-out"))
@pytest.mark.parametrize("has_bias", (True, False))
def test_opcheck_backward(has_bias, in_out):
    x = torch.randn(2, 4, 7)
    w = torch.randn(7, 5).t() if in_out else torch.randn(5, 7)
    _, pre = torch.ops.fusedlayers.linear_gelu_with_pre(x, w, torch.randn(5) if has_bias else None,
                                                        "tanh")
    torch.library.opcheck(torch.ops.fusedlayers.linear_gelu_backward.default,
                          (torch.randn(2, 4, 5), x, w, pre, has_bias, "tanh"))


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, torch.bfloat16))
@pytest.mark.parametrize("approximate", APPROX)
def test_in_out_weight_read_in_place_and_grad_in_its_layout(dtype, approximate):
    """A weight stored (in, out), as GPT-2's Conv1D keeps it, passed as `w.t()`: the results of
    the (out, in) copy up to the GEMM's rounding (the two layouts take different GEMM kernels),
    and its gradient reaches the (in, out) parameter contiguous, without a copy by autograd (the
    binding writes it in that layout)."""
    tol = 4 * torch.finfo(dtype).eps
    w_in_out = torch.randn(13, 6, dtype=dtype, requires_grad=True)
    w_out_in = w_in_out.detach().t().contiguous().requires_grad_()
    x = torch.randn(3, 5, 13, dtype=dtype, requires_grad=True)
    b = torch.randn(6, dtype=dtype, requires_grad=True)
    y = fusedlayers.linear_gelu(x, w_in_out.t(), b, approximate)
    y_ref = fusedlayers.linear_gelu(x, w_out_in, b, approximate)
    assert rel_err(y, y_ref) <= tol
    g = torch.randn_like(y)
    dx, dw_in_out, db = torch.autograd.grad(y, (x, w_in_out, b), g)
    dx_ref, dw_ref, db_ref = torch.autograd.grad(y_ref, (x, w_out_in, b), g)
    # db sums g * gelu'(pre) over rows, and pre differs by the GEMMs' rounding: judged against
    # the size of what it sums.
    db_scale = g.abs().sum((0, 1))
    for got, want, scale in ((dx, dx_ref, None), (dw_in_out, dw_ref.t(), None),
                             (db, db_ref, db_scale)):
        assert rel_err(got, want, scale) <= tol
    assert dw_in_out.is_contiguous()
    # The op's own grad_weight is the (in, out) storage seen as (out, in): no copy to make.
    _, pre = torch.ops.fusedlayers.linear_gelu_with_pre(x.detach(), w_in_out.detach().t(), b,
                                                        approximate)
    _, dw, _ = torch.ops.fusedlayers.linear_gelu_backward(g, x.detach(), w_in_out.detach().t(),
                                                          pre, True, approximate)
    assert dw.shape == (6, 13) and dw.t().is_contiguous()


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("approximate", APPROX)
def test_dbias_deterministic_across_thread_counts(dtype, approximate, restore_threads):
    x = torch.randn(4099, 64).to(dtype)
    w = torch.randn(300, 64).to(dtype)
    b = torch.randn(300).to(dtype).requires_grad_()
    g = torch.randn(4099, 300).to(dtype)
    dbs = []
    for threads in (1, 2, 3, 1):
        torch.set_num_threads(threads)
        y = fusedlayers.linear_gelu(x, w, b, approximate)
        (db,) = torch.autograd.grad(y, b, g)
        dbs.append(db)
    for db in dbs[1:]:
        assert_bitwise(db, dbs[0])
