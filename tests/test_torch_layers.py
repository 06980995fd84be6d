"""The torch.nn modules: drop-in for nn.Linear + nn.GELU, nn.LayerNorm and relu * alpha
(parameters, initialisation, state_dict, checkpoints), torch.compile without graph breaks, and
the autocast policy (backends/torch/<op>.cpp): linear_gelu in the autocast dtype as F.linear,
layer_norm with the dtype F.layer_norm gives, relu_scale in the input dtype."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusedlayers.torch import reference
from fusedlayers.torch import FusedLinearGELU, FusedReLUScale, LayerNorm, UnfusedReLUScale
from _helpers import assert_bitwise, rel_err


def param_summary(module):
    return [(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters()]


# ---------------------------------------------------------------- FusedLinearGELU

@pytest.mark.parametrize("bias", (True, False))
@pytest.mark.parametrize("dtype", (None, torch.float64, torch.bfloat16))
def test_linear_gelu_parameters_and_init_match_nn_linear(bias, dtype, seed):
    torch.manual_seed(seed)
    linear = nn.Linear(13, 7, bias=bias, dtype=dtype)
    torch.manual_seed(seed)
    fused = FusedLinearGELU(13, 7, bias=bias, dtype=dtype)
    assert param_summary(fused) == param_summary(linear)
    assert list(fused.state_dict()) == list(linear.state_dict())
    assert (fused.in_features, fused.out_features) == (13, 7)
    for a, r in zip(fused.parameters(), linear.parameters()):
        assert_bitwise(a.detach(), r.detach())  # same values under the same seed


@pytest.mark.parametrize("approximate", ("none", "tanh"))
@pytest.mark.parametrize("bias", (True, False))
def test_linear_gelu_loads_nn_linear_checkpoint(approximate, bias):
    unfused = nn.Sequential(nn.Linear(10, 6, bias=bias), nn.GELU(approximate=approximate))
    fused = FusedLinearGELU(10, 6, bias=bias, approximate=approximate)
    fused.load_state_dict(unfused[0].state_dict())  # strict: same keys and shapes
    x = torch.randn(3, 4, 10, requires_grad=True)
    y, y_ref = fused(x), unfused(x)
    assert rel_err(y, y_ref) <= 1e-6
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *fused.parameters()], g)
    want = torch.autograd.grad(y_ref, [x, *unfused.parameters()], g)
    for a, r in zip(got, want):
        assert rel_err(a, r) <= 1e-5
    # and back: an nn.Linear loads the fused layer's state_dict
    nn.Linear(10, 6, bias=bias).load_state_dict(fused.state_dict())


@pytest.mark.parametrize("bias", (True, False))
def test_from_linear_shares_parameters(bias):
    linear = nn.Linear(8, 5, bias=bias)
    fused = FusedLinearGELU.from_linear(linear, approximate="tanh")
    assert fused.weight is linear.weight and fused.bias is linear.bias
    assert fused.approximate == "tanh" and fused.weight.device.type == "cpu"
    x = torch.randn(6, 8)
    assert rel_err(fused(x), F.gelu(linear(x), approximate="tanh")) <= 1e-6
    fused(x).sum().backward()
    assert linear.weight.grad is not None and linear.weight.grad.abs().sum() > 0
    with torch.no_grad():
        linear.weight.mul_(2)
    assert rel_err(fused(x), F.gelu(linear(x), approximate="tanh")) <= 1e-6


def test_linear_gelu_module_rejects_bad_approximate():
    with pytest.raises(ValueError, match=r"approximate must be 'none' or 'tanh', got 'erf'"):
        FusedLinearGELU(4, 4, approximate="erf")


def test_linear_gelu_module_float64():
    fused = FusedLinearGELU(9, 4, dtype=torch.float64)
    x = torch.randn(5, 9, dtype=torch.float64)
    assert rel_err(fused(x), F.gelu(F.linear(x, fused.weight, fused.bias))) <= 1e-12


# ---------------------------------------------------------------- LayerNorm

LN_CONFIGS = [
    dict(normalized_shape=16),
    dict(normalized_shape=(16,), eps=1e-3),
    dict(normalized_shape=(6, 10)),
    dict(normalized_shape=[5, 3, 2]),
    dict(normalized_shape=16, elementwise_affine=False),
    dict(normalized_shape=(6, 10), bias=False),
    dict(normalized_shape=16, elementwise_affine=False, bias=False),
]


def ln_input_shape(cfg):
    n = cfg["normalized_shape"]
    return (4, 3, *((n,) if isinstance(n, int) else n))


@pytest.mark.parametrize("cfg", LN_CONFIGS, ids=str)
@pytest.mark.parametrize("dtype", (None, torch.float64))
def test_layer_norm_parameters_and_init_match_nn(cfg, dtype):
    ref = nn.LayerNorm(**cfg, dtype=dtype)
    ours = LayerNorm(**cfg, dtype=dtype)
    assert param_summary(ours) == param_summary(ref)
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert ours.normalized_shape == ref.normalized_shape
    assert ours.eps == ref.eps and ours.elementwise_affine == ref.elementwise_affine
    for a, r in zip(ours.parameters(), ref.parameters()):
        assert_bitwise(a.detach(), r.detach())


@pytest.mark.parametrize("cfg", LN_CONFIGS, ids=str)
@pytest.mark.parametrize("memory_efficient", (False, True))
def test_layer_norm_loads_nn_checkpoint(cfg, memory_efficient):
    ref = nn.LayerNorm(**cfg)
    with torch.no_grad():  # non-trivial parameters (away from 0 for memory_efficient)
        for p in ref.parameters():
            p.copy_((torch.rand_like(p) + 0.5) * torch.randn_like(p).sign())
    ours = LayerNorm(**cfg, memory_efficient=memory_efficient)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(ln_input_shape(cfg), requires_grad=True)
    y, y_ref = ours(x), ref(x)
    assert rel_err(y, y_ref) <= 1e-5
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *ours.parameters()], g)
    want = torch.autograd.grad(y_ref, [x, *ref.parameters()], g)
    for a, r in zip(got, want):
        assert rel_err(a, r) <= 1e-5
    nn.LayerNorm(**cfg).load_state_dict(ours.state_dict())


def test_layer_norm_default_eps_matches_nn():
    assert LayerNorm(8).eps == nn.LayerNorm(8).eps


# ---------------------------------------------------------------- FusedReLUScale

@pytest.mark.parametrize("alpha", (1.0, 0.5, -3.0))
def test_relu_scale_module(alpha):
    m = FusedReLUScale(alpha)
    assert list(m.parameters()) == [] and m.state_dict() == {}
    assert m.alpha == alpha and repr(alpha) in repr(m)
    x = torch.randn(7, 9, requires_grad=True)
    y = m(x)
    assert_bitwise(y, UnfusedReLUScale(alpha)(x))
    assert FusedReLUScale().alpha == 1.0


# ---------------------------------------------------------------- torch.compile

def test_compile_fullgraph_matches_eager():
    # fullgraph=True fails on any graph break; dynamic=True sends symbolic sizes through the
    # SymInt[] schemas and the fake kernels; a second shape must reuse the graph. Compiled, the
    # fused ops lower to aten math that rounds elsewhere (fusedlayers/torch/inductor.py), so the
    # compiled and the eager outputs and gradients are each judged against the float64 model:
    # within 4e-6 relative (~30 float32 ulps; 24 seeds x shapes gave at most 8.1e-7, and
    # elementwise tolerances failed on a dweight sum that cancels). A wiring mistake is O(1).
    torch._dynamo.reset()
    model = nn.Sequential(FusedLinearGELU(12, 24, approximate="tanh"), LayerNorm(24),
                          FusedReLUScale(0.5), FusedLinearGELU(24, 8),
                          LayerNorm((8,), bias=False, memory_efficient=True))
    with torch.no_grad():
        model[4].weight.uniform_(0.5, 1.5)
    model64 = copy.deepcopy(model).double()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)

    def run(fn, module, x, g):
        x = x.clone().requires_grad_()
        y = fn(x)
        return [y.detach(), *torch.autograd.grad(y, [x, *module.parameters()], g)]

    frames = None
    for shape in ((5, 7, 12), (3, 2, 12)):
        x, g = torch.randn(shape), torch.randn(*shape[:-1], 8)
        ref = run(model64, model64, x.double(), g.double())
        for what, fn in (("eager", model), ("compiled", compiled)):
            for name, a, r in zip(["y", "dx", *dict(model.named_parameters())],
                                  run(fn, model, x, g), ref):
                assert a.dtype == torch.float32 and a.shape == r.shape
                assert rel_err(a, r) <= 4e-6, f"{what} {name} {shape}: {rel_err(a, r):.2e}"
        if frames is None:
            frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames, "recompiled"


# ---------------------------------------------------------------- autocast

@pytest.mark.parametrize("x_dtype", (torch.float32, torch.bfloat16))
def test_autocast_linear_gelu_runs_in_autocast_dtype(x_dtype):
    lin = nn.Linear(16, 8)
    fused = FusedLinearGELU.from_linear(lin)
    x = torch.randn(4, 16).to(x_dtype).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fused(x)
        y_ref = F.gelu(lin(x))
    assert y.dtype == y_ref.dtype == torch.bfloat16
    assert rel_err(y, y_ref) <= 1e-2
    y.float().sum().backward()
    assert lin.weight.grad.dtype == torch.float32 and x.grad.dtype == x_dtype


@pytest.mark.parametrize("x_dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("affine", (True, False))
def test_autocast_layer_norm_dtype_matches_f_layer_norm(x_dtype, affine):
    # x in bfloat16 is what a model feeds a LayerNorm under autocast: the output of a Linear.
    ln = nn.LayerNorm(16, elementwise_affine=affine)
    ours = LayerNorm(16, elementwise_affine=affine)
    x = torch.randn(4, 16).to(x_dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_ref = ours(x), ln(x)
    assert y.dtype == y_ref.dtype, (f"under autocast, F.layer_norm on {x_dtype} returns "
                                    f"{y_ref.dtype}, fused layer_norm {y.dtype}")
    assert rel_err(y, y_ref) <= 1e-2


@pytest.mark.parametrize("module", ("linear_gelu", "layer_norm", "relu_scale"))
def test_autocast_keeps_float64(module):
    """Autocast casts only float32/16-bit tensors, as for the native ops: float64 stays."""
    x = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    fused, unfused = {
        "linear_gelu": lambda: (FusedLinearGELU(16, 8, dtype=torch.float64),
                                lambda m, x: F.gelu(F.linear(x, m.weight, m.bias))),
        "layer_norm": lambda: (LayerNorm(16, dtype=torch.float64),
                               lambda m, x: F.layer_norm(x, (16,), m.weight, m.bias)),
        "relu_scale": lambda: (FusedReLUScale(1.0), lambda m, x: torch.relu(x)),
    }[module]()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_ref = fused(x), unfused(fused, x)
    assert y.dtype == y_ref.dtype == torch.float64
    assert rel_err(y, y_ref) <= 1e-12


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """The ops that run below autograd."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", ("no_grad", "no_requires_grad", "grad"))
def test_forward_writes_what_the_backward_needs_only(case):
    """Without a backward to feed, linear_gelu writes no pre-activation and relu_scale no
    mask; with one, they do."""
    fused, relu = FusedLinearGELU(16, 8), FusedReLUScale(2.0)
    x = torch.randn(4, 16, requires_grad=case != "no_requires_grad")
    if case == "no_requires_grad":
        fused.requires_grad_(False)
    log = _OpLog()
    with log, torch.set_grad_enabled(case != "no_grad"):
        relu(fused(x))
    saved = case == "grad"
    assert ("fusedlayers.linear_gelu_with_pre" in log.ops) == saved, log.ops
    assert ("fusedlayers.linear_gelu" in log.ops) != saved, log.ops
    assert ("fusedlayers.relu_scale_with_mask" in log.ops) == saved, log.ops


@pytest.mark.parametrize("module", ("linear_gelu", "layer_norm", "relu_scale"))
def test_second_derivative_raises(module):
    """The backward ops have no derivative: create_graph=True then differentiating again raises
    instead of returning a silently wrong (zero) second derivative."""
    m = {"linear_gelu": FusedLinearGELU(6, 5), "layer_norm": LayerNorm(6),
         "relu_scale": FusedReLUScale(2.0)}[module]
    x = torch.randn(3, 6, requires_grad=True)
    (g,) = torch.autograd.grad(m(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="not implemented"):
        g.sum().backward()


def test_autocast_relu_scale_keeps_dtype():
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = FusedReLUScale(2.0)(x)
        y_ref = torch.relu(x) * 2.0
    assert y.dtype == y_ref.dtype == torch.float32
    assert_bitwise(y, y_ref)
