"""layer_norm forward and backward (dx, dweight, dbias) against torch.nn.functional.layer_norm
on float64 copies of fresh random inputs: widths that are not powers of two, 0/1/many rows,
multi-dim normalized_shape, optional weight/bias, memory_efficient, strided inputs, eps, mixed
parameter dtypes, statistics, determinism across thread counts, gradcheck and opcheck.

Tolerances: float64 1e-12 and float32 1e-5 relative norm error; float16/bfloat16 at most twice
the error of torch's own native layer_norm in that dtype against the same float64 reference."""

import pytest
import torch
import torch.nn.functional as F

import fusedlayers
import fusedlayers.torch as ops
from _helpers import (DEVICES, HALF, as_layout, assert_bitwise, assert_calibrated, f64, grads,
                      leaf_shape, rel_err)

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def make_params(shape, dtype, affine, with_bias, memory_efficient):
    """weight/bias leaves (or None); weight away from 0 when memory_efficient needs it."""
    w = b = None
    if affine:
        if memory_efficient:
            sign = torch.where(torch.rand(shape) < 0.5, -1.0, 1.0)
            w = ((torch.rand(shape, dtype=torch.float64) + 0.5) * sign).to(dtype)
        else:
            w = torch.randn(shape, dtype=torch.float64).to(dtype)
        w.requires_grad_()
    if with_bias:
        b = (torch.randn(shape, dtype=torch.float64) * 0.5).to(dtype).requires_grad_()
    return w, b


def check_layer_norm(shape, normalized_shape, dtype, *, affine=True, with_bias=True,
                     memory_efficient=False, eps=1e-5, layout="contiguous", param_dtype=None,
                     make_x=None, zero=()):
    """Runs fused, torch-native (same dtypes) and float64 reference; asserts the errors."""
    param_dtype = param_dtype or dtype
    normalized_shape = tuple(normalized_shape)
    if make_x is None:
        x = torch.randn(leaf_shape(shape, layout), dtype=torch.float64) * 2 + 0.5
    else:
        x = make_x(leaf_shape(shape, layout))
    x = x.to(dtype).requires_grad_()
    view = lambda t: as_layout(t, shape, layout)  # noqa: E731
    w, b = make_params(normalized_shape, param_dtype, affine, with_bias, memory_efficient)
    g = torch.randn(shape, dtype=torch.float64).to(dtype)

    # Gradients are taken at the (strided) view the op receives: what the op computes, without
    # the extra summation of an expanded input's backward.
    xv = view(x)
    y = ops.layer_norm(xv, normalized_shape, w, b, eps, memory_efficient)
    assert y.dtype == dtype and y.shape == tuple(shape) and y.is_contiguous()
    ours = [y, *grads(y, [xv, w, b], g)]

    x64, w64, b64 = f64(x), f64(w), f64(b)
    x64v = view(x64)
    y64 = F.layer_norm(x64v, normalized_shape, w64, b64, eps)
    ref = [y64, *grads(y64, [x64v, w64, b64], g.double())]

    native = None
    if dtype in HALF:
        xn, wn, bn = (None if t is None else t.detach().clone().requires_grad_() for t in (x, w, b))
        xnv = view(xn)
        yn = F.layer_norm(xnv, normalized_shape, wn, bn, eps)
        native = [yn, *grads(yn, [xnv, wn, bn], g)]

    cols = 1
    for d in normalized_shape:
        cols *= d
    # Magnitudes of the per-row terms that dweight and dbias sum (see rel_err).
    xhat64 = F.layer_norm(x64v.detach(), normalized_shape, eps=eps).reshape(-1, cols)
    g64 = g.double().reshape(-1, cols)
    scales = {"dweight": (g64 * xhat64).abs().sum(0).reshape(normalized_shape),
              "dbias": g64.abs().sum(0).reshape(normalized_shape)}
    for i, name in enumerate(("y", "dx", "dweight", "dbias")):
        if ref[i] is None:
            assert ours[i] is None
            continue
        assert ours[i].dtype == (dtype if name in ("y", "dx") else param_dtype), name
        if name in zero or (cols == 1 and name in ("dx", "dweight")):
            # xhat is exactly 0 (cols == 1, or constant rows): the true dweight is 0, and so is
            # dx when cols == 1. Relative error is meaningless there: absolute tolerance.
            atol = 1e-6 if dtype in TOL else 1e-3
            assert ours[i].numel() == 0 or ours[i].abs().max().item() <= atol, name
            continue
        scale = scales.get(name)
        err = rel_err(ours[i], ref[i], scale)
        if dtype in TOL:
            assert err <= TOL[dtype], f"{name}: relative error {err:.3e} > {TOL[dtype]:.0e}"
        else:
            assert_calibrated(err, rel_err(native[i], ref[i], scale), name, dtype=dtype,
                              numel=ref[i].numel(), factor=2.0, floor=1e-4)
    return ours, (w, b)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("rows", (0, 1, 33))
@pytest.mark.parametrize("cols", (1, 7, 768, 1000, 4097))
def test_widths_and_rows(cols, rows, dtype):
    check_layer_norm((rows, cols), (cols,), dtype)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("memory_efficient", (False, True))
@pytest.mark.parametrize("affine,with_bias", [(True, True), (True, False), (False, False),
                                              (False, True)])
def test_affine_variants(affine, with_bias, memory_efficient, dtype):
    check_layer_norm((33, 1000), (1000,), dtype, affine=affine, with_bias=with_bias,
                     memory_efficient=memory_efficient)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
@pytest.mark.parametrize("memory_efficient", (False, True))
@pytest.mark.parametrize("cols", (7, 4097))
def test_memory_efficient_widths(cols, memory_efficient, dtype):
    check_layer_norm((17, cols), (cols,), dtype, memory_efficient=memory_efficient)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16))
@pytest.mark.parametrize("shape,normalized_shape", [
    ((4, 9, 33), (33,)),
    ((4, 3, 6, 10), (6, 10)),
    ((6, 10), (6, 10)),          # no leading dims: one row, scalar mean/rstd
    ((2, 0, 7), (7,)),           # empty leading dim
    ((3, 2, 5, 7), (2, 5, 7)),
])
def test_multi_dim(shape, normalized_shape, dtype):
    check_layer_norm(shape, normalized_shape, dtype)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, torch.bfloat16))
@pytest.mark.parametrize("layout", ("transposed", "sliced", "expanded"))
@pytest.mark.parametrize("memory_efficient", (False, True))
def test_non_contiguous_input(layout, dtype, memory_efficient):
    shape = (5, 9, 33)
    x = torch.empty(leaf_shape(shape, layout))
    assert not as_layout(x, shape, layout).is_contiguous()
    check_layer_norm(shape, (33,), dtype, layout=layout, memory_efficient=memory_efficient)


@pytest.mark.parametrize("layout", ("transposed", "sliced"))
def test_non_contiguous_multi_dim(layout):
    check_layer_norm((4, 6, 10), (6, 10), torch.float32, layout=layout)


def test_non_contiguous_params():
    x = torch.randn(8, 12, dtype=torch.float64, requires_grad=True)
    w_store = torch.randn(24, dtype=torch.float64, requires_grad=True)
    b_store = torch.randn(12, 2, dtype=torch.float64, requires_grad=True)
    g = torch.randn(8, 12, dtype=torch.float64)
    y = fusedlayers.layer_norm(x, 12, w_store[::2], b_store[:, 1])
    got = grads(y, [x, w_store, b_store], g)
    ref_leaves = [t.detach().clone().requires_grad_() for t in (x, w_store, b_store)]
    y_ref = F.layer_norm(ref_leaves[0], (12,), ref_leaves[1][::2], ref_leaves[2][:, 1])
    want = grads(y_ref, ref_leaves, g)
    assert rel_err(y, y_ref) <= 1e-12
    for a, r in zip(got, want):
        assert rel_err(a, r) <= 1e-12


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
@pytest.mark.parametrize("eps", (0.0, 1e-12, 1e-3, 0.1, 2, 10.0))
def test_eps(eps, dtype):
    check_layer_norm((9, 100), (100,), dtype, eps=eps)


def test_eps_is_used():
    # A small-variance row where eps dominates: eps must enter rstd as 1/sqrt(var + eps).
    x = torch.randn(4, 64, dtype=torch.float64) * 1e-3
    for eps in (1e-5, 1e-2):
        assert rel_err(fusedlayers.layer_norm(x, 64, eps=eps),
                       F.layer_norm(x, (64,), eps=eps)) <= 1e-12


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("memory_efficient", (False, True))
def test_half_input_float32_params(dtype, memory_efficient):
    ours, _ = check_layer_norm((33, 768), (768,), dtype, param_dtype=torch.float32,
                               memory_efficient=memory_efficient)
    assert ours[2].dtype == torch.float32 and ours[3].dtype == torch.float32


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("shape,normalized_shape", [((33, 1000), (1000,)),
                                                    ((2, 3, 6, 10), (6, 10)),
                                                    ((0, 7), (7,))])
def test_mean_rstd(dtype, shape, normalized_shape):
    x = (torch.randn(shape, dtype=torch.float64) * 3 + 1).to(dtype)
    eps = 1e-5
    y, mean, rstd = torch.ops.fusedlayers.layer_norm(x, list(normalized_shape), None, None, eps)
    stat_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    lead = shape[:len(shape) - len(normalized_shape)]
    assert mean.dtype == stat_dtype and rstd.dtype == stat_dtype
    assert mean.shape == lead and rstd.shape == lead
    if x.numel() == 0:
        return
    dims = tuple(range(len(lead), len(shape)))
    var64, mean64 = torch.var_mean(x.double(), dim=dims, unbiased=False)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert rel_err(mean, mean64) <= tol
    assert rel_err(rstd, (var64 + eps).rsqrt()) <= tol


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64))
def test_constant_rows(dtype):
    # Zero variance, with values whose sums are exact: mean == x, xhat == 0, so y == bias
    # exactly and dweight == 0; dx = rstd * (g - mean(g)) is checked against the reference.
    def constant_rows(shape):
        return (torch.randint(-16, 16, (shape[0], 1)) / 4).double().expand(shape).contiguous()

    (y, _, dw, _), (_, b) = check_layer_norm((16, 300), (300,), dtype, make_x=constant_rows,
                                                zero=("dweight",))
    assert_bitwise(y, b.detach().expand(16, 300))
    assert dw.abs().max().item() == 0


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_nan_inf_propagate_like_torch(dtype):
    x = torch.randn(8, 40).to(dtype)
    x[2, 5] = float("nan")
    x[4, 0] = float("inf")
    x[5, 3] = -float("inf")
    x[6, :] = float("inf")
    w, b = torch.randn(40).to(dtype), torch.randn(40).to(dtype)
    ours, native = fusedlayers.layer_norm(x, 40, w, b), F.layer_norm(x, (40,), w, b)
    assert torch.equal(ours.isnan(), native.isnan())
    assert torch.equal(ours.isinf(), native.isinf())
    finite = native.isfinite()
    assert finite[[0, 1, 3, 7]].all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(ours[finite], native[finite]) <= tol


def test_does_not_modify_inputs():
    x, w, b = torch.randn(5, 16), torch.randn(16), torch.randn(16)
    copies = [t.clone() for t in (x, w, b)]
    fusedlayers.layer_norm(x, 16, w, b)
    for t, c in zip((x, w, b), copies):
        assert torch.equal(t, c)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("memory_efficient", (False, True))
def test_deterministic_across_thread_counts(dtype, memory_efficient, restore_threads):
    rows, cols = 4099, 300
    x = (torch.randn(rows, cols) * 2).to(dtype).requires_grad_()
    w, b = make_params((cols,), dtype, True, True, True)
    g = torch.randn(rows, cols).to(dtype)
    results = []
    for threads in (1, 2, 3, 1):
        torch.set_num_threads(threads)
        y = ops.layer_norm(x, (cols,), w, b, 1e-5, memory_efficient)
        results.append([y, *grads(y, [x, w, b], g)])
    for other in results[1:]:
        for a, r in zip(other, results[0]):
            assert_bitwise(a, r)


@pytest.mark.parametrize("memory_efficient", (False, True))
@pytest.mark.parametrize("affine,with_bias", [(True, True), (False, False), (True, False),
                                              (False, True)])
def test_gradcheck(affine, with_bias, memory_efficient):
    x = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    w, b = make_params((7,), torch.float64, affine, with_bias, True)
    inputs = [t for t in (x, w, b) if t is not None]

    def fn(*args):
        it = iter(args)
        xx = next(it)
        ww = next(it) if w is not None else None
        bb = next(it) if b is not None else None
        return ops.layer_norm(xx, 7, ww, bb, 1e-5, memory_efficient)

    assert torch.autograd.gradcheck(fn, tuple(inputs))


def test_gradcheck_multi_dim_strided():
    x = torch.randn(3, 5, 4, dtype=torch.float64).transpose(-1, -2).requires_grad_()
    w = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: fusedlayers.layer_norm(a[0], (4, 5), a[1], a[2]),
                                    (x, w, b))


def _opcheck_cases():
    def t(*shape, dtype=torch.float32):
        return torch.randn(shape, dtype=dtype, requires_grad=True)
    return [
        ("affine", (t(4, 7), [7], t(7), t(7), 1e-5)),
        ("no_params", (t(4, 7), [7], None, None, 1e-5)),
        ("weight_only_memeff", (t(3, 5, 7), [7], t(7) + 2, None, 1e-3, True)),
        ("bias_only", (t(4, 7), [7], None, t(7), 1e-5)),
        ("multi_dim", (t(2, 6, 10), [6, 10], t(6, 10), t(6, 10), 1e-5)),
        ("strided", (t(7, 4).t(), [7], t(7), t(7), 1e-5)),
        ("bf16_fp32_params", (t(4, 7, dtype=torch.bfloat16), [7], t(7), t(7), 1e-5)),
        ("float64", (t(4, 7, dtype=torch.float64), [7], t(7, dtype=torch.float64), None, 0.1)),
    ]


@pytest.mark.parametrize("case", _opcheck_cases(), ids=lambda c: c[0])
def test_opcheck(case):
    _, args = case
    args = tuple(a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.requires_grad
                 and not a.is_leaf else a for a in args)
    torch.library.opcheck(torch.ops.fusedlayers.layer_norm.default, args)


@pytest.mark.parametrize("memory_efficient", (False, True))
@pytest.mark.parametrize("params", ("both", "none"))
def test_opcheck_backward(memory_efficient, params):
    x = torch.randn(5, 7)
    w, b = (torch.randn(7) + 3, torch.randn(7)) if params == "both" else (None, None)
    y, mean, rstd = torch.ops.fusedlayers.layer_norm(x, [7], w, b, 1e-5)
    saved = y if memory_efficient else x
    torch.library.opcheck(torch.ops.fusedlayers.layer_norm_backward.default,
                          (torch.randn(5, 7), saved, mean, rstd, [7], w, b, memory_efficient))


# rms_scaling=True: Keras' LayerNormalization(rms_scaling=True), used by fusedlayers.keras
# under KERAS_BACKEND=torch: y = x * rsqrt(var(x) + eps) * gamma (centered variance, no beta).

def rms_scaling64(x, norm_ndims, gamma, eps):
    dims = tuple(range(x.dim() - norm_ndims, x.dim()))
    var = (x - x.mean(dim=dims, keepdim=True)).square().mean(dim=dims, keepdim=True)
    y = x * torch.rsqrt(var + eps)
    return y if gamma is None else y * gamma


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32, torch.bfloat16))
@pytest.mark.parametrize("with_gamma", (True, False))
@pytest.mark.parametrize("shape,norm_ndims", [((33, 1000), 1), ((4, 6, 10), 2), ((0, 7), 1)])
def test_rms_scaling(shape, norm_ndims, with_gamma, dtype):
    x = (torch.randn(shape, dtype=torch.float64) + 0.7).to(dtype).requires_grad_()
    gamma = (torch.randn(shape[len(shape) - norm_ndims:], dtype=torch.float64).to(dtype)
             .requires_grad_() if with_gamma else None)
    g = torch.randn(shape, dtype=torch.float64).to(dtype)
    y = ops.layer_norm_trailing(x, norm_ndims, gamma, None, 1e-3, rms_scaling=True)
    assert y.dtype == dtype
    ours = [y, *grads(y, [x, gamma], g)]
    x64, gamma64 = f64(x), f64(gamma)
    y64 = rms_scaling64(x64, norm_ndims, gamma64, 1e-3)
    ref = [y64, *grads(y64, [x64, gamma64], g.double())]
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    for name, a, r in zip(("y", "dx", "dgamma"), ours, ref):
        if r is not None:
            assert rel_err(a, r) <= tol, name


def test_rms_scaling_gradcheck_and_opcheck():
    x = (torch.randn(4, 7, dtype=torch.float64) + 0.5).requires_grad_()
    gamma = torch.randn(7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, b: ops.layer_norm_trailing(a, 1, b, None, 1e-3, rms_scaling=True),
        (x, gamma))
    torch.library.opcheck(torch.ops.fusedlayers.layer_norm.default,
                          (x.float().detach().requires_grad_(), [7],
                           gamma.float().detach().requires_grad_(), None, 1e-3, False, False))


def test_rms_scaling_rejects_bias():
    with pytest.raises(ValueError, match=r"bias must be None when rms_scaling is True"):
        ops.layer_norm_trailing(torch.randn(3, 7), 1, None, torch.randn(7), 1e-3,
                                rms_scaling=True)


def rms_scaling_grad_scales(x, gamma, dy, eps):
    """Magnitudes of the terms summed into dx and dgamma of rms_scaling (float64): with
    gy = dy gamma, dx = rstd (gy - xhat rstd mean(gy x)) and dgamma = sum_rows dy x rstd."""
    mean = x.mean(-1, keepdim=True)
    rstd = torch.rsqrt((x - mean).square().mean(-1, keepdim=True) + eps)
    xhat, xs, gy = ((x - mean) * rstd).abs(), (x * rstd).abs(), (dy * gamma).abs()
    return rstd * (gy + xhat * (gy * xs).mean(-1, keepdim=True)), (dy.abs() * xs).sum(0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,cols", [(4096, 4), (1024, 768), (256, 4097)])
@pytest.mark.parametrize("offset", (10.0, 100.0))
def test_rms_scaling_offset_rows(offset, rows, cols, device):
    """Rows whose mean is 10 and 100 standard deviations from zero, where dx of rms_scaling is a
    small difference of large terms: dx and dgamma within 2x torch's own float32 autograd error
    (each judged against the magnitudes of the terms it sums) over four draws."""
    eps = 1e-3
    draws = {"dx": [], "dgamma": []}  # (ours, torch's, reference, scale) per draw
    for _ in range(4):
        x = (torch.randn(rows, cols) + offset).to(device).requires_grad_()
        gamma = (1 + 0.5 * torch.randn(cols)).to(device).requires_grad_()
        dy = torch.randn(rows, cols).to(device)
        y = ops.layer_norm_trailing(x, 1, gamma, None, eps, rms_scaling=True)
        ours = torch.autograd.grad(y, (x, gamma), dy)
        torch_own = torch.autograd.grad(rms_scaling64(x, 1, gamma, eps), (x, gamma), dy)
        x64, gamma64 = f64(x), f64(gamma)
        ref = torch.autograd.grad(rms_scaling64(x64, 1, gamma64, eps), (x64, gamma64),
                                  dy.double())
        scales = rms_scaling_grad_scales(x64, gamma64, dy.double(), eps)
        for name, *tensors in zip(draws, ours, torch_own, ref, scales):
            draws[name].append([t.double().flatten() for t in tensors])
    for name, tensors in draws.items():  # judged over all draws: one error per gradient
        a, h, r, sc = (torch.cat(t) for t in zip(*tensors))
        assert_calibrated(rel_err(a, r, sc), rel_err(h, r, sc),
                          f"rms_scaling {name}, rows at {offset} std", dtype=torch.float32,
                          numel=r.numel() // len(tensors))  # the ulp term: one draw's size



@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,cols", [(256, 4), (256, 768), (64, 4097), (64, 40000)])
@pytest.mark.parametrize("offset", (10.0, 100.0))
def test_layer_norm_offset_rows_forward(offset, rows, cols, device):
    """Rows 10 and 100 std from zero (std 1, mean within 0.5 of `offset`): the output within 1.25x
    torch's own float32 error, where both are mostly the rounding of the mean. The mean is
    x[0] + mean(x - x[0]); a plain float sum rounds at the scale of the mean (1.8-2.0x torch's
    error at 768 and 4096 cols, 100 std)."""
    z = torch.randn(rows, cols, dtype=torch.float64)
    z = (z - z.mean(1, keepdim=True)) / z.std(1, correction=0, keepdim=True)
    x = (z + offset + torch.rand(rows, 1, dtype=torch.float64) - 0.5).float().to(device)
    gamma, beta = (1 + 0.5 * torch.randn(cols)).to(device), torch.randn(cols).to(device)
    ref = F.layer_norm(f64(x), (cols,), f64(gamma), f64(beta), 1e-5)
    assert_calibrated(rel_err(fusedlayers.layer_norm(x, cols, gamma, beta, 1e-5), ref),
                      rel_err(F.layer_norm(x, (cols,), gamma, beta, 1e-5), ref),
                      f"layer_norm, rows at {offset} std", dtype=torch.float32,
                      numel=x.numel(), factor=1.25)
