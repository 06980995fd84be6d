"""GeGLU on torch tensors: `fusedlayers::geglu` (backends/torch/gated.cpp: schema, kernels,
autograd, autocast), its fake kernels, the functional API, `GeGLUMLP` (fuse()'s module for
Gemma-style MLPs), the unfused reference and Inductor's lowering. The math: csrc/activation/gated.h."""

import torch
import torch.nn.functional as F

from ..bench.case import Case
from . import _op
from .gated_mlp import GatedMLP, gated_bench_case

__all__ = ["GeGLUMLP", "geglu"]
geglu_op = _op.handle("geglu")


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(gate) * up in one pass, replacing `F.gelu(gate, approximate=approximate) * up`
    (Shazeer 2020, "GLU Variants Improve Transformer", arXiv:2002.05202; Gemma's MLP uses
    approximate='tanh'). GELU's forms: Hendrycks & Gimpel 2016 (csrc/activation/gelu.h).

    gate, up: one shape and dtype, float32/float64/float16/bfloat16, any layout (the halves of
    one projection split with chunk(2, -1) are read in place). approximate: 'none' (erf) or
    'tanh'. Math in float32 (float64 for float64), rounded once. Returns a contiguous tensor of
    gate's shape and dtype; autograd saves gate and up and recomputes GELU in the backward.
    Raises TypeError for other dtypes or a non-str approximate, ValueError for mismatched shapes
    or devices or another approximate.
    """
    return geglu_op(gate, up, approximate)


def reference(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """The unfused computation geglu replaces."""
    return F.gelu(gate, approximate=approximate) * up


class GeGLUMLP(GatedMLP):
    """down(gelu(gate(x)) * up(x)) with the activation and product fused (`geglu`): the MLP of
    Gemma (tanh GELU). It holds the MLP's own projection modules under their own names
    (GatedMLP)."""

    activation = "gelu"

    def gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return geglu_op(gate, up, self.approximate)


FUSED_MODULE = GeGLUMLP  # fuse() swaps modules by GeGLUMLP.fuse_candidates


@_op.register_fake("geglu")
def _(gate, up, approximate="none"):
    _op.check_devices("geglu", "gate", gate, up=up)
    return gate.new_empty(gate.shape)


@_op.register_fake("geglu_backward")
def _(dy, gate, up, approximate):
    _op.check_devices("geglu_backward", "dy", dy, gate=gate, up=up)
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


# ---------------------------------------------------------------- Inductor's lowering

def _acc(t):
    return t if t.dtype == torch.float64 else t.float()


def _forward(gate, up, approximate="none"):
    return (F.gelu(_acc(gate), approximate=approximate) * _acc(up)).to(gate.dtype)


def _backward(dy, gate, up, approximate):
    g, d = _acc(gate), _acc(dy)
    act = F.gelu(g, approximate=approximate)
    # gelu'(g) through ATen's own gelu_backward
    grad = torch.ops.aten.gelu_backward(torch.ones_like(g), g, approximate=approximate)
    return (d * _acc(up) * grad).to(gate.dtype), (d * act).to(gate.dtype)


DECOMPOSITIONS = {"geglu": _forward, "geglu_backward": _backward}


def bench_case(shape, dtype: torch.dtype, device: torch.device, peers: bool = False) -> Case:
    peer = None
    if peers and device.type == "cuda":
        try:  # Liger's GeGLU is the tanh form only
            from liger_kernel.ops.geglu import LigerGELUMulFunction
            peer = LigerGELUMulFunction.apply
        except ImportError:
            pass
    return gated_bench_case(shape, dtype, device, lambda g, u: geglu(g, u, "tanh"),
                            lambda g, u: reference(g, u, "tanh"), peer)
