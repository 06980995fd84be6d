"""Bad input raises a clear error (docs/DESIGN.md, "Bad input"): ValueError/TypeError naming the
argument and the expected vs received value; nothing silently wrong."""

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fusedlayers
import fusedlayers.torch
from _helpers import (DEVICES, as_layout, assert_survives_subprocess, concurrent_mismatches,
                      leaf_shape)
from fusedlayers.torch import FusedLinearGELU, LayerNorm


def x37(requires_grad=False):
    return torch.randn(3, 7, requires_grad=requires_grad)


# ---------------------------------------------------------------- layer_norm

@pytest.mark.parametrize("requires_grad", (False, True))
@pytest.mark.parametrize("normalized_shape,match", [
    (8, r"layer_norm: the last 1 dimension\(s\) of x must equal normalized_shape \[8\], "
        r"got x of shape \[3, 7\]"),
    ((3, 8), r"last 2 dimension\(s\) of x must equal normalized_shape \[3, 8\], "
             r"got x of shape \[3, 7\]"),
    ((2, 3, 7), r"normalized_shape \[2, 3, 7\], got x of shape \[3, 7\]"),
    ([], r"normalized_shape must not be empty"),
])
def test_layer_norm_wrong_trailing_shape(normalized_shape, match, requires_grad):
    with pytest.raises(ValueError, match=match):
        fusedlayers.layer_norm(x37(requires_grad), normalized_shape)


C10_NAME = {torch.int64: "Long", torch.int32: "Int", torch.bool: "Bool", torch.int8: "Char",
            torch.uint8: "Byte", torch.complex64: "ComplexFloat"}


@pytest.mark.parametrize("dtype", (torch.int64, torch.int32, torch.bool, torch.complex64))
def test_layer_norm_non_float_input(dtype):
    with pytest.raises(TypeError, match=r"layer_norm: x must be float32, float64, float16 or "
                                        rf"bfloat16, got {C10_NAME[dtype]}"):
        fusedlayers.layer_norm(torch.ones(3, 7, dtype=dtype), 7)


@pytest.mark.parametrize("x_dtype,w_dtype,b_dtype,match", [
    (torch.float32, torch.float64, None, r"weight must have x's dtype float32, got float64"),
    (torch.float32, None, torch.float16, r"bias must have x's dtype float32, got float16"),
    (torch.float32, torch.int32, None,
     r"weight must be float32, float64, float16 or bfloat16, got Int"),
    (torch.float64, torch.float32, None, r"weight must have x's dtype float64, got float32"),
    (torch.bfloat16, torch.float16, None,
     r"weight must have x's dtype bfloat16 or float32, got float16"),
    (torch.bfloat16, torch.float32, torch.bfloat16,
     r"weight and bias must share a dtype, got float32 and bfloat16"),
])
def test_layer_norm_param_dtype(x_dtype, w_dtype, b_dtype, match):
    w = None if w_dtype is None else torch.ones(7, dtype=w_dtype)
    b = None if b_dtype is None else torch.zeros(7, dtype=b_dtype)
    with pytest.raises(TypeError, match=match):
        fusedlayers.layer_norm(x37().to(x_dtype), 7, w, b)


# ---------------------------------------------------------------- linear_gelu

@pytest.mark.parametrize("requires_grad", (False, True))
def test_linear_gelu_wrong_last_dimension(requires_grad):
    w = torch.randn(5, 8, requires_grad=requires_grad)
    with pytest.raises(ValueError, match=r"linear_gelu: the last dimension of x must equal "
                                         r"in_features = weight.shape\[1\] = 8, got x of "
                                         r"shape \[3, 7\]"):
        fusedlayers.linear_gelu(x37(requires_grad), w)
    with pytest.raises(ValueError, match=r"in_features = weight.shape\[1\] = 8"):
        FusedLinearGELU(8, 5)(x37())


@pytest.mark.parametrize("dtype", (torch.int64, torch.int8, torch.bool))
def test_linear_gelu_non_float_input(dtype):
    with pytest.raises(TypeError, match=r"linear_gelu: x must be float32, float64, float16 "
                                        rf"or bfloat16, got {C10_NAME[dtype]}"):
        fusedlayers.linear_gelu(torch.ones(3, 7, dtype=dtype), torch.ones(5, 7, dtype=dtype))


@pytest.mark.parametrize("w_dtype,b_dtype,match", [
    (torch.float64, None, r"weight must have x's dtype float32, got float64"),
    (torch.int64, None, r"weight must be float32, float64, float16 or bfloat16, got Long"),
    (torch.bfloat16, None, r"weight must have x's dtype float32, got bfloat16"),
    (torch.float32, torch.float64, r"bias must have x's dtype float32, got float64"),
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


# ---------------------------------------------------------------- relu_scale

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


# ---------------------------------------------------------------- argument types and frameworks

@pytest.mark.parametrize("call,match", [
    (lambda: fusedlayers.relu_scale(x37(), "2"), r"relu_scale: alpha must be a real number, "
                                                 r"got str '2'"),
    (lambda: fusedlayers.relu_scale(x37(), None), r"alpha must be a real number, got NoneType"),
    (lambda: fusedlayers.layer_norm(x37(), 7, eps="1e-5"), r"layer_norm: eps must be a real "
                                                           r"number, got str"),
    (lambda: fusedlayers.layer_norm(x37(), 7.0), r"layer_norm: normalized_shape must be an int "
                                                 r"or a sequence of ints, got float 7.0"),
    (lambda: fusedlayers.layer_norm(x37(), [7.0]), r"normalized_shape must be an int or a "
                                                   r"sequence of ints, got list"),
    (lambda: LayerNorm(7, eps="1e-5"), r"LayerNorm: eps must be a real number, got str"),
    (lambda: LayerNorm("7"), r"LayerNorm: normalized_shape must be an int or a sequence"),
    (lambda: fusedlayers.torch.FusedReLUScale(True), r"FusedReLUScale: alpha must be a real "
                                                     r"number, got bool"),
], ids=("alpha-str", "alpha-none", "eps-str", "shape-float", "shape-float-list",
        "module-eps-str", "module-shape-str", "module-alpha-bool"))
def test_argument_types(call, match):
    with pytest.raises(TypeError, match=match):
        call()


def test_tensor_of_another_framework():
    tf = pytest.importorskip("tensorflow")
    w = tf.ones((5, 7))
    with pytest.raises(TypeError, match=r"linear_gelu: x is a torch.Tensor, so weight must be "
                                        r"one too, got tensorflow\..*EagerTensor"):
        fusedlayers.linear_gelu(x37(), w)
    with pytest.raises(TypeError, match=r"layer_norm: x is a torch.Tensor, so bias must be one "
                                        r"too, got numpy.ndarray"):
        fusedlayers.layer_norm(x37(), 7, torch.ones(7), np.zeros(7, np.float32))


# ---------------------------------------------------------------- odd but valid inputs
# Every public op and layer on inputs that are legal but easy to get wrong: each equals the unfused
# reference (forward and gradients, NaN where NaN), on the CPU and on a CUDA device. Cases that
# could crash the interpreter (a kernel reading out of bounds on an empty, overlapping or
# stride-0 input, a zero-size GEMM) run in a subprocess.

def _leaf(shape, device, fill=None):
    t = torch.randn(shape, device=device)
    if fill is not None:
        t.view(-1)[:len(fill)] = torch.tensor(fill)
    return t.requires_grad_()


NONFINITE = [math.nan, math.inf, -math.inf, 0.0, -0.0]


def odd_case(name: str, device: str):
    """(leaves, fused, unfused) for the named case: fused(*leaves) and unfused(*leaves) give the
    output (unfused also on float64 copies of the leaves); gradients are taken wrt the leaves.
    The first leaf is x's storage, which view() turns into the case's input."""
    op, what = name.split(":")
    cols = 1 if what == "one-element-rows" else 6
    rows = 0 if what == "empty" else 5
    if op == "linear_gelu" and what == "in-features-0":
        cols = 0
    shape = (rows, cols)
    if what in ("transposed", "sliced", "expanded"):
        base = _leaf(leaf_shape(shape, what), device)
        view = lambda t: as_layout(t, shape, what)  # noqa: E731
    elif what == "overlapping":  # row stride 1: each row shares cols - 1 elements with the next
        base = _leaf(rows + cols - 1, device)
        view = lambda t: t.as_strided(shape, (1, 1))  # noqa: E731
    else:
        base = _leaf(shape, device, NONFINITE if what == "nonfinite" else None)
        view = lambda t: t  # noqa: E731
    if op in ("relu_scale", "FusedReLUScale"):
        alpha = {"alpha-0": 0.0, "alpha-negative": -1.5}.get(what, 0.7)
        fused = ((lambda t: fusedlayers.relu_scale(view(t), alpha)) if op == "relu_scale"
                 else (lambda t, m=fusedlayers.torch.FusedReLUScale(alpha): m(view(t))))
        return [base], fused, lambda t: torch.relu(view(t)) * alpha
    if op in ("layer_norm", "LayerNorm"):
        eps = {"eps-huge": 1e10, "eps-tiny": 1e-30, "eps-0": 0.0}.get(what, 1e-5)
        if op == "layer_norm":
            w, b = _leaf(cols, device), _leaf(cols, device)
            fused = lambda t, w, b: fusedlayers.layer_norm(view(t), cols, w, b, eps)  # noqa: E731
        else:
            m = LayerNorm(cols, eps=eps, device=device)
            with torch.no_grad():
                m.weight.normal_(), m.bias.normal_()
            w, b = m.weight, m.bias
            fused = lambda t, w, b: m(view(t))  # noqa: E731  (w, b are m's own parameters)
        return [base, w, b], fused, lambda t, w, b: F.layer_norm(view(t), (cols,), w, b, eps)
    out_f = 0 if what == "out-features-0" else 4
    if op == "linear_gelu":
        w, b = _leaf((out_f, cols), device), _leaf(out_f, device)
        fused = lambda t, w, b: fusedlayers.linear_gelu(view(t), w, b, "tanh")  # noqa: E731
    else:
        m = FusedLinearGELU(cols, out_f, approximate="tanh", device=device)
        w, b = m.weight, m.bias
        fused = lambda t, w, b: m(view(t))  # noqa: E731  (w, b are m's own parameters)
    return [base, w, b], fused, \
        lambda t, w, b: F.gelu(F.linear(view(t), w, b), approximate="tanh")


LAYOUTS = ("empty", "one-element-rows", "transposed", "sliced", "expanded", "overlapping",
           "nonfinite")
ODD_CASES = ([f"{op}:{w}" for op in ("relu_scale", "layer_norm", "linear_gelu") for w in LAYOUTS]
             + [f"{op}:{w}" for op in ("FusedReLUScale", "LayerNorm", "FusedLinearGELU")
                for w in ("empty", "expanded", "overlapping", "nonfinite")]
             + ["relu_scale:alpha-0", "relu_scale:alpha-negative", "layer_norm:eps-huge",
                "layer_norm:eps-tiny", "layer_norm:eps-0", "linear_gelu:in-features-0",
                "linear_gelu:out-features-0"])
# Could crash the interpreter if a kernel got them wrong: checked in a subprocess.
RISKY = ("empty", "expanded", "overlapping", "in-features-0", "out-features-0")


def check_odd_case(name: str, device: str) -> None:
    """The fused output and gradients (float32) equal the unfused ones computed in float64 from
    the same values, to float32 rounding; NaN where NaN."""
    leaves, fused, unfused = odd_case(name, device)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    out, ref = fused(*leaves), unfused(*leaves64)
    dy = torch.randn(out.shape, device=device, dtype=torch.float64)
    got = [out, *torch.autograd.grad(out, leaves, dy.float(), allow_unused=True)]
    want = [ref, *torch.autograd.grad(ref, leaves64, dy, allow_unused=True)]
    for i, (g, r) in enumerate(zip(got, want)):
        like = out if i == 0 else leaves[i - 1]
        g = torch.zeros_like(like) if g is None else g
        r = torch.zeros_like(like) if r is None else r.float()
        what = "output" if i == 0 else f"gradient {i}"
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, equal_nan=True,
                                   msg=lambda m: f"{name}: {what}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", [c for c in ODD_CASES if c.split(":")[1] not in RISKY])
def test_odd_input(name, device):
    check_odd_case(name, device)


@pytest.mark.parametrize("device", DEVICES)
def test_odd_input_risky_in_subprocess(device):
    """The cases that could crash, one fresh interpreter per device; it names the case running
    when it dies."""
    risky = [c for c in ODD_CASES if c.split(":")[1] in RISKY]
    assert_survives_subprocess("test_errors", f"check_odd_case_on_{device}", risky)


def check_odd_case_on_cpu(name: str) -> None:
    check_odd_case(name, "cpu")


def check_odd_case_on_cuda(name: str) -> None:
    check_odd_case(name, "cuda")


# ---------------------------------------------------------------- threads

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ("relu_scale", "layer_norm", "linear_gelu"))
def test_two_threads_same_op(op, device):
    """Two Python threads calling the same op (forward and backward) at once, on inputs of
    different shapes, get bitwise what one thread gets."""
    def call(x, w):
        if op == "relu_scale":
            return fusedlayers.relu_scale(x, 0.5)
        if op == "layer_norm":
            return fusedlayers.layer_norm(x, x.shape[-1], w)
        return fusedlayers.linear_gelu(x, w)

    def run(x, w, dy):
        y = call(x, w)
        return (y, *torch.autograd.grad(y, (x, w) if op != "relu_scale" else (x,), dy))

    cases = []
    for rows, cols in ((257, 96), (64, 1024)):
        x = torch.randn(rows, cols, device=device, requires_grad=True)
        w = torch.randn((cols,) if op == "layer_norm" else (cols // 2, cols), device=device,
                        requires_grad=True)
        dy = torch.randn(call(x, w).shape, device=device)
        cases.append(((x, w, dy), run(x, w, dy)))
    failures = concurrent_mismatches(
        run, cases, lambda got, want: all(torch.equal(g, r) for g, r in zip(got, want)))
    assert not failures, [tuple(args[0].shape) for args in failures]


# ---------------------------------------------------------------- FUSEDLAYERS_CPU_ISA

def check_cpu_isa_error(op):
    """In a fresh interpreter: the float16 CPU loops read FUSEDLAYERS_CPU_ISA on first use."""
    with pytest.raises(ValueError, match="FUSEDLAYERS_CPU_ISA must be avx512, f16c or portable, "
                                         "got 'avx9'"):
        fusedlayers.torch.layer_norm(torch.ones(2, 4, dtype=torch.float16), 4)


def test_bad_cpu_isa_is_a_clear_error():
    assert_survives_subprocess("test_errors", "check_cpu_isa_error", ["layer_norm"],
                               env_extra={"FUSEDLAYERS_CPU_ISA": "avx9"})
