"""Linear + GELU on torch tensors: `fusedlayers::linear_gelu` (backends/torch/linear_gelu.cpp:
schema, kernels, autograd, autocast), its fake kernels, the functional API and the modules
`FusedLinearGELU` (nn.Linear's layout) and `FusedConv1DGELU` (GPT-2's Conv1D layout), the unfused
reference and Inductor's lowering. The math: csrc/gemm/linear_gelu.h. Under torch.autocast it runs in the autocast dtype, as
`torch.nn.functional.linear`; float64 stays float64."""

import torch
import torch.nn.functional as F
from torch import nn

from ..bench.case import Case
from . import _op

__all__ = ["FusedConv1DGELU", "FusedLinearGELU", "dense_gelu", "linear_gelu"]
aten = torch.ops.aten
linear_gelu_op = _op.handle("linear_gelu")


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                approximate: str = "none") -> torch.Tensor:
    """y = gelu(x @ weight^T + bias), replacing `F.gelu(F.linear(x, weight, bias), approximate)`.

    x: (..., in_features); weight: (out_features, in_features), contiguous or the transpose of a
    contiguous (in_features, out_features) tensor (GPT-2's Conv1D weight `w` is passed as
    `w.t()`; neither is copied); bias: (out_features,) or None; all one floating dtype on one
    device. approximate: 'none' (erf) or 'tanh'. Returns (..., out_features). Raises ValueError
    on shape/device/approximate mismatches and TypeError on dtype mismatches. GELU: Hendrycks &
    Gimpel 2016, arXiv:1606.08415.
    """
    return linear_gelu_op(x, weight, bias, approximate)


def dense_gelu(x: torch.Tensor, kernel: torch.Tensor, bias: torch.Tensor | None = None,
               approximate: str = "none") -> torch.Tensor:
    """gelu(x @ kernel + bias) with a Keras Dense kernel (in_features, out_features), read in
    place."""
    return linear_gelu_op(x, kernel.t(), bias, approximate)


class FusedLinearGELU(nn.Module):
    """gelu(x @ weight^T + bias); replaces `nn.Linear(in_features, out_features)` + `nn.GELU()`.

    Parameters, initialisation and state_dict keys are nn.Linear's: weight (out_features,
    in_features), bias (out_features,). Input (..., in_features) -> output (..., out_features).
    approximate: 'none' (erf GELU) or 'tanh', as nn.GELU.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 approximate: str = "none", device=None, dtype=None):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"FusedLinearGELU: approximate must be 'none' or 'tanh', "
                             f"got {approximate!r}")
        factory = {"device": device, "dtype": dtype}
        self.in_features, self.out_features, self.approximate = in_features, out_features, approximate
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    reset_parameters = nn.Linear.reset_parameters  # identical initialisation to nn.Linear

    @classmethod
    def from_linear(cls, linear: nn.Module, approximate: str = "none") -> "FusedLinearGELU":
        """A FusedLinearGELU sharing the Parameters of `linear` (an nn.Linear, or any module
        with an (out_features, in_features) `weight` and a `bias` used as nn.Linear uses them):
        fuses `linear` + GELU, copying nothing."""
        out_features, in_features = linear.weight.shape
        fused = cls(in_features, out_features, bias=linear.bias is not None,
                    approximate=approximate, device="meta")
        fused.weight, fused.bias = linear.weight, linear.bias
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_gelu_op(x, self.weight, self.bias, self.approximate)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, approximate={self.approximate!r}")


class FusedConv1DGELU(nn.Module):
    """gelu(x @ weight + bias) with the weight stored (in_features, out_features), as GPT-2's
    `Conv1D` (transformers.pytorch_utils) keeps it; replaces `Conv1D(nf, nx)` + GELU with its
    parameters, initialisation and state_dict keys: weight (nx, nf), bias (nf,). The weight is
    read in place and its gradient written in the same layout: nothing is transposed or copied.

    Input (..., nx) -> output (..., nf). approximate: 'none' (erf GELU) or 'tanh' (GPT-2's
    `gelu_new`).
    """

    def __init__(self, nf: int, nx: int, approximate: str = "none", device=None, dtype=None):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"FusedConv1DGELU: approximate must be 'none' or 'tanh', "
                             f"got {approximate!r}")
        self.nf, self.nx, self.approximate = nf, nx, approximate
        self.weight = nn.Parameter(torch.empty(nx, nf, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(nf, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=0.02)  # as Conv1D

    @classmethod
    def from_conv1d(cls, conv1d: nn.Module, approximate: str = "none") -> "FusedConv1DGELU":
        """A FusedConv1DGELU sharing the Parameters of `conv1d` (any module computing
        `x @ weight + bias` with weight (in_features, out_features)), copying nothing."""
        nx, nf = conv1d.weight.shape
        fused = cls(nf, nx, approximate=approximate, device="meta")
        fused.weight, fused.bias = conv1d.weight, conv1d.bias
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_gelu_op(x, self.weight.t(), self.bias, self.approximate)

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}, approximate={self.approximate!r}"


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              approximate: str = "none") -> torch.Tensor:
    """The unfused computation linear_gelu replaces."""
    return F.gelu(F.linear(x, weight, bias), approximate=approximate)


@_op.register_fake("linear_gelu")
def _(x, weight, bias, approximate):
    _op.check_devices("linear_gelu", "x", x, weight=weight, bias=bias)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@_op.register_fake("linear_gelu_with_pre")
def _(x, weight, bias, approximate):
    _op.check_devices("linear_gelu", "x", x, weight=weight, bias=bias)
    shape = (*x.shape[:-1], weight.shape[0])
    return x.new_empty(shape), x.new_empty(shape)


def _in_out(weight: torch.Tensor) -> bool:
    """Whether weight is the transpose of a contiguous (in, out) tensor (read in place)."""
    return not weight.is_contiguous() and weight.t().is_contiguous()


@_op.register_fake("linear_gelu_backward")
def _(dy, x, weight, pre, has_bias, approximate):
    _op.check_devices("linear_gelu_backward", "x", x, dy=dy, weight=weight)
    # dweight in weight's layout: (in, out) storage when weight is such a transpose.
    dweight = (weight.new_empty(weight.shape[::-1]).t() if _in_out(weight)
               else weight.new_empty(weight.shape))
    return x.new_empty(x.shape), dweight, x.new_empty(weight.shape[0] if has_bias else 0)


# ---------------------------------------------------------------- Inductor's lowering

def _with_pre(x, weight, bias, approximate):
    pre = F.linear(x, weight, bias)
    return F.gelu(pre, approximate=approximate), pre


def _backward(dy, x, weight, pre, has_bias, approximate):
    dpre = aten.gelu_backward.default(dy, pre, approximate=approximate)
    dpre = dpre.reshape(-1, dpre.shape[-1])
    x2 = x.reshape(-1, x.shape[-1])
    dx = (dpre @ weight).reshape(x.shape)
    dweight = (x2.t() @ dpre).t() if _in_out(weight) else dpre.t() @ x2
    dbias = dpre.sum(0) if has_bias else x.new_empty(0)
    return dx, dweight, dbias


DECOMPOSITIONS = {"linear_gelu": reference, "linear_gelu_with_pre": _with_pre,
                  "linear_gelu_backward": _backward}


def bench_case(shape, dtype: torch.dtype, device: torch.device, peers: bool = False) -> Case:
    """At a layer's scales: x ~ N(0, 1), weight and bias ~ N(0, 1 / in_features) (nn.Linear's
    range), so the pre-activation is ~ N(0, 1) (GELU's cost depends on it: tanh's and exp's
    slow paths serve large arguments)."""
    m, k, n = shape
    x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
    w, b = ((torch.randn(*s, device=device) / k ** 0.5).to(dtype).requires_grad_()
            for s in ((n, k), (n,)))
    flops = 2 * m * n * k
    # The tanh form against its own unfused computation; PyTorch's own cuBLASLt GELU_BIAS
    # epilogue (tanh, CUDA only). The bare GEMMs of the same shape (forward; with the backward,
    # dgrad and wgrad too): the floor under any epilogue.
    case = Case(lambda: linear_gelu(x, w, b), lambda: reference(x, w, b), [x, w, b],
                {"fwd": flops, "fwd+bwd": 3 * flops},
                variants={"fused-tanh": lambda: linear_gelu(x, w, b, "tanh"),
                          "eager-tanh": lambda: reference(x, w, b, "tanh"),
                          "gemm": (lambda: x @ w.t(), [w])})
    if device.type == "cuda":
        case.fwd_only["addmm-act"] = lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True)
    return case
