"""CUDA kernels against torch eager on the GPU (marked `cuda`; skipped without a CUDA device).

References are computed by torch in float32 (float64 for the fp32 cases' gradients) from the same
inputs; fp16/bf16 tolerances are calibrated against torch's own half-precision result."""

import contextlib
import copy
import math

import pytest
import torch
import torch.nn.functional as F

import fusedlayers as fl
from _helpers import assert_bitwise, concurrent_mismatches, rel_err

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def assert_close(ours, torch_own, ref, dtype, what, scale=None):
    """ours must be about as close to the float64 reference as torch's own result in this dtype;
    scale: the size of the terms a parameter gradient sums over the rows (see rel_err), so a sum
    that cancels to nearly zero is judged against what was summed."""
    err = rel_err(ours, ref, scale)
    bound = 2 * rel_err(torch_own, ref, scale) + (1e-5 if dtype == torch.float32 else 1e-3)
    assert err <= bound, f"{what}: relative error {err:.3e} > {bound:.3e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [1, 7, 768, 1000, 1024, 2048, 4096, 4097, 8192, 12288, 65536])
@pytest.mark.parametrize("rows", [0, 1, 7, 32768])
def test_layer_norm_matches_torch(rows, cols, dtype):
    if rows * cols > 2**28:
        pytest.skip("too large for whole-tensor references: see test_layer_norm_beyond_int32")
    x = torch.randn(rows, cols, device="cuda", dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(cols, device="cuda", dtype=dtype)).requires_grad_()
    b = (0.1 * torch.randn(cols, device="cuda", dtype=dtype)).requires_grad_()
    y = fl.layer_norm(x, cols, w, b)
    dy = torch.randn_like(y)
    gx, gw, gb = torch.autograd.grad(y, (x, w, b), dy)
    xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, b))
    yr = F.layer_norm(xr, (cols,), wr, br)
    rx, rw, rb = torch.autograd.grad(yr, (xr, wr, br), dy.double())
    yh = F.layer_norm(x, (cols,), w, b)  # torch in the test dtype
    hx, hw, hb = torch.autograd.grad(yh, (x, w, b), dy)
    if rows == 0:
        assert y.shape == (0, cols) and (gw == 0).all() and (gb == 0).all()
        return
    assert_close(y, yh, yr, dtype, "y")
    if cols > 1:  # with one column x - mean is 0: dx and dgamma are exactly 0
        assert_close(gx, hx, rx, dtype, "dx")
        xhat = F.layer_norm(xr.detach(), (cols,))
        assert_close(gw, hw, rw, dtype, "dgamma", (dy.double() * xhat).abs().sum(0))
    assert_close(gb, hb, rb, dtype, "dbeta", dy.double().abs().sum(0))


@pytest.mark.parametrize("rows,cols", [(32769, 65536), (2**21 + 3, 1024)])
def test_layer_norm_beyond_int32(rows, cols):
    """More than 2^31 elements (2^31 + 65536 in 65536-wide rows for the block kernel, 2^31 + 3072
    in 1024-wide rows for the warp kernel): the first and the last rows (past the int32 range)
    against float32 torch, and dgamma/dbeta over all rows against a float64 sum taken in row
    blocks, within 2x the error of rounding that sum to bfloat16."""
    assert rows * cols > 2**31
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (1 + 0.1 * torch.randn(cols, device="cuda")).bfloat16().requires_grad_()
    b = (0.1 * torch.randn(cols, device="cuda")).bfloat16().requires_grad_()
    y = fl.layer_norm(x, cols, w, b)
    dy = torch.randn_like(y)
    gx, gw, gb = torch.autograd.grad(y, (x, w, b), dy)
    for r in (slice(0, 64), slice(rows - 64, rows)):
        xr = x[r].detach().float().requires_grad_()
        yr = F.layer_norm(xr, (cols,), w.detach().float(), b.detach().float())
        (rx,) = torch.autograd.grad(yr, xr, dy[r].float())
        yh = F.layer_norm(x[r].detach(), (cols,), w.detach(), b.detach())
        assert_close(y[r], yh, yr, torch.bfloat16, f"y rows {r}")
        assert rel_err(gx[r], rx) < 1e-2, f"dx rows {r}"
    ref_w = torch.zeros(cols, device="cuda", dtype=torch.float64)
    ref_b = torch.zeros_like(ref_w)
    for start in range(0, rows, 4096):
        xs, dys = x[start:start + 4096].detach().double(), dy[start:start + 4096].double()
        ref_w += (dys * F.layer_norm(xs, (cols,))).sum(0)
        ref_b += dys.sum(0)
    for name, ours, ref in (("dgamma", gw, ref_w), ("dbeta", gb, ref_b)):
        rounding = rel_err(ref.bfloat16(), ref)
        assert rel_err(ours, ref) <= 2 * rounding, f"{name}: {rel_err(ours, ref):.3e}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_half_input_float32_params(dtype):
    x = torch.randn(33, 1000, device="cuda", dtype=dtype)
    w, b = torch.randn(1000, device="cuda"), torch.randn(1000, device="cuda")
    y = fl.layer_norm(x, 1000, w, b)
    ref = F.layer_norm(x.float(), (1000,), w, b)
    assert y.dtype == dtype and rel_err(y, ref) < (1e-6 if dtype == torch.float32 else 5e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_misaligned_params(dtype):
    """gamma/beta at an odd element offset cannot be read as vectors: still right."""
    cols = 1024
    x = torch.randn(300, cols, device="cuda", dtype=dtype, requires_grad=True)
    params = torch.randn(2 * cols + 1, device="cuda", dtype=dtype, requires_grad=True)
    w, b = params[1:cols + 1], params[cols + 1:]
    y = fl.layer_norm(x, cols, w, b)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, params), dy)
    xr, pr = (t.detach().float().requires_grad_() for t in (x, params))
    yr = F.layer_norm(xr, (cols,), pr[1:cols + 1], pr[cols + 1:])
    refs = torch.autograd.grad(yr, (xr, pr), dy.float())
    yh = F.layer_norm(x, (cols,), w, b)
    halves = torch.autograd.grad(yh, (x, params), dy)
    assert_close(y, yh, yr, dtype, "y")
    for name, g, h, r in zip(("dx", "dparams"), grads, halves, refs):
        assert_close(g, h, r, dtype, name)


@pytest.mark.parametrize("memory_efficient", [False, True])
def test_layer_norm_backward_is_deterministic(memory_efficient):
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1024, device="cuda", requires_grad=True)
    b = torch.randn(1024, device="cuda", requires_grad=True)
    dy = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    ln = lambda: torch.ops.fusedlayers.layer_norm(x, [1024], w, b, 1e-5, memory_efficient)[0]
    first = torch.autograd.grad(ln(), (x, w, b), dy)
    second = torch.autograd.grad(ln(), (x, w, b), dy)
    for a, c in zip(first, second):
        assert torch.equal(a, c)


def test_layer_norm_non_contiguous_and_rms_mode():
    base = torch.randn(64, 2 * 768, device="cuda")
    x = base[:, ::2]  # strided
    w = torch.randn(768, device="cuda")
    assert rel_err(fl.layer_norm(x, 768, w), F.layer_norm(x, (768,), w)) < 1e-6
    xt = torch.randn(768, 64, device="cuda").t()  # transposed
    assert rel_err(fl.layer_norm(xt, 768), F.layer_norm(xt, (768,))) < 1e-6
    # Keras' rms_scaling: x * rsqrt(var(x) + eps) * gamma.
    y = torch.ops.fusedlayers.layer_norm(x, [768], w, None, 1e-3, False, True)[0]
    ref = x * torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-3) * w
    assert rel_err(y, ref) < 1e-6


@pytest.mark.parametrize("offset", [0.0, 10.0])
def test_layer_norm_rms_mode_gradients(offset):
    """Keras' rms_scaling backward against float64 autograd, also for rows whose mean is 10
    standard deviations from zero, where the textbook form of dx cancels."""
    x = (torch.randn(4096, 768, device="cuda") + offset).requires_grad_()
    w = (1 + 0.1 * torch.randn(768, device="cuda")).requires_grad_()

    def rms(x, w):
        return x * torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-3) * w

    y = torch.ops.fusedlayers.layer_norm(x, [768], w, None, 1e-3, False, True)[0]
    dy = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    hx, hw = torch.autograd.grad(rms(x, w), (x, w), dy)  # torch in float32
    xd, wd = (t.detach().double().requires_grad_() for t in (x, w))
    rx, rw = torch.autograd.grad(rms(xd, wd), (xd, wd), dy.double())
    assert_close(gx, hx, rx, torch.float32, "dx")
    assert_close(gw, hw, rw, torch.float32, "dgamma")


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("n", [1, 31, 33, 4099, 1 << 20, (1 << 20) + 45])
def test_relu_scale_mask_matches_cpu(dtype, n):
    """The saved bitmask (csrc/activation/relu_scale.h layout) equals the CPU kernel's, aligned and not."""
    x = torch.randn(n + 1, dtype=dtype)
    x[torch.randint(0, n + 1, (n // 7,))] = float("nan")
    x[torch.randint(0, n + 1, (n // 7,))] = 0.0
    xd = x.cuda()
    for sl in (slice(0, n), slice(1, n + 1)):  # 16-byte aligned, then misaligned on the device
        y, mask = torch.ops.fusedlayers.relu_scale_with_mask(xd[sl], 0.5)
        y_cpu, mask_cpu = torch.ops.fusedlayers.relu_scale_with_mask(x[sl], 0.5)
        assert torch.equal(mask.cpu(), mask_cpu)
        assert_bitwise(y.cpu(), y_cpu)
        dy = torch.randn(n, dtype=dtype)
        dx = torch.ops.fusedlayers.relu_scale_backward(dy.cuda(), mask, 0.5)
        assert torch.equal(dx.cpu(), torch.ops.fusedlayers.relu_scale_backward(dy, mask_cpu, 0.5))


def test_relu_scale_beyond_int32_elements():
    n = 2**31 + 17
    x = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    x.normal_()
    x.requires_grad_()
    y = fl.relu_scale(x, -1.5)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))  # through the mask: 64-bit word index
    for start in (0, n - 2**20, 2**31 - 5):  # chunks, incl. the tail past 2^31
        sl = slice(start, start + 2**20)
        assert torch.equal(y[sl], torch.relu(x[sl]) * -1.5)
        assert torch.equal(dx[sl], torch.where(x[sl] > 0, -1.5, 0.0).bfloat16())


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_negative_tail_relative_accuracy(approximate):
    # GELU and its gradient from e^{-u^2/2} times the erfc fit (or a sigmoid) keep their relative
    # accuracy where 1 + erf(u) would cancel, with the kernel's fast exponentials.
    u = torch.linspace(-9, -3, 6001, device="cuda", dtype=torch.float32, requires_grad=True)
    y = fl.linear_gelu(u[:, None], torch.ones(1, 1, device="cuda"), None, approximate)[:, 0]
    (dy,) = torch.autograd.grad(y, u, torch.ones_like(y))
    v = u.detach().double().requires_grad_()
    if approximate == "none":
        exact = v * 0.5 * torch.special.erfc(-v / math.sqrt(2))
    else:
        exact = v * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (v + 0.044715 * v**3))
    (dexact,) = torch.autograd.grad(exact, v, torch.ones_like(exact))
    for name, ours, ref in (("y", y, exact), ("dy/du", dy, dexact)):
        worst = ((ours.double() - ref) / ref).abs().max().item()
        assert worst <= 2e-5, f"{name}: {worst}"


def test_linear_gelu_dbias_is_deterministic():
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    run = lambda: torch.autograd.grad(fl.linear_gelu(x, w, b), (x, w, b), dy)
    for a, c in zip(run(), run()):
        assert torch.equal(a, c)


def test_non_default_stream():
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = torch.randn(4096, 4096, device="cuda", requires_grad=True)
        w = torch.randn(4096, device="cuda", requires_grad=True)
        y = fl.relu_scale(fl.layer_norm(x, 4096, w), 2.0)
        g = torch.autograd.grad(y.sum(), (x, w))
        h = F.layer_norm(x, (4096,), w)
        ref = torch.relu(h) * 2.0
        # ReLU's gradient jumps at 0: an output within rounding of 0 (1 in ~10^7 here) may take
        # the other side in the two forwards, so the reference backward uses the fused mask.
        gr = torch.autograd.grad(h, (x, w), (y > 0) * 2.0)
    s.synchronize()
    assert rel_err(y, ref) < 1e-6
    assert all(rel_err(a, c) < 1e-5 for a, c in zip(g, gr))


def _every_layer():
    """Every layer (so every op, forward and backward) as (name, module built on the CPU)."""
    from fusedlayers.torch import FusedLinearGELU, FusedReLUScale, LayerNorm, RMSNorm
    return [("FusedReLUScale", FusedReLUScale(0.5)),
            ("FusedLinearGELU erf", FusedLinearGELU(96, 80)),
            ("FusedLinearGELU tanh", FusedLinearGELU(96, 80, approximate="tanh")),
            ("LayerNorm", LayerNorm(96)),
            ("LayerNorm memory_efficient, no bias", LayerNorm(96, bias=False,
                                                              memory_efficient=True)),
            ("RMSNorm", RMSNorm(96))]


def _train_step(module, x, dy):
    """Forward and backward on x's device; x is produced on that device's current stream behind a
    ~1 ms sleep, so a kernel launched on any other stream reads it unfinished."""
    with torch.cuda.device(x.device):
        torch.cuda._sleep(1_000_000)
    x = (x * 1).requires_grad_()
    y = module(x)
    grads = torch.autograd.grad(y, [x, *module.parameters()], dy)
    return [t.detach() for t in (y, *grads)]


@contextlib.contextmanager
def _streams(stream, current_device: int):
    """`stream` current on its device while `current_device` is the current device
    (torch.cuda.stream would also make the stream's device current)."""
    torch.cuda.set_stream(stream)
    torch.cuda.set_device(current_device)
    try:
        yield
    finally:
        torch.cuda.set_stream(torch.cuda.default_stream(stream.device))
        torch.cuda.set_device(0)


def _allocations_made(device: int) -> int:
    """How many allocations the caching allocator has made on `device` in this process."""
    return torch.cuda.memory_stats(device)["allocation.all.allocated"]


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@two_gpus
@pytest.mark.parametrize("dtype", DTYPES)
def test_second_device_same_bits_its_stream_nothing_on_the_first(dtype):
    """On cuda:1 while cuda:0 is current, and while cuda:1 is: every layer gives the bits it
    gives on cuda:0, runs on cuda:1's current stream (a side stream here) and allocates nothing
    on cuda:0, not even transiently. Counted by allocations made, not bytes held: the reference
    step's tensors on cuda:0 may be freed during the step (autograd's device thread lets its
    graph go after torch.autograd.grad returns), which would hide an allocation from a peak."""
    torch.cuda.set_device(0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(67, 96, generator=gen).to(dtype)
    for name, layer in _every_layer():
        dy = torch.randn(67, 80 if "Linear" in name else 96, generator=gen).to(dtype)
        on1 = copy.deepcopy(layer).to("cuda:1", dtype)
        want = [t.cpu() for t in _train_step(layer.to("cuda:0", dtype), x.cuda(0), dy.cuda(0))]
        for current in (0, 1):
            torch.cuda.synchronize(0)
            before = _allocations_made(0)
            side = torch.cuda.Stream(device="cuda:1")
            with _streams(side, current):
                got = _train_step(on1, x.to("cuda:1"), dy.to("cuda:1"))
                side.synchronize()
            for a, b in zip(got, want):
                assert a.device == torch.device("cuda:1"), name
                assert_bitwise(a.cpu(), b)
            assert _allocations_made(0) == before, (
                f"{name}, current device {current}: allocated on cuda:0")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("n", [96, 70])  # tanh: cuBLASLt's GELU epilogue (n % 8 == 0) or not
@pytest.mark.parametrize("layout", ["out_in", "in_out"])
@pytest.mark.parametrize("row_offset", [0, 1])  # 1: x starts 67 elements into its buffer
def test_linear_gelu_layouts_alignment_and_no_grad(layout, row_offset, n, approximate, dtype):
    """Weights read in place in both layouts, inputs whose pointers are only 2- or 4-byte aligned
    (cuBLASLt must be told), and the forward without a backward (no pre-activation, GELU_BIAS
    epilogue): each against float64, and dW in the weight's own layout."""
    m, k = 33, 67
    x = torch.randn(m + row_offset, k, device="cuda", dtype=dtype)[row_offset:].requires_grad_()
    storage = torch.randn(*((n, k) if layout == "out_in" else (k, n)), device="cuda", dtype=dtype)
    w_param = (storage / k**0.5).requires_grad_()
    w = w_param if layout == "out_in" else w_param.t()
    b = torch.randn(n, device="cuda", dtype=dtype, requires_grad=True)
    y = fl.linear_gelu(x, w, b, approximate)
    with torch.no_grad():
        y_no_grad = fl.linear_gelu(x, w, b, approximate)
    dy = torch.randn_like(y)
    dx, dw, db = torch.autograd.grad(y, (x, w_param, b), dy)
    ref = [t.detach().double().requires_grad_() for t in (x, w_param, b)]
    w_ref = ref[1] if layout == "out_in" else ref[1].t()
    yr = F.gelu(F.linear(ref[0], w_ref, ref[2]), approximate=approximate)
    grads_ref = torch.autograd.grad(yr, ref, dy.double())
    yh = F.gelu(F.linear(x, w, b), approximate=approximate)  # torch in the test dtype
    grads_h = torch.autograd.grad(yh, (x, w_param, b), dy)
    assert_close(y, yh, yr, dtype, "y")
    assert_close(y_no_grad, yh, yr, dtype, "y without grad")
    for name, g, h, r in zip(("dx", "dW", "db"), (dx, dw, db), grads_h, grads_ref):
        assert_close(g, h, r, dtype, name)
    assert dw.shape == w_param.shape and dw.is_contiguous()


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_autocast_cuda_matches_native_policy(x_dtype):
    """Under CUDA autocast: linear_gelu in bf16 like F.linear, layer_norm in float32 like
    F.layer_norm, relu_scale in the input dtype like relu."""
    from fusedlayers.torch import FusedLinearGELU, FusedReLUScale, LayerNorm
    x = torch.randn(8, 64, device="cuda", dtype=x_dtype)
    lin, ln = FusedLinearGELU(64, 32, device="cuda"), LayerNorm(64, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        pairs = [(lin(x), F.gelu(F.linear(x, lin.weight, lin.bias))),
                 (ln(x), F.layer_norm(x, (64,), ln.weight, ln.bias)),
                 (FusedReLUScale(1.0)(x), torch.relu(x))]
    for ours, native in pairs:
        assert ours.dtype == native.dtype
        assert rel_err(ours, native) <= 1e-2


def test_threads_share_no_cublaslt_state():
    """Two host threads running linear_gelu of different shapes at once (cached cuBLASLt plans
    are per thread) get the same results as one thread."""
    cases = []
    for m, k, n in [(257, 96, 160), (64, 512, 1024)]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        cases.append(((x, w), fl.linear_gelu(x, w, None, "tanh")))
    torch.cuda.synchronize()
    failures = concurrent_mismatches(lambda x, w: fl.linear_gelu(x, w, None, "tanh"), cases,
                                     torch.equal, repeats=50)
    assert not failures


@pytest.mark.parametrize("precision", ["bf16", "autocast"])
@pytest.mark.parametrize("name", ["bert", "vit", "gpt2"])
def test_fused_hf_model_on_cuda(name, precision):
    """fuse() on a model already on CUDA: same outputs as before, and no graph breaks."""
    import copy
    from test_fuse import EXPECTED, hf_model, swapped_count
    from fusedlayers.torch import fuse
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model, inputs = hf_model(name, dtype)
    model = model.cuda().eval()
    inputs = {k: v.cuda() for k, v in inputs.items()}
    unfused = copy.deepcopy(model)
    fuse(model)
    assert len(model.fusedlayers_report.swapped) == swapped_count(name)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16,
                                         enabled=precision == "autocast"):
        out = model(**inputs).last_hidden_state
        ref = unfused(**inputs).last_hidden_state
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(**inputs)
    assert out.dtype == ref.dtype and rel_err(out, ref) <= 2e-2
    assert explained.graph_break_count == 0, explained.break_reasons
