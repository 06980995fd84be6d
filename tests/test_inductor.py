"""How Inductor lowers the fusedlayers ops (fusedlayers/torch/inductor.py): each decomposition
returns what the op returns, a model compiled by Inductor runs none of our kernels and matches
eager, and the table is filled whichever module is imported first."""

import subprocess
import sys

import pytest
import torch
from _helpers import DEVICES, as_layout, assert_bitwise, leaf_shape, rel_err
from torch import nn
from torch._inductor.utils import run_and_get_code

import fusedlayers.torch as flt
from fusedlayers.torch import inductor, layer_norm_trailing

fl = torch.ops.fusedlayers


def skip_cuda_float64(device, dtype):
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("the norms and linear_gelu have no float64 CUDA kernels")


def decomposed(name, *args):
    return inductor.decompositions()[name](*args)


def close(a, ref, dtype, what, terms=1):
    """Two implementations of the same math rounded to dtype, summing up to `terms` products in
    another order: within a few ulps times sqrt(terms), in norm."""
    assert a.shape == ref.shape and a.dtype == ref.dtype, (what, a.shape, ref.shape, a.dtype)
    err = rel_err(a, ref)
    assert err <= 4 * torch.finfo(dtype).eps * terms**0.5, f"{what}: relative difference {err:.2e}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("alpha", [2.5, -0.75, 0.0])
def test_relu_scale_decomposition_is_bitwise(device, dtype, alpha):
    shape = (37, 45)  # 1665 elements: the last mask word is partial
    x = as_layout(torch.randn(leaf_shape(shape, "transposed"), device=device).to(dtype), shape,
                  "transposed")
    x[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    y, mask = fl.relu_scale_with_mask(x, alpha)
    y_d, mask_d = decomposed("relu_scale_with_mask", x, alpha)
    assert_bitwise(y_d, y)
    assert torch.equal(mask_d, mask) and (mask.to(torch.int64) >= 2**31).any()  # bit 31 set
    assert_bitwise(decomposed("relu_scale", x, alpha), fl.relu_scale(x, alpha))
    dy = torch.randn(shape, device=device, dtype=dtype)
    dy[1, :2] = float("nan")
    assert_bitwise(decomposed("relu_scale_backward", dy, mask, alpha),
                   fl.relu_scale_backward(dy, mask, alpha))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,param_dtype", [(torch.float32, torch.float32),
                                               (torch.float64, torch.float64),
                                               (torch.bfloat16, torch.bfloat16),
                                               (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("normalized_shape", [(67,), (3, 29)])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("mode", ["standard", "memory_efficient", "rms_scaling"])
def test_layer_norm_decomposition(device, dtype, param_dtype, normalized_shape, affine, mode):
    skip_cuda_float64(device, dtype)
    shape = (5, 7, *normalized_shape)
    x = (torch.randn(shape, device=device) * 3 + 1).to(dtype).transpose(0, 1)
    # No zeros in gamma: memory_efficient recovers x_hat = (y - beta) / gamma.
    w = (torch.rand(normalized_shape, device=device, dtype=param_dtype) + 0.5) if affine else None
    b = (torch.randn(normalized_shape, device=device, dtype=param_dtype)
         if affine and mode != "rms_scaling" else None)  # rms_scaling adds no beta
    flags = (mode == "memory_efficient", mode == "rms_scaling")
    args = (x, list(normalized_shape), w, b, 1e-5, *flags)
    for got, ref, what in zip(decomposed("layer_norm", *args), fl.layer_norm(*args),
                              ("out", "mean", "rstd")):
        close(got, ref, dtype, what)
    out, mean, rstd = fl.layer_norm(*args)
    dy = torch.randn(x.shape, device=device, dtype=dtype)
    bargs = (dy, out if mode == "memory_efficient" else x, mean, rstd, list(normalized_shape), w,
             b, *flags)
    for got, ref, what in zip(decomposed("layer_norm_backward", *bargs),
                              fl.layer_norm_backward(*bargs), ("dx", "dgamma", "dbeta")):
        close(got, ref, dtype, what, terms=35)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,param_dtype", [(torch.float32, torch.float32),
                                               (torch.float64, torch.float64),
                                               (torch.bfloat16, torch.bfloat16),
                                               (torch.float16, torch.float32)])
@pytest.mark.parametrize("normalized_shape", [(67,), (3, 29)])
@pytest.mark.parametrize("gain", ["none", "weight", "zero_centered"])
def test_rms_norm_decomposition(device, dtype, param_dtype, normalized_shape, gain):
    skip_cuda_float64(device, dtype)
    shape = (5, 7, *normalized_shape)
    x = (torch.randn(shape, device=device) * 3 + 1).to(dtype).transpose(0, 1)
    w = (None if gain == "none"
         else torch.randn(normalized_shape, device=device).to(param_dtype))
    args = (x, list(normalized_shape), w, 1e-5, gain == "zero_centered")
    for got, ref, what in zip(decomposed("rms_norm", *args), fl.rms_norm(*args), ("out", "rstd")):
        close(got, ref, dtype, what)
    _, rstd = fl.rms_norm(*args)
    dy = torch.randn(x.shape, device=device, dtype=dtype)
    bargs = (dy, x, rstd, list(normalized_shape), w, gain == "zero_centered")
    for got, ref, what in zip(decomposed("rms_norm_backward", *bargs),
                              fl.rms_norm_backward(*bargs), ("dx", "dweight")):
        close(got, ref, dtype, what, terms=35)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("weight_layout", ["out_in", "in_out"])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("has_bias", [True, False])
def test_linear_gelu_decomposition(device, dtype, weight_layout, approximate, has_bias):
    skip_cuda_float64(device, dtype)
    x = torch.randn(2, 9, 33, device=device, dtype=dtype)
    w = (torch.randn(47, 33, device=device, dtype=dtype) if weight_layout == "out_in"
         else torch.randn(33, 47, device=device, dtype=dtype).t())  # GPT-2's Conv1D layout
    b = torch.randn(47, device=device, dtype=dtype) if has_bias else None
    close(decomposed("linear_gelu", x, w, b, approximate), fl.linear_gelu(x, w, b, approximate),
          dtype, "y", terms=33)
    y, pre = fl.linear_gelu_with_pre(x, w, b, approximate)
    for got, ref, what in zip(decomposed("linear_gelu_with_pre", x, w, b, approximate), (y, pre),
                              ("y", "pre")):
        close(got, ref, dtype, what, terms=33)
    dy = torch.randn(y.shape, device=device, dtype=dtype)
    bargs = (dy, x, w, pre, has_bias, approximate)
    got, ref = decomposed("linear_gelu_backward", *bargs), fl.linear_gelu_backward(*bargs)
    for g, r, what in zip(got, ref, ("dx", "dW", "db")):
        close(g, r, dtype, what, terms=47)
    assert got[1].stride() == ref[1].stride()  # dW in the weight's own layout


class Block(nn.Module):
    """A pre-norm MLP block with every fused op: LayerNorm, Linear+GELU, ReLU x alpha."""

    def __init__(self, width=67, hidden=91):
        super().__init__()
        self.norm = flt.LayerNorm(width)
        self.fc1 = flt.FusedLinearGELU(width, hidden)
        self.act = flt.FusedReLUScale(0.5)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x * 2.0))))


def compiled_step(module, x, dy):
    """(Inductor's generated code, output, input and parameter gradients) of one step."""
    compiled = torch.compile(module)

    def step():
        out = compiled(x)
        return out, torch.autograd.grad(out, [x, *module.parameters()], dy)

    # No cache: a cached graph from another decomposition table would hide what this one makes.
    with torch._inductor.config.patch(force_disable_caches=True):
        (out, grads), code = run_and_get_code(step)
    return "\n".join(code), out, grads


class RMSScaling(nn.Module):
    """Keras' LayerNormalization(rms_scaling=True) on torch tensors."""

    def __init__(self, width):
        super().__init__()
        self.gamma = nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, x):
        return layer_norm_trailing(x, 1, self.gamma, None, rms_scaling=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model", ["block", "memory_efficient", "rms_scaling", "rms_norm"])
def test_compiled_model_runs_inductor_kernels_and_matches_eager(model, device):
    torch._dynamo.reset()
    module = {"block": lambda: Block(),
              "memory_efficient": lambda: flt.LayerNorm(67, memory_efficient=True),
              "rms_scaling": lambda: RMSScaling(67),
              "rms_norm": lambda: flt.RMSNorm(67, zero_centered=True)}[model]().to(device)
    x = torch.randn(3, 11, 67, device=device, requires_grad=True)
    dy = torch.randn(3, 11, 67, device=device)
    code, out, grads = compiled_step(module, x, dy)
    assert "torch.ops.fusedlayers" not in code  # no extern call: all Inductor's kernels
    ref = module(x)
    ref_grads = torch.autograd.grad(ref, [x, *module.parameters()], dy)
    assert rel_err(out, ref) < 1e-5
    for g, r in zip(grads, ref_grads, strict=True):
        assert rel_err(g, r) < 1e-5


REGISTERED = ("import torch; from torch._inductor.decomposition import select_decomp_table; "
              "table = select_decomp_table(); "
              "assert all(getattr(torch.ops.fusedlayers, n).default in table "
              "for n in fusedlayers.torch.inductor.decompositions()), 'not registered'")


@pytest.mark.parametrize("order", ["fusedlayers first", "inductor first"])
def test_table_filled_whichever_is_imported_first(order):
    if order == "fusedlayers first":
        code = ("import sys, fusedlayers.torch; "
                "assert 'torch._inductor.decomposition' not in sys.modules, 'imported eagerly'; "
                + REGISTERED)
    else:  # Inductor's table already built and cached before fusedlayers loads
        code = ("from torch._inductor.decomposition import select_decomp_table; "
                "select_decomp_table(); import fusedlayers.torch; " + REGISTERED)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
