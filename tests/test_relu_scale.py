"""relu_scale: y = max(x, 0) * alpha, forward and backward bit-identical to the unfused
torch.relu(x) * alpha (fusedlayers.reference.relu_scale), for every dtype and layout."""

import math

import numpy as np
import pytest
import torch

import fusedlayers
import fusedlayers.torch  # noqa: F401  (registers the ops' autograd and fake kernels)
from fusedlayers import reference
from _helpers import ALL_DTYPES, as_layout, assert_bitwise, leaf_shape

ALPHAS = (1.0, 0.5, 3.7, 1 / 3, -2.25, 0.0, -0.0, 1e-30, 7e10)


def fused_and_ref(x_leaf, view, alpha, grad_out=None):
    """Forward (and backward when grad_out is given) of fused and unfused on the same view."""
    x_ref = x_leaf.detach().clone().requires_grad_(x_leaf.requires_grad)
    y = fusedlayers.relu_scale(view(x_leaf), alpha)
    y_ref = reference.relu_scale(view(x_ref), alpha)
    if grad_out is None:
        return y, y_ref, None, None
    (dx,) = torch.autograd.grad(y, x_leaf, grad_out)
    (dx_ref,) = torch.autograd.grad(y_ref, x_ref, grad_out)
    return y, y_ref, dx, dx_ref


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("alpha", ALPHAS)
def test_bitwise_forward_backward(dtype, alpha):
    # Enough elements to be split over threads (the kernel's grain is 32768).
    x = (torch.randn(3, 40001, dtype=torch.float64) * 4).to(dtype).requires_grad_()
    g = torch.randn(3, 40001, dtype=torch.float64).to(dtype)
    y, y_ref, dx, dx_ref = fused_and_ref(x, lambda t: t, alpha, g)
    assert y.is_contiguous()
    assert_bitwise(y, y_ref)
    assert_bitwise(dx, dx_ref)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("alpha", (1.0, 0.3, -1.5, 0.0))
def test_nan_inf(dtype, alpha):
    specials = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, 2.0, -math.nan],
                            dtype=dtype)
    x = torch.cat([specials, torch.randn(1000, dtype=dtype)])[torch.randperm(1008)]
    x.requires_grad_()
    g = torch.randn(1008, dtype=dtype)
    g[torch.randint(0, 1008, (50,))] = math.nan  # NaN gradients must travel the same way too
    y, y_ref, dx, dx_ref = fused_and_ref(x, lambda t: t, alpha, g)
    assert_bitwise(y, y_ref)
    assert_bitwise(dx, dx_ref)
    nan_in = torch.isnan(x.detach())
    assert torch.isnan(y[nan_in]).all(), "NaN input must stay NaN"
    # The gradient passes through NaN inputs (threshold_backward's `x <= 0` is false).
    assert_bitwise(dx[nan_in], (g * alpha)[nan_in])


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", [(0,), (3, 0, 4), (0, 5), ()])
def test_empty_and_scalar(dtype, shape):
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    g = torch.randn(shape, dtype=dtype)
    y, y_ref, dx, dx_ref = fused_and_ref(x, lambda t: t, 1.5, g)
    assert y.shape == x.shape and dx.shape == x.shape
    assert_bitwise(y, y_ref)
    assert_bitwise(dx, dx_ref)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("layout", ("transposed", "sliced", "expanded"))
def test_non_contiguous(dtype, layout):
    shape = (37, 129)
    x = torch.randn(leaf_shape(shape, layout), dtype=dtype, requires_grad=True)
    view = lambda t: as_layout(t, shape, layout)  # noqa: E731
    assert not view(x).is_contiguous()
    g = torch.randn(shape, dtype=dtype)
    y, y_ref, dx, dx_ref = fused_and_ref(x, view, -0.75, g)
    assert y.is_contiguous()
    assert_bitwise(y, y_ref)
    # For 'expanded' the leaf gradient sums the rows: the same summation order in both.
    assert_bitwise(dx, dx_ref)


def test_channels_last_and_negative_strides():
    x = torch.randn(2, 3, 5, 7).to(memory_format=torch.channels_last)
    assert_bitwise(fusedlayers.relu_scale(x, 2.0), reference.relu_scale(x, 2.0))
    x = torch.randn(6, 11)[1:5, 2:9:3]
    assert_bitwise(fusedlayers.relu_scale(x, 2.0), reference.relu_scale(x, 2.0))


def test_layer_matches_reference_module():
    from fusedlayers.torch import FusedReLUScale
    x = torch.randn(4, 9, requires_grad=True)
    y = FusedReLUScale(0.25)(x)
    assert_bitwise(y, reference.ReLUScale(0.25)(x))


def test_does_not_modify_input():
    x = torch.randn(100)
    before = x.clone()
    fusedlayers.relu_scale(x, 2.0)
    assert torch.equal(x, before)


def test_gradcheck():
    x = torch.randn(5, 7, dtype=torch.float64)
    x = (x + x.sign() * 0.05).requires_grad_()  # keep away from the kink at 0
    assert torch.autograd.gradcheck(lambda t: fusedlayers.relu_scale(t, -1.3), (x,))
    assert torch.autograd.gradcheck(lambda t: fusedlayers.relu_scale(t, 2.5), (x.t(),))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_opcheck(dtype):
    x = torch.randn(8, 5, dtype=dtype, requires_grad=True)
    torch.library.opcheck(torch.ops.fusedlayers.relu_scale.default, (x, 1.5))
    torch.library.opcheck(torch.ops.fusedlayers.relu_scale.default, (x.detach().t(), -0.5))
    torch.library.opcheck(torch.ops.fusedlayers.relu_scale_with_mask.default, (x.detach(), 1.5))
    _, mask = torch.ops.fusedlayers.relu_scale_with_mask(x.detach(), 1.5)
    g = torch.randn(8, 5, dtype=dtype)
    torch.library.opcheck(torch.ops.fusedlayers.relu_scale_backward.default, (g, mask, 1.5))
    torch.library.opcheck(torch.ops.fusedlayers.relu_scale_backward.default, (g.t(), mask, 0.5))


def packed_mask(x: torch.Tensor) -> torch.Tensor:
    """csrc/relu_scale.h's layout, from numpy: bits of (x > 0 or NaN), little-endian, zero-padded
    to whole 32-bit words."""
    keep = ~(x.detach().reshape(-1).double() <= 0)
    packed = np.packbits(keep.numpy(), bitorder="little")
    words = np.zeros(4 * ((x.numel() + 31) // 32), dtype=np.uint8)
    words[:packed.size] = packed
    return torch.from_numpy(words.view(np.int32))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("n", (0, 1, 31, 32, 33, 1000, 70001))
def test_mask_layout(dtype, n):
    x = torch.randn(n, dtype=torch.float64).to(dtype)
    x[torch.randint(0, max(n, 1), (n // 10,))] = torch.tensor(
        [math.nan, -0.0, 0.0, math.inf, -math.inf], dtype=dtype)[torch.randint(0, 5, (1,))]
    y, mask = torch.ops.fusedlayers.relu_scale_with_mask(x, 1.5)
    assert mask.dtype == torch.int32 and mask.shape == ((n + 31) // 32,)
    assert torch.equal(mask, packed_mask(x))
    assert_bitwise(y, fusedlayers.relu_scale(x, 1.5))


def test_autograd_saves_only_the_mask():
    x = torch.randn(4, 1001, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = fusedlayers.relu_scale(x, 2.0)
    assert [(t.dtype, t.shape) for t in saved] == [(torch.int32, ((x.numel() + 31) // 32,))]
    assert torch.equal(saved[0], packed_mask(x))
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert_bitwise(dx, (x > 0).float() * 2.0)


def test_backward_rejects_a_wrong_mask():
    g = torch.randn(5, 40)
    mask = torch.ops.fusedlayers.relu_scale_with_mask(torch.randn(5, 40), 1.0)[1]
    with pytest.raises(ValueError, match=r"mask must have shape \[7\] for grad_out of 200 "
                                         r"elements, got \[6\]"):
        torch.ops.fusedlayers.relu_scale_backward(g, mask[:6], 1.0)
    with pytest.raises(TypeError, match=r"mask must be int32 \(packed bits\), got Long"):
        torch.ops.fusedlayers.relu_scale_backward(g, mask.long(), 1.0)
