"""Bad input raises a clear error (DESIGN.md, "Bad input"): ValueError/TypeError naming the
argument and the expected vs received value; nothing silently wrong."""

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fusedlayers
from fusedlayers.torch import FusedLinearGELU, LayerNorm


def x37(requires_grad=False):
    return torch.randn(3, 7, requires_grad=requires_grad)


# ---------------------------------------------------------------- layer_norm

@pytest.mark.parametrize("requires_grad", (False, True))
@pytest.mark.parametrize("normalized_shape,match", [
    (8, r"layer_norm: the last 1 dimension\(s\) of input must equal normalized_shape \[8\], "
        r"got input of shape \[3, 7\]"),
    ((3, 8), r"last 2 dimension\(s\) of input must equal normalized_shape \[3, 8\], "
             r"got input of shape \[3, 7\]"),
    ((2, 3, 7), r"normalized_shape \[2, 3, 7\], got input of shape \[3, 7\]"),
    ([], r"normalized_shape must not be empty"),
])
def test_layer_norm_wrong_trailing_shape(normalized_shape, match, requires_grad):
    with pytest.raises(ValueError, match=match):
        fusedlayers.layer_norm(x37(requires_grad), normalized_shape)


C10_NAME = {torch.int64: "Long", torch.int32: "Int", torch.bool: "Bool", torch.int8: "Char",
            torch.uint8: "Byte", torch.complex64: "ComplexFloat"}


@pytest.mark.parametrize("dtype", (torch.int64, torch.int32, torch.bool, torch.complex64))
def test_layer_norm_non_float_input(dtype):
    with pytest.raises(TypeError, match=r"layer_norm: input must be float32, float64, float16 or "
                                        rf"bfloat16, got {C10_NAME[dtype]}"):
        fusedlayers.layer_norm(torch.ones(3, 7, dtype=dtype), 7)


@pytest.mark.parametrize("arg", ("weight", "bias"))
@pytest.mark.parametrize("shape", ((6,), (7, 1), (1, 7)))
def test_layer_norm_param_shape(arg, shape):
    kwargs = {arg: torch.ones(shape)}
    got = re.escape(str(list(shape)))
    with pytest.raises(ValueError, match=rf"layer_norm: {arg} must have shape normalized_shape "
                                         rf"\[7\], got {got}"):
        fusedlayers.layer_norm(x37(), 7, **kwargs)


@pytest.mark.parametrize("x_dtype,w_dtype,b_dtype,match", [
    (torch.float32, torch.float64, None, r"weight must have input's dtype Float, got Double"),
    (torch.float32, None, torch.float16, r"bias must have input's dtype Float, got Half"),
    (torch.float32, torch.int32, None, r"weight must have input's dtype Float, got Int"),
    (torch.float64, torch.float32, None, r"weight must have input's dtype Double, got Float"),
    (torch.bfloat16, torch.float16, None,
     r"weight must have input's dtype BFloat16 or float32, got Half"),
    (torch.bfloat16, torch.float32, torch.bfloat16,
     r"weight and bias must share a dtype, got Float and BFloat16"),
])
def test_layer_norm_param_dtype(x_dtype, w_dtype, b_dtype, match):
    w = None if w_dtype is None else torch.ones(7, dtype=w_dtype)
    b = None if b_dtype is None else torch.zeros(7, dtype=b_dtype)
    with pytest.raises(TypeError, match=match):
        fusedlayers.layer_norm(x37().to(x_dtype), 7, w, b)


@pytest.mark.parametrize("eps", (math.nan, math.inf, -math.inf, -1e-5))
def test_layer_norm_bad_eps(eps):
    with pytest.raises(ValueError, match=rf"layer_norm: eps must be finite and >= 0, got "
                                         rf"{re.escape(str(eps))}"):
        fusedlayers.layer_norm(x37(), 7, eps=eps)
    with pytest.raises(ValueError, match=r"eps must be finite"):
        LayerNorm(7, eps=eps)(x37())


# ---------------------------------------------------------------- linear_gelu

@pytest.mark.parametrize("requires_grad", (False, True))
def test_linear_gelu_wrong_last_dimension(requires_grad):
    w = torch.randn(5, 8, requires_grad=requires_grad)
    with pytest.raises(ValueError, match=r"linear_gelu: the last dimension of input must equal "
                                         r"in_features = weight.shape\[1\] = 8, got input of "
                                         r"shape \[3, 7\]"):
        fusedlayers.linear_gelu(x37(requires_grad), w)
    with pytest.raises(ValueError, match=r"in_features = weight.shape\[1\] = 8"):
        FusedLinearGELU(8, 5)(x37())


@pytest.mark.parametrize("dtype", (torch.int64, torch.int8, torch.bool))
def test_linear_gelu_non_float_input(dtype):
    with pytest.raises(TypeError, match=r"linear_gelu: input must be float32, float64, float16 "
                                        rf"or bfloat16, got {C10_NAME[dtype]}"):
        fusedlayers.linear_gelu(torch.ones(3, 7, dtype=dtype), torch.ones(5, 7, dtype=dtype))


@pytest.mark.parametrize("w_dtype,b_dtype,match", [
    (torch.float64, None, r"weight must have input's dtype Float, got Double"),
    (torch.int64, None, r"weight must have input's dtype Float, got Long"),
    (torch.bfloat16, None, r"weight must have input's dtype Float, got BFloat16"),
    (torch.float32, torch.float64, r"bias must have input's dtype Float, got Double"),
])
def test_linear_gelu_dtype_mismatch(w_dtype, b_dtype, match):
    b = None if b_dtype is None else torch.zeros(5, dtype=b_dtype)
    with pytest.raises(TypeError, match=r"linear_gelu: " + match):
        fusedlayers.linear_gelu(x37(), torch.ones(5, 7, dtype=w_dtype), b)


@pytest.mark.parametrize("shape", ((7,), (1, 5, 7), ()))
def test_linear_gelu_weight_not_2d(shape):
    got = re.escape(str(list(shape)))
    with pytest.raises(ValueError, match=rf"weight must be 2-D \(out_features, in_features\), "
                                         rf"got shape {got}"):
        fusedlayers.linear_gelu(x37(), torch.ones(shape))


@pytest.mark.parametrize("shape", ((4,), (1, 5), (6,)))
def test_linear_gelu_bias_shape(shape):
    got = re.escape(str(list(shape)))
    with pytest.raises(ValueError, match=rf"bias must have shape \(out_features,\) = \(5,\), "
                                         rf"got {got}"):
        fusedlayers.linear_gelu(x37(), torch.ones(5, 7), torch.ones(shape))


@pytest.mark.parametrize("approximate", ("foo", "erf", "", "None", "TANH"))
def test_linear_gelu_bad_approximate(approximate):
    with pytest.raises(ValueError, match=rf"linear_gelu: approximate must be 'none' or 'tanh', "
                                         rf"got '{approximate}'"):
        fusedlayers.linear_gelu(x37(), torch.ones(5, 7), None, approximate)


# ---------------------------------------------------------------- relu_scale

@pytest.mark.parametrize("alpha", (math.nan, math.inf, -math.inf))
def test_relu_scale_non_finite_alpha(alpha):
    with pytest.raises(ValueError, match=rf"relu_scale: alpha must be finite, got "
                                         rf"{re.escape(str(alpha))}"):
        fusedlayers.relu_scale(x37(), alpha)


@pytest.mark.parametrize("dtype", (torch.int32, torch.uint8, torch.bool, torch.complex64))
def test_relu_scale_non_float(dtype):
    with pytest.raises(TypeError, match=r"relu_scale: x must be float32, float64, float16 or "
                                        rf"bfloat16, got {C10_NAME[dtype]}"):
        fusedlayers.relu_scale(torch.ones(3, dtype=dtype), 1.0)


@pytest.mark.parametrize("fn", ("relu_scale", "linear_gelu", "layer_norm"))
@pytest.mark.parametrize("x", ([1.0, 2.0], np.ones(3, dtype=np.float32), 3.0), ids=("list",
                                                                                    "ndarray",
                                                                                    "float"))
def test_not_a_tensor(fn, x):
    args = {"relu_scale": (1.0,), "linear_gelu": (torch.ones(2, 2),), "layer_norm": (2,)}[fn]
    with pytest.raises(TypeError, match=rf"fusedlayers.{fn}: x must be a torch.Tensor.*got "
                                        rf"{re.escape(type(x).__module__)}"):
        getattr(fusedlayers, fn)(x, *args)


# ---------------------------------------------------------------- devices
# One CPU-only machine: the 'meta' device stands in for a second device. A tensor on another
# device must give a ValueError naming the argument and both devices (as the other checks do),
# not run the meta (fake) kernel and return uninitialized CPU memory.

def device_error(fn, arg):
    with pytest.raises(ValueError, match=rf"{arg}.*same device") as info:
        out = fn()
        pytest.fail(f"no error: returned a {out.device} tensor of shape {tuple(out.shape)}")
    assert "cpu" in str(info.value) and "meta" in str(info.value), str(info.value)


@pytest.mark.parametrize("arg", ("weight", "bias"))
def test_layer_norm_param_on_other_device(arg):
    kwargs = {arg: torch.ones(7, device="meta")}
    device_error(lambda: fusedlayers.layer_norm(x37(), 7, **kwargs), arg)


@pytest.mark.parametrize("arg", ("weight", "bias"))
def test_linear_gelu_param_on_other_device(arg):
    kwargs = {"weight": torch.ones(5, 7), "bias": torch.ones(5)}
    kwargs[arg] = kwargs[arg].to("meta")
    device_error(lambda: fusedlayers.linear_gelu(x37(), **kwargs), arg)


def test_module_on_other_device():
    device_error(lambda: LayerNorm(7, device="meta")(x37()), "weight")
    device_error(lambda: FusedLinearGELU(7, 5, device="meta")(x37()), "weight")


@pytest.mark.parametrize("fn", ("linear_gelu", "layer_norm"))
def test_input_on_other_device_than_params(fn):
    x = x37().to("meta")
    if fn == "linear_gelu":
        device_error(lambda: fusedlayers.linear_gelu(x, torch.ones(5, 7)), "weight")
    else:
        device_error(lambda: fusedlayers.layer_norm(x, 7, torch.ones(7)), "weight")


def test_all_on_meta_gives_shapes_like_native():
    # Meta tensors (shape inference, deferred init) work with the unfused ops; same here.
    x, w = torch.empty(3, 7, device="meta"), torch.empty(5, 7, device="meta")
    assert fusedlayers.relu_scale(x, 2.0).device.type == "meta"
    _, mean, rstd = torch.ops.fusedlayers.layer_norm(x, [7], None, None, 1e-5)
    assert mean.shape == rstd.shape == (3,) and mean.dtype == torch.float32
    y = fusedlayers.linear_gelu(x, w)
    assert y.device.type == "meta" and y.shape == F.linear(x, w).shape
    y = fusedlayers.layer_norm(x, 7, torch.empty(7, device="meta"))
    assert y.device.type == "meta" and y.shape == F.layer_norm(x, (7,)).shape
