"""fusedlayers.torch.linear_cross_entropy against the float64 unfused reference (F.linear then
F.cross_entropy) for every reduction, ignore_index, label_smoothing, softcap and z_loss, forward
and gradients, over several row chunks; gradcheck and opcheck; num_items_in_batch; half
precision; torch.compile keeping it one op; errors; and the CPU's peak memory staying far below
one N x V float32 buffer."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from _helpers import DEVICES, rel_err
from fusedlayers.torch import linear_cross_entropy
from fusedlayers.torch.linear_cross_entropy import reference

OPTIONS = [dict(), dict(label_smoothing=0.1), dict(softcap=3.0), dict(z_loss=1e-3),
           dict(label_smoothing=0.2, softcap=2.0, z_loss=1e-2, ignore_index=5)]


def _problem(n, h, v, dtype, device, bias, ignore_index=-100, seed=0, noncontiguous=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    if noncontiguous:
        x = torch.randn(h, n, generator=g, dtype=torch.float64).t()
    w = torch.randn(v, h, generator=g, dtype=torch.float64) / h ** 0.5 * 3
    b = torch.randn(v, generator=g, dtype=torch.float64) if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.2] = ignore_index
    cast = (lambda a: None if a is None else a.to(device, dtype).requires_grad_())
    return cast(x), cast(w), cast(b), t.to(device)


def _grads(loss, tensors, dy):
    return torch.autograd.grad(loss, [a for a in tensors if a is not None], dy)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(o) or "plain")
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_reference(device, reduction, options, bias):
    # 4500 rows: two chunks of rows (2304 and 2196); float32 against float64's exact loss
    # and gradients
    n, h, v = 4500, 19, 53
    dtype = torch.float32 if device == "cuda" else torch.float64
    x, w, b, t = _problem(n, h, v, dtype, device, bias, options.get("ignore_index", -100))
    loss = linear_cross_entropy(x, w, t, linear_bias=b, reduction=reduction, **options)
    x64, w64, b64 = (None if a is None else a.detach().double().requires_grad_()
                     for a in (x, w, b))
    want = reference(x64, w64, t, linear_bias=b64, reduction=reduction, **options)
    assert loss.dtype == dtype and loss.shape == want.shape
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert rel_err(loss.double(), want) <= tol
    dy = torch.rand_like(want) + 0.5
    got = _grads(loss, (x, w, b), dy.to(dtype))
    ref = _grads(want, (x64, w64, b64), dy)
    for a, r in zip(got, ref):
        assert rel_err(a.double(), r) <= tol * 10


CUDA = DEVICES[1]


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("dtype,v", [(torch.float32, 60007), (torch.bfloat16, 32000),
                                     (torch.bfloat16, 120001), (torch.float16, 9)])
@pytest.mark.parametrize("options", [dict(), dict(label_smoothing=0.1, softcap=20.0, z_loss=1e-4)],
                         ids=["plain", "all"])
@pytest.mark.parametrize("bias", [False, True])
def test_cuda_row_pass_wide_and_odd_rows(device, dtype, v, options, bias, seed):
    # rows whose logits are 16-byte aligned or not, wider than a block's shared memory (float32
    # 60007, bfloat16 120001) or not, vocabularies under one vector; ignored rows and a row of
    # an out-of-range target (NaN); against float64 on the op's own logits
    n = 37
    x, w, b, t = _problem(n, 24, v, dtype, device, bias, seed=seed)
    t[3] = v + 5
    loss = linear_cross_entropy(x, w, t, linear_bias=b, reduction="none", **options,
                                loss_dtype=torch.float32)
    assert torch.isnan(loss[3]) and not torch.isnan(loss[torch.arange(n) != 3]).any()
    kept = torch.arange(n, device=device) != 3
    x, t = x.detach()[kept].requires_grad_(), t[kept]
    loss = linear_cross_entropy(x, w, t, linear_bias=b, reduction="sum", **options,
                                loss_dtype=torch.float32)
    # the op adds the bias to the GEMM's logits in float32
    u = F.linear(x, w).double() + (0 if b is None else b.double())
    u = u.detach().requires_grad_()
    cap = options.get("softcap")
    z = cap * torch.tanh(u / cap) if cap else u
    rows = F.cross_entropy(z, t, reduction="none",
                           label_smoothing=options.get("label_smoothing", 0))
    want = (rows + options.get("z_loss", 0) * torch.logsumexp(z, -1) ** 2 * (t != -100)).sum()
    assert rel_err(loss.double(), want) <= 2e-6
    du, = torch.autograd.grad(want, u)
    dx = du.to(dtype).double() @ w.double()  # du rounded to dtype, as the op's GEMMs take it
    got, = torch.autograd.grad(loss, x)
    assert rel_err(got.double(), dx) <= (2e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gradcheck(reduction):
    x, w, b, t = _problem(9, 5, 11, torch.float64, "cpu", True)
    fn = lambda x, w, b: linear_cross_entropy(  # noqa: E731
        x, w, t, linear_bias=b, reduction=reduction, label_smoothing=0.1, softcap=2.5,
        z_loss=1e-2)
    assert torch.autograd.gradcheck(fn, (x, w, b))
    assert torch.autograd.gradgradcheck is not None  # (no double backward: first order only)


def test_opcheck():
    x, w, b, t = _problem(9, 5, 11, torch.float32, "cpu", True)
    for grads in (False, True):
        torch.library.opcheck(torch.ops.fusedlayers.linear_cross_entropy.default,
                              (x, w, b, t, None, "mean", -100, 0.1, 0.0, 1e-3, grads))


def test_num_items_in_batch_divides_the_sum():
    x, w, b, t = _problem(40, 7, 13, torch.float64, "cpu", False)
    loss = linear_cross_entropy(x, w, t, num_items_in_batch=100)
    want = reference(x, w, t, reduction="sum") / 100
    assert rel_err(loss, want) <= 1e-12
    gx, gw = torch.autograd.grad(loss, (x, w))
    wx, ww = torch.autograd.grad(want, (x, w))
    assert rel_err(gx, wx) <= 1e-12 and rel_err(gw, ww) <= 1e-12


def test_non_contiguous_input_and_leading_dims():
    x, w, _, t = _problem(30, 8, 17, torch.float64, "cpu", False, noncontiguous=True)
    x3, t3 = x.reshape(5, 6, 8), t.reshape(5, 6)
    loss = linear_cross_entropy(x3, w, t3, reduction="none")
    assert loss.shape == (5, 6)
    assert rel_err(loss, reference(x3, w, t3, reduction="none")) <= 1e-12


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(device, dtype):
    x, w, b, t = _problem(300, 32, 1000, dtype, device, True)
    loss = linear_cross_entropy(x, w, t, linear_bias=b, label_smoothing=0.1)
    x64, w64, b64 = (a.detach().double().requires_grad_() for a in (x, w, b))
    want = reference(x64, w64, t, linear_bias=b64, label_smoothing=0.1)
    assert loss.dtype == dtype
    # the logits are rounded to dtype by its GEMM, as the unfused layer's are
    assert rel_err(loss.double(), want) <= 1e-2
    for a, r in zip(torch.autograd.grad(loss, (x, w, b)), torch.autograd.grad(want, (x64, w64, b64))):
        assert rel_err(a.double(), r) <= 3e-2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_loss_dtype_float32_is_the_float32_loss(device, dtype, reduction, seed):
    x, w, _, t = _problem(300, 32, 1000, dtype, device, False, seed=seed)
    got = linear_cross_entropy(x, w, t, reduction=reduction, loss_dtype=torch.float32)
    default = linear_cross_entropy(x, w, t, reduction=reduction)
    assert got.dtype == torch.float32 and default.dtype == dtype
    assert torch.equal(default, got.to(dtype))  # the default: the same value, rounded
    # the loss of the same logits (the op's GEMM rounds them to dtype, as F.linear) in float64:
    # within float32's sums, where a result rounded to dtype is up to 2^-8 off
    logits = F.linear(x.detach(), w.detach()).double()
    want = F.cross_entropy(logits, t, reduction=reduction)
    assert rel_err(got.double(), want) <= 1e-4
    grads = torch.autograd.grad(got.sum(), (x, w))
    for g, r in zip(grads, torch.autograd.grad(default.sum(), (x, w))):
        assert g.dtype == dtype and torch.equal(g, r)
    with pytest.raises(TypeError, match="loss_dtype must be None or a floating dtype"):
        linear_cross_entropy(x, w, t, loss_dtype=torch.int64)
    assert linear_cross_entropy(x, w, t, loss_dtype="float32").dtype == torch.float32


def test_autocast_runs_in_its_dtype_with_float32_parameters():
    x, w, b, t = _problem(40, 16, 50, torch.float32, "cpu", True)
    with torch.autocast("cpu", torch.bfloat16):
        loss = linear_cross_entropy(x, w, t, linear_bias=b)
        want = reference(x, w, t, linear_bias=b)  # F.linear in bfloat16, then its loss
    assert loss.dtype == torch.bfloat16
    assert rel_err(loss.double(), want.double()) <= 1e-2
    gx, gw, gb = torch.autograd.grad(loss, (x, w, b))
    assert gx.dtype == gw.dtype == gb.dtype == torch.float32  # through the casts
    wx, ww, wb = torch.autograd.grad(want, (x, w, b))
    assert all(rel_err(g, r) <= 3e-2 for g, r in ((gx, wx), (gw, ww), (gb, wb)))


def test_no_grad_forward_and_all_ignored_rows():
    x, w, _, t = _problem(20, 6, 9, torch.float64, "cpu", False)
    with torch.no_grad():
        loss = linear_cross_entropy(x, w, t, reduction="sum")
    assert rel_err(loss, reference(x, w, t, reduction="sum")) <= 1e-12
    ignored = torch.full_like(t, -100)
    rows = linear_cross_entropy(x, w, ignored, reduction="none")
    assert torch.equal(rows, torch.zeros_like(rows))
    gx, = torch.autograd.grad(rows.sum(), x)
    assert torch.equal(gx, torch.zeros_like(gx))


def test_compiled_stays_one_op_with_ignored_labels():
    x, w, b, t = _problem(64, 16, 37, torch.float32, "cpu", True)
    fn = lambda x, w, b, t: linear_cross_entropy(x, w, t, linear_bias=b)  # noqa: E731
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    loss = compiled(x, w, b, t)
    assert rel_err(loss, fn(x, w, b, t)) <= 1e-6
    [graph] = graphs
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert any("fusedlayers.linear_cross_entropy" in s for s in targets), targets
    assert not any("linear" == s.split(".")[-1] or "mm" in s for s in targets), targets
    got = torch.autograd.grad(loss, (x, w, b))
    want = torch.autograd.grad(fn(x, w, b, t), (x, w, b))
    assert all(rel_err(a, r) <= 1e-6 for a, r in zip(got, want))
    inductor = torch.compile(fn, fullgraph=True)
    assert rel_err(inductor(x, w, b, t), fn(x, w, b, t)) <= 1e-6


def test_errors():
    x, w, b, t = _problem(6, 4, 7, torch.float32, "cpu", True)
    with pytest.raises(ValueError, match="reduction must be one of mean, sum, none, got 'avg'"):
        linear_cross_entropy(x, w, t, reduction="avg")
    with pytest.raises(ValueError, match=r"target must have input's leading shape \[6\]"):
        linear_cross_entropy(x, w, t[:5])
    with pytest.raises(ValueError, match="label_smoothing must be in \\[0, 1\\], got 1.5"):
        linear_cross_entropy(x, w, t, label_smoothing=1.5)
    with pytest.raises(ValueError, match="softcap must be None or a positive"):
        linear_cross_entropy(x, w, t, softcap=-1.0)
    with pytest.raises(ValueError, match="z_loss must be a finite number >= 0, got -1"):
        linear_cross_entropy(x, w, t, z_loss=-1.0)
    with pytest.raises(ValueError, match="num_items_in_batch divides the 'mean'"):
        linear_cross_entropy(x, w, t, reduction="sum", num_items_in_batch=3)
    with pytest.raises(ValueError, match=r"linear_weight must be \(vocab, 4\)"):
        linear_cross_entropy(x, w[:, :3], t)
    with pytest.raises(ValueError, match=r"linear_bias must be \(7,\)"):
        linear_cross_entropy(x, w, t, linear_bias=b[:3])
    with pytest.raises(TypeError, match="linear_weight must have input's dtype float32"):
        linear_cross_entropy(x, w.double(), t)
    with pytest.raises(TypeError, match="target must be an integer tensor"):
        linear_cross_entropy(x, w, t.float())
    bad = t.clone()
    bad[2] = 7
    with pytest.raises(ValueError, match=r"target must be in \[0, 7\) or ignore_index, got 7"):
        linear_cross_entropy(x.detach(), w.detach(), bad)


MEMORY_SCRIPT = """
import resource, torch
from fusedlayers.torch import linear_cross_entropy
torch.manual_seed(0)
n, h, v = 4096, 16, 65536
x = torch.randn(n, h, requires_grad=True)
w = torch.randn(v, h, requires_grad=True)
t = torch.randint(0, v, (n,))
linear_cross_entropy(x[:8], w, t[:8]).backward()  # load the library, warm the allocator
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
linear_cross_entropy(x, w, t).backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def test_cpu_peak_memory_stays_far_below_the_logits():
    grown = int(subprocess.run([sys.executable, "-c", MEMORY_SCRIPT], capture_output=True,
                               text=True, check=True).stdout.split()[-1])
    logits = 4096 * 65536 * 4  # one N x V float32 buffer: 1 GiB
    # one chunk of 256 rows (64 MiB) and dW (4 MiB) are what the op adds
    assert grown < logits / 4, f"peak RSS grew by {grown / 2**20:.0f} MiB"


def test_backward_allocates_no_second_weight_gradient():
    """The backward of 'mean' scales the gradients the forward formed, in place: it allocates
    nothing of dW's size (a zero gradient of the op's dW output, or a scaled copy, would be)."""
    from torch.profiler import ProfilerActivity, profile
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(4096, 32, requires_grad=True)
    loss = linear_cross_entropy(x, w, torch.randint(0, 4096, (64,)))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss.backward()
    allocated = sum(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)
    assert allocated < w.numel() * 4 / 2, allocated


@pytest.mark.parametrize("grads", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_decomposition_returns_what_the_operator_returns(grads, reduction):
    # ONNX export and fake-tensor tracing read it: loss and gradients as the operator's
    from fusedlayers.torch.linear_cross_entropy import EXPORT_DECOMPOSITIONS
    x, w, b, t = (a.detach() for a in _problem(700, 11, 23, torch.float64, "cpu", True))
    args = (x, w, b, t, None, reduction, -100, 0.1, 2.0, 1e-3, grads and reduction != "none")
    got = EXPORT_DECOMPOSITIONS["linear_cross_entropy"](*args)
    want = torch.ops.fusedlayers.linear_cross_entropy.default(*args)
    for g, r in zip(got, want):
        assert g.shape == r.shape and rel_err(g, r) <= 1e-12
